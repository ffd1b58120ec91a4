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
