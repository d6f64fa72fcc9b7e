"""Per-process helpers of the preprocessor: the open-dataset cache and the busy meter."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets import Dataset, DatasetUnavailable, open_dataset


class DatasetCache:
    """Open datasets by URI, least recently used dropped past ``size``.

    :meth:`get` opens in a worker thread, one open at a time (opens are rare: once per URI
    while it stays cached). Raises what ``open_dataset`` raises, and
    :class:`DatasetUnavailable` when an open takes longer than ``open_timeout_s``.
    """

    def __init__(self, *, storage: StorageSettings, size: int, open_timeout_s: float) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._storage = storage
        self._size = size
        self._open_timeout_s = open_timeout_s
        self._datasets: OrderedDict[str, Dataset] = OrderedDict()
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._datasets)

    async def get(self, uri: str) -> Dataset:
        """The dataset at ``uri``, opened once and cached."""
        async with self._lock:
            dataset = self._datasets.get(uri)
            if dataset is None:
                try:
                    dataset = await asyncio.wait_for(
                        asyncio.to_thread(open_dataset, uri, storage=self._storage),
                        self._open_timeout_s,
                    )
                except TimeoutError:
                    raise DatasetUnavailable(
                        f"{uri}: did not open within {self._open_timeout_s:g}s"
                    ) from None
                self._datasets[uri] = dataset
                while len(self._datasets) > self._size:
                    self._datasets.popitem(last=False)
            self._datasets.move_to_end(uri)
            return dataset


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
