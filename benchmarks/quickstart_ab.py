"""The quick start's synchronous step under a few recipe variants, run in alternating rounds.

    .venv/bin/python benchmarks/quickstart_ab.py --variant '' \
        --variant 'engine.server_args={disable_radix_cache: true, skip_tokenizer_init: false}' \
        [--rounds 4] [--steps 30] [--out runs/bench-quickstart-ab]

Each `--variant` is a `;`-separated list of `--set` items ('' is the recipe as it ships) on top
of the settings `vs_trl.py` times the quick start with (its model and data, only `train` placed,
every response forced to 4 tokens, no validation or checkpoints). The variants run one after
another in each round, in reverse order every other round, so that a drift of a shared
machine's speed favours none of them; each run starts from an empty run directory. Prints each
run's medians over steps 1+ (step, generate, train, weight sync), then each variant's median
over the rounds, and a last line `RESULT v0_step_s=.. v1_step_s=.. ... v1_vs_v0=..` (each
variant's median step over the first variant's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import vs_trl  # noqa: E402

KEYS = ("step_s", "generate_s", "train_s", "weight_sync_s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", required=True,
                        help="';'-separated --set items of one variant ('': as it ships)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-quickstart-ab")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        sys.exit(f"--rounds {args.rounds} --steps {args.steps}: need at least 1 round and 2 "
                 "steps (step 0 warms up)")  # fmt: skip
    variants = [[item.strip() for item in v.split(";") if item.strip()] for v in args.variant]
    model, data = vs_trl.quickstart_inputs()
    tokens = vs_trl.SIZES["quickstart"][2]
    runs: list[list[dict]] = [[] for _ in variants]
    for index in range(args.rounds):
        order = range(len(variants)) if index % 2 == 0 else reversed(range(len(variants)))
        for v in order:
            rows = vs_trl.run_ours("quickstart", "sync", model, data, args.out, args.steps,
                                   tokens, True, "[train]", label=f"v{v}",
                                   extra_sets=variants[v])  # fmt: skip
            runs[v].append({k: vs_trl.median(rows, k) for k in KEYS})
            print(f"round {index + 1} v{v}: " + "  ".join(
                f"{k[:-2]} {runs[v][-1][k]:.4f}" for k in KEYS), flush=True)  # fmt: skip
    result = {}
    for v, items in enumerate(variants):
        medians = {k: statistics.median(run[k] for run in runs[v]) for k in KEYS}
        print(f"v{v} {items or '(as it ships)'}: " + "  ".join(
            f"{k[:-2]} {medians[k]:.4f}" for k in KEYS))  # fmt: skip
        result[f"v{v}_step_s"] = medians["step_s"]
    for v in range(1, len(variants)):
        result[f"v{v}_vs_v0"] = result[f"v{v}_step_s"] / result["v0_step_s"]
    print("RESULT " + " ".join(f"{k}={value:.4f}" for k, value in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
