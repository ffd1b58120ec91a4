"""A clock a test advances by hand, for code that takes a `clock` callable (the scheduler's
`StageMachine`); used by `tests/unit/test_scheduler_machine.py` and `test_scheduler_states.py`."""

from __future__ import annotations


class FakeClock:
    """Returns `now` (seconds, starting at 100.0) when called; `advance` moves it forward."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
