"""The value checks of every config dataclass: one function and one wording per rule.

Owned here: `require_int`, `require_number`, `require_choice` and `require_bool`. Each raises
`ConfigError(key, value, rule, hint)` whose rule states the whole contract, so a user reads the
same sentence whether the type or the range was wrong:

    num_ranks = 0: must be an integer >= 1
    num_ranks = True: must be an integer >= 1
    stage_timeout_s = '10': must be a finite number of seconds > 0
    top_p = 0: must be a finite number in (0, 1]
    device = 'tpu': must be one of auto, cpu, cuda
    shuffle = 'yes': must be true or false

A bool is never an integer or a number here (YAML `yes` must not become 1). `optional=True`
also accepts None and says "or null". Keys are relative (`num_ranks`); the recipe loader
prefixes the dotted path. A leaf module: it imports `config.errors` and the standard library
only, so every layer of the package may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from megatron_async_rl.config.errors import ConfigError


def _bound(value: float) -> str:
    return f"{value:g}"


def _range(
    gt: float | None, ge: float | None, lt: float | None, le: float | None
) -> tuple[str, Any]:
    """The range in words ("> 0", "in [0, 1)", "") and a test of a value against it."""
    if (gt is not None and ge is not None) or (lt is not None and le is not None):
        raise TypeError("give at most one lower (gt, ge) and one upper (lt, le) bound")
    low = (gt, "(", ">") if gt is not None else (ge, "[", ">=") if ge is not None else None
    high = (lt, ")", "<") if lt is not None else (le, "]", "<=") if le is not None else None

    def ok(v: float) -> bool:
        return (
            (gt is None or v > gt)
            and (ge is None or v >= ge)
            and (lt is None or v < lt)
            and (le is None or v <= le)
        )

    if low and high:
        return f" in {low[1]}{_bound(low[0])}, {_bound(high[0])}{high[1]}", ok
    if low:
        return f" {low[2]} {_bound(low[0])}", ok
    if high:
        return f" {high[2]} {_bound(high[0])}", ok
    return "", ok


def require_int(
    key: str,
    value: Any,
    minimum: int | None = None,
    *,
    maximum: int | None = None,
    optional: bool = False,
    hint: str | None = None,
) -> int | None:
    """`value` if it is an integer (not a bool) in [minimum, maximum]; else a ConfigError
    whose rule reads "must be an integer >= minimum" (plus "or null" when `optional`)."""
    words, ok = _range(None, minimum, None, maximum)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        rule = f"must be an integer{words}" + (" or null" if optional else "")
        raise ConfigError(key, value, rule, hint)
    return value


def require_number(
    key: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    unit: str | None = None,
    optional: bool = False,
    hint: str | None = None,
) -> float | None:
    """`value` as a float if it is a finite int or float (not a bool) within the bounds; else a
    ConfigError whose rule reads "must be a finite number [of <unit>] > 0" or "... in (0, 1]"."""
    words, ok = _range(gt, ge, lt, le)
    if value is None and optional:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        noun = "a finite number" + (f" of {unit}" if unit else "")
        rule = f"must be {noun}{words}" + (" or null" if optional else "")
        raise ConfigError(key, value, rule, hint)
    return float(value)


def require_choice(key: str, value: Any, choices: Iterable[str], hint: str | None = None) -> str:
    """`value` if it is one of `choices`; else a ConfigError "must be one of a, b, c"."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(key, value, f"must be one of {', '.join(choices)}", hint)
    return value


def require_bool(key: str, value: Any, hint: str | None = None) -> bool:
    """`value` if it is a bool; else a ConfigError "must be true or false"."""
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false", hint)
    return value
