"""How busy a preprocessor's worker slots are: the ``busy_ratio`` gauge the autoscaler reads."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class BusyMeter:
    """Share of ``slots`` worker slots spent working over the last ``window_s`` seconds.

    ``with meter.busy(): ...`` marks one slot busy. :meth:`ratio` is in [0, 1]: 1 means every
    slot worked the whole window (the autoscaler reads it as saturation). Before a full window
    has passed since creation, the ratio is over the time elapsed so far.
    """

    def __init__(self, *, window_s: float, slots: int) -> None:
        if window_s <= 0 or slots < 1:
            raise ValueError("window_s must be > 0 and slots >= 1")
        self._window_s = window_s
        self._slots = slots
        self._created = time.monotonic()
        self._done: deque[tuple[float, float]] = deque()
        """Finished (start, end) intervals, oldest first, pruned past the window."""
        self._running: dict[int, float] = {}
        self._next_token = 0

    @contextmanager
    def busy(self) -> Iterator[None]:
        token = self._next_token
        self._next_token += 1
        self._running[token] = time.monotonic()
        try:
            yield
        finally:
            self._done.append((self._running.pop(token), time.monotonic()))

    def ratio(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        window_start = max(now - self._window_s, self._created)
        while self._done and self._done[0][1] <= window_start:
            self._done.popleft()
        spans = [*self._done, *((start, now) for start in self._running.values())]
        busy_s = sum(max(0.0, min(end, now) - max(start, window_start)) for start, end in spans)
        elapsed_s = now - window_start
        if elapsed_s <= 0:
            return 0.0
        return min(1.0, busy_s / (elapsed_s * self._slots))
