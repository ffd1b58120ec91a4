"""The synthetic arithmetic task of the quick start: problems, JSONL files and a held-out split.

Owned here: the problem set (`a<op>b=` for operands 0..max_operand), `split_problems` (disjoint
train / held-out problems) and `write_arithmetic_dataset`, plus its command line:

    python -m megatron_async_rl.tasks.arithmetic --out runs/arith/train.jsonl \\
        --num-rows 2000 --seed 0 [--heldout-out runs/arith/eval.jsonl --heldout-fraction 0.2]

Rows are `{"prompt": "3+5=", "answer": "8"}`: prompts use only digits, `+ - *` and `=`, all
single tokens of the tiny tokenizer (`models/tiny.py`), and the answer is the exact integer
(negative for `-` when b > a). Read by `rollout/dataset.py`, scored by `tasks/arithmetic_reward.py`,
used by `tasks/warm_start.py` and the CPU recipes. Plain Python: no torch, no megatron.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from megatron_async_rl.config.checks import require_int, require_number

logger = logging.getLogger(__name__)

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def all_problems(max_operand: int = 9, ops: Sequence[str] = ("+",)) -> list[tuple[int, str, int]]:
    """Every (a, op, b) with 0 <= a, b <= max_operand, in a fixed order."""
    require_int("max_operand", max_operand, 1)
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops = {tuple(ops)!r}: each must be one of {', '.join(OPS)}")
    return [
        (a, op, b)
        for op in dict.fromkeys(ops)
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def problem_row(problem: tuple[int, str, int]) -> dict[str, str]:
    """The dataset row of one problem."""
    a, op, b = problem
    return {"prompt": f"{a}{op}{b}=", "answer": str(OPS[op](a, b))}


def split_problems(
    problems: Sequence[tuple[int, str, int]], heldout_fraction: float, seed: int
) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """(train, held-out): a seeded partition, so no held-out prompt is ever trained on."""
    require_number("heldout_fraction", heldout_fraction, gt=0, lt=1)
    shuffled = list(problems)
    random.Random(seed).shuffle(shuffled)
    num_heldout = max(1, round(len(shuffled) * heldout_fraction))
    if num_heldout >= len(shuffled):
        raise ValueError(f"heldout_fraction = {heldout_fraction} leaves no training problem")
    return shuffled[num_heldout:], shuffled[:num_heldout]


def write_arithmetic_dataset(
    path: str | Path,
    num_rows: int,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    problems: Sequence[tuple[int, str, int]] | None = None,
) -> Path:
    """Writes `num_rows` rows drawn uniformly (seeded, with repeats) from `problems`.

    `problems` defaults to every problem of (max_operand, ops); pass one side of
    `split_problems` to keep train and held-out files disjoint.
    """
    require_int("num_rows", num_rows, 1)
    pool = list(problems) if problems is not None else all_problems(max_operand, ops)
    if not pool:
        raise ValueError("problems is empty: nothing to write")
    rng = random.Random(seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for _ in range(num_rows):
            handle.write(json.dumps(problem_row(rng.choice(pool))) + "\n")
    logger.info("wrote %d arithmetic rows (%d distinct problems) to %s", num_rows, len(pool), out)
    return out


def write_heldout_split(
    train_path: str | Path,
    heldout_path: str | Path,
    num_rows: int,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    heldout_fraction: float = 0.2,
) -> tuple[Path, Path]:
    """A training file of `num_rows` rows and a held-out file with each held-out problem once."""
    train, heldout = split_problems(all_problems(max_operand, ops), heldout_fraction, seed)
    train_out = write_arithmetic_dataset(train_path, num_rows, seed, problems=train)
    heldout_out = Path(heldout_path)
    heldout_out.parent.mkdir(parents=True, exist_ok=True)
    heldout_out.write_text("".join(json.dumps(problem_row(p)) + "\n" for p in sorted(heldout)))
    return train_out, heldout_out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="training JSONL file to write")
    parser.add_argument("--num-rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--ops", default="+", help="operators to use, e.g. '+-'")
    parser.add_argument("--heldout-out", default=None, help="also write disjoint held-out rows")
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    args = parser.parse_args(argv)
    ops = tuple(args.ops)
    try:
        if args.heldout_out is None:
            return write_arithmetic_dataset(
                args.out, args.num_rows, args.seed, args.max_operand, ops
            )
        train_path, _ = write_heldout_split(
            args.out,
            args.heldout_out,
            args.num_rows,
            args.seed,
            args.max_operand,
            ops,
            args.heldout_fraction,
        )
        return train_path
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
