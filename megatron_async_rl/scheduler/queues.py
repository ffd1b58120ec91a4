"""Bounded queues between pipeline stages: back-pressure, timeouts that explain themselves, close.

Owned here: `BoundedQueue` and `QueueClosed`. The scheduler thread of a rank puts a stage's
results into the queue of the next stage and takes its inputs from the queue before it; a full
queue stops the producer (its machine sits in WAITING_OUTPUT_SPACE), an empty one the consumer
(WAITING_INPUT). Capacity is counted in items (one item is one step's batch), so `capacity`
bounds how much memory waits between two stages.

Contract:
- FIFO: items come out in the order they went in.
- `put` blocks while the queue is full, `get` while it is empty, each for at most `timeout_s`;
  then `StageTimeout` names the queue, what was awaited ("space in queue rollouts (capacity 2,
  size 2)" or "an item in queue rollouts (empty)"), the seconds waited, and the caller's
  `context` (role, rank, stage, state; see `StageMachine.context`).
- `close()` ends the stream: `put` raises `QueueClosed` from then on; `get` still returns the
  items already queued, then raises `QueueClosed`. Threads blocked in either are woken.

Timeouts run on the real monotonic clock (`threading.Condition.wait`); `clock` only measures
the waits reported in diagnostics and metrics, so tests may pass a fake one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from megatron_async_rl.scheduler.states import StageTimeout

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was closed: no more items will come (get) or be accepted (put)."""


class BoundedQueue(Generic[T]):
    """A FIFO of at most `capacity` items, shared by a producer and a consumer thread."""

    def __init__(
        self, name: str, capacity: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"queue {name}: capacity = {capacity!r}: must be an integer >= 1")
        self.name = name
        self.capacity = capacity
        self._clock = clock
        self._items: deque[T] = deque()
        self._closed = False
        self._cond = threading.Condition()
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0
        self._max_size = 0

    def put(self, item: T, timeout_s: float, context: Mapping[str, Any] | None = None) -> None:
        """Append `item`, waiting up to `timeout_s` for space. Raises StageTimeout or
        QueueClosed."""
        with self._cond:
            start = self._clock()
            ready = self._cond.wait_for(lambda: self._closed or self._has_space(), timeout_s)
            waited = self._clock() - start
            self._put_wait_s += waited
            if self._closed:
                raise QueueClosed(f"queue {self.name} is closed: cannot put")
            if not ready:
                raise StageTimeout(self._space_text(), waited, timeout_s, context, self.name)
            self._append(item)

    def get(self, timeout_s: float | None, context: Mapping[str, Any] | None = None) -> T:
        """Take the oldest item, waiting up to `timeout_s` for one (None: until one comes or the
        queue closes). Raises StageTimeout, or QueueClosed once the queue is closed and drained."""
        with self._cond:
            start = self._clock()
            ready = self._cond.wait_for(lambda: self._closed or bool(self._items), timeout_s)
            waited = self._clock() - start
            self._get_wait_s += waited
            if self._items:
                return self._pop()
            if self._closed:
                raise QueueClosed(f"queue {self.name} is closed and drained")
            assert not ready
            raise StageTimeout(self._item_text(), waited, timeout_s, context, self.name)

    def try_put(self, item: T) -> bool:
        """Append `item` if there is space now; False if full. Raises QueueClosed."""
        with self._cond:
            if self._closed:
                raise QueueClosed(f"queue {self.name} is closed: cannot put")
            if not self._has_space():
                return False
            self._append(item)
            return True

    def try_get(self) -> tuple[bool, T | None]:
        """(True, the oldest item) if there is one now, else (False, None). Raises QueueClosed
        once the queue is closed and drained."""
        with self._cond:
            if self._items:
                return True, self._pop()
            if self._closed:
                raise QueueClosed(f"queue {self.name} is closed and drained")
            return False, None

    def peek(self) -> tuple[bool, T | None]:
        """(True, the oldest item) without taking it, else (False, None); for a consumer
        whose start depends on the item (e.g. the step it belongs to). Raises QueueClosed once
        the queue is closed and drained."""
        with self._cond:
            if self._items:
                return True, self._items[0]
            if self._closed:
                raise QueueClosed(f"queue {self.name} is closed and drained")
            return False, None

    def has_space(self) -> bool:
        """Whether a put would succeed now (the answer holds while this thread is the only
        producer)."""
        with self._cond:
            return self._has_space()

    def close(self) -> None:
        """End the stream (idempotent); wakes every waiting thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def metrics(self, prefix: str = "queue") -> dict[str, float]:
        """`<prefix>/<name>/size`, `max_size`, and the seconds producers and consumers spent
        blocked (`put_wait_s`, `get_wait_s`) since creation."""
        with self._cond:
            base = f"{prefix}/{self.name}"
            return {
                f"{base}/size": float(len(self._items)),
                f"{base}/max_size": float(self._max_size),
                f"{base}/put_wait_s": self._put_wait_s,
                f"{base}/get_wait_s": self._get_wait_s,
            }

    def _has_space(self) -> bool:
        return len(self._items) < self.capacity

    def _append(self, item: T) -> None:
        self._items.append(item)
        self._max_size = max(self._max_size, len(self._items))
        self._cond.notify_all()

    def _pop(self) -> T:
        item = self._items.popleft()
        self._cond.notify_all()
        return item

    def _space_text(self) -> str:
        return f"space in queue {self.name} (capacity {self.capacity}, size {len(self._items)})"

    def _item_text(self) -> str:
        return f"an item in queue {self.name} (empty)"

    def __repr__(self) -> str:
        return f"BoundedQueue({self.name}, {self.qsize()}/{self.capacity})"
