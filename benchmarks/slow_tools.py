"""A tool with latency, for `benchmarks/multiturn_tools.py` (worker processes import it)."""

import time


def add(a: int, b: int) -> int:
    """Adds two integers (after 100 ms: a tool with latency).

    Args:
        a: The first integer.
        b: The second integer.
    """
    time.sleep(0.1)
    return int(a) + int(b)


def sandboxed_add(a: int, b: int) -> int:
    """Adds two integers in the sandbox, taking 200 ms (a sandboxed tool with latency).

    Args:
        a: The first integer.
        b: The second integer.
    """
    from megatron_async_rl.sandbox.run import run_code

    result = run_code("python", f"import time\ntime.sleep(0.2)\nprint({int(a)} + {int(b)})")
    if not result.ok:
        raise RuntimeError(f"the sandbox did not add: {result}")
    return int(result.stdout)
