"""The calculator task: sums too long for a tiny model, a tool that adds, and a price list.

Owned here: the tools of the CPU tool-use recipes (`yaml_configs/tiny-tools-cpu.yaml`), each a
module-level function with type hints and a Google-style docstring (the chat template's schema
is made from them, `rollout/tools.py`), and the task's rows:

- `add(a, b)`: `{"prompt": "348+576=", "answer": "924"}` rows; the model calls
  `add` with the prompt's numbers and copies the result.
- `price(item)` then `add`: `{"prompt": "pear+348=", "answer": "371"}` rows (two steps: look
  up the price, then add it to the number): more than one turn matters.

    python -m megatron_async_rl.tasks.calculator --out runs/calc/train.jsonl --num-rows 2000

Plain Python: the tools run in worker processes (`processes/worker_pool.py`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PRICES = {"apple": 17, "pear": 23, "fig": 41, "plum": 58, "kiwi": 66, "lime": 72, "date": 85,
          "peach": 94}  # fmt: skip


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return int(a) + int(b)


def price(item: str) -> int:
    """The price of a fruit, in cents.

    Args:
        item: The fruit's name, e.g. "pear".
    """
    if item not in PRICES:
        raise KeyError(f"no price for {item!r}; known: {', '.join(sorted(PRICES))}")
    return PRICES[item]


def operand_pairs(num_rows: int, seed: int, digits: int = 3) -> list[tuple[int, int]]:
    """`num_rows` pairs of `digits`-digit numbers, drawn from `seed`."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(num_rows)]


def sum_rows(num_rows: int, seed: int, digits: int = 3) -> list[dict]:
    """`a+b=` rows with `digits`-digit operands."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
            for a, b in operand_pairs(num_rows, seed, digits)]  # fmt: skip


def price_rows(num_rows: int, seed: int, digits: int = 3) -> list[dict]:
    """`fruit+n=` rows (the answer: the fruit's price plus n, a `digits`-digit number)."""
    rng = random.Random(seed)
    names = sorted(PRICES)
    rows = []
    for _ in range(num_rows):
        name, n = rng.choice(names), rng.randint(10 ** (digits - 1), 10**digits - 1)
        rows.append({"prompt": f"{name}+{n}=", "answer": str(PRICES[name] + n)})
    return rows


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=("sum", "price"), default="sum")
    parser.add_argument("--digits", type=int, default=3)
    args = parser.parse_args(argv)
    if args.task == "sum":
        rows = sum_rows(args.num_rows, args.seed, args.digits)
    else:
        rows = price_rows(args.num_rows, args.seed, args.digits)
    return write_rows(args.out, rows)


if __name__ == "__main__":
    main()
