"""The code task: the model writes a Python program, the sandbox runs it, the model answers with
what it printed.

Owned here: the task's rows (`{"prompt": "348*576=", "answer": "200448"}`, products of two
3-digit numbers, past what a tiny model computes in its head) and the program the warm start
teaches, `print(348*576)`, called through the built-in `python` tool
(`environment.tools: [python]`, `yaml_configs/tiny-code-cpu.yaml`): the tool runs it in the
sandbox (`megatron_async_rl.sandbox`) and answers `exit status 0`, then `stdout:` and the
printed number; the `arithmetic` reward scores the model's final answer. GRPO must learn to
write the prompt's numbers into the program and to copy what it printed.

    python -m megatron_async_rl.tasks.code_task --out runs/code/train.jsonl --num-rows 2000

`tool_answer` is the tool's answer to a program, what the warm start trains on: for the
program it teaches (two integers multiplied and printed) it is computed here, as the sandbox
would answer it (a test checks it against the sandbox's answer), so the warm start runs no
sandbox for its ~20,000 examples; any other program runs in the sandbox.
"""

from __future__ import annotations

import argparse
import re

from megatron_async_rl.tasks.calculator import operand_pairs, write_rows

_PRODUCT = re.compile(r"print\((\d{1,6})\*(\d{1,6})\)")


def product_rows(num_rows: int, seed: int, digits: int = 3) -> list[dict]:
    """`a*b=` rows with `digits`-digit operands."""
    return [{"prompt": f"{a}*{b}=", "answer": str(a * b)}
            for a, b in operand_pairs(num_rows, seed, digits)]  # fmt: skip


def program(a: int, b: int) -> str:
    return f"print({a}*{b})"


def tool_answer(code: str) -> str:
    """What the `python` tool answers to `code`."""
    from megatron_async_rl.sandbox.run import SandboxResult
    from megatron_async_rl.sandbox.tools import answer, python

    match = _PRODUCT.fullmatch(code)
    if match is None:
        return str(python(code))
    a, b = map(int, match.groups())
    return str(answer(SandboxResult(0, f"{a * b}\n", "")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=3)
    args = parser.parse_args(argv)
    write_rows(args.out, product_rows(args.num_rows, args.seed, args.digits))


if __name__ == "__main__":
    main()
