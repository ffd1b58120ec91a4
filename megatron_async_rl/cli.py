"""The command line of `python -m megatron_async_rl.train`.

Owned here: splitting argv into our options and the Megatron-LM flags after `--`. Called by
`train.main`. A bad option exits with code 2 and one message naming it (argparse's own rule).
"""

from __future__ import annotations

import argparse
import dataclasses

CONTRACT = """\
data rows (data.path, .jsonl or .parquet; validation.data alike), one object each:
  {"prompt": "3+5=", "answer": "8", "metadata": {...}}        or
  {"messages": [{"role": "user", "content": "..."}], "answer": "8"}
  answer: a string or a number (required unless data.answer_required: false; then "");
  metadata: optional; the reward gets it plus "prompt" (text or messages) and "row" (the
  row's fields).
reward (reward.name): math | arithmetic | remote | my_pkg.module:function, where
  def function(response_text: str, answer: str, metadata: dict) -> float
  (names and order checked; `async def` too, a step's samples awaited at once; an object
  with score_batch(items) gets them in one call; a failure scores 0 and counts in
  reward/errors; more than reward.max_error_rate of a step's samples failing stops the run).
--dry-run checks the recipe, the flags, the layout, the reward, the data and the tokenizer."""


@dataclasses.dataclass(frozen=True)
class CommandLine:
    config: str
    sets: list[str]
    run_dir: str | None
    dry_run: bool
    world_size: int | None
    ranks_per_node: int | None
    megatron_argv: list[str]
    resume: str | None = None
    here: bool = False
    """--dry-run --here: the dry run runs where the job will (the launchers): every path the
    run reads must exist, as on the ranks."""


def parse_command_line(argv: list[str]) -> CommandLine:
    """`--config R [--set a.b=c ...] [--run-dir D] [--resume M] [--dry-run [--world-size N]]
    [--ranks-per-node G] [-- flags]`."""
    if "--" in argv:
        cut = argv.index("--")
        ours, megatron_argv = argv[:cut], argv[cut + 1 :]
    else:
        ours, megatron_argv = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m megatron_async_rl.train",
        description="Asynchronous RL on Megatron-core roles. Megatron-LM flags go after `--`.",
        epilog=CONTRACT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="recipe YAML (see yaml_configs/)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set roles.groups[0].num_ranks=2 (repeatable)",
    )
    parser.add_argument("--run-dir", help="where every output of the run goes (recipe: run_dir)")
    parser.add_argument(
        "--resume",
        metavar="auto|never|PATH",
        help="auto: the newest complete checkpoint in checkpoint.directory, if any (default); "
        "never: start from the HF checkpoint; PATH: that checkpoint (recipe: checkpoint.resume)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the recipe and check the layout for --world-size ranks, then exit",
    )
    parser.add_argument(
        "--here",
        action="store_true",
        help="with --dry-run: this machine is where the job runs, so the checkpoint, data and "
        "tokenizer must be here (the launchers pass it); without it a dry run skips paths it "
        "cannot see, with a warning",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        help="world size for --dry-run (default: $WORLD_SIZE, else 1)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        help="ranks on each node, to check that no SGLang engine (engine.tp_size ranks) spans "
        "two nodes (default: $LOCAL_WORLD_SIZE, which torchrun sets; else not checked)",
    )
    args = parser.parse_args(ours)
    if args.here and not args.dry_run:
        parser.error("argument --here: only with --dry-run")
    for name in ("world_size", "ranks_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {value}")
    return CommandLine(
        config=args.config,
        sets=args.sets,
        run_dir=args.run_dir,
        dry_run=args.dry_run,
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        megatron_argv=megatron_argv,
        resume=args.resume,
        here=args.here,
    )
