"""Holes in a partition's offsets: deliver up to the hole, read it again until it fills.

The embedded broker (Tansu 0.6) can answer a fetch with offset n+1 while offset n, appended at
the same moment by another producer, is not readable yet. The client's position then moves
past n and n is never delivered: a sync step waited forever for the gradient slice at n, which
a fresh reader found on the log. A non-transactional, non-compacted topic on Apache Kafka has
no holes. So the readers of the bus (:class:`~conveyor.platform.bus.Consumer`,
:class:`~conveyor.platform.bus.TopicTail`) pass every fetched batch through :class:`HoleGuard`:
records before a hole are delivered, the reader seeks back to the hole and fetches again; a
hole still open after ``hold_s`` is accepted (a compacted or transactional topic has real
ones) and logged.

Pure bookkeeping, no I/O; the caller seeks and waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

HOLE_RETRY_S = 0.005
"""How long a reader waits before fetching a hole again."""


class _Record(Protocol):
    @property
    def offset(self) -> int: ...


R = TypeVar("R", bound=_Record)
P = TypeVar("P", bound=Hashable)


class HoleGuard:
    """Per partition, the offset the next fetched record should have (see the module
    docstring). ``hold_s``: how long a hole is read again before it is accepted."""

    __slots__ = ("_expected", "_opened", "hold_s")

    def __init__(self, hold_s: float = 5.0) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self._expected: dict[Hashable, int] = {}
        """Partition -> offset of the next record to deliver (unknown until the reader's
        position or its first record says)."""
        self._opened: dict[Hashable, tuple[int, float]] = {}
        """Partition -> (offset of the open hole, when it was first met)."""

    def forget(self, partition: Hashable) -> None:
        """The reader was positioned anew (assignment, seek): start from its next record."""
        self._expected.pop(partition, None)
        self._opened.pop(partition, None)

    def expect_positions(
        self, partitions: Iterable[P], position: Callable[[P], int | None]
    ) -> None:
        """:meth:`expect` the reader's ``position`` (None: not known yet) of each of
        ``partitions`` whose next offset is not known (just assigned or repositioned)."""
        for partition in partitions:
            if partition not in self._expected and (offset := position(partition)) is not None:
                self.expect(partition, offset)

    def expect(self, partition: Hashable, offset: int) -> None:
        """The reader's position in ``partition`` is ``offset``: its next record should have
        it. Without this the first fetch after a (re)positioning sets the start, so a hole
        right there went unseen: a reader waiting at the end of an idle partition whose first
        fetch with records showed n+1 before n delivered from n+1 and lost n."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self._expected[partition] = offset
        self._opened.pop(partition, None)

    def admit(
        self, partition: Hashable, records: Sequence[R], now_s: float
    ) -> tuple[list[R], int | None]:
        """Of ``records`` (one fetch of ``partition``, in offset order): those to deliver, and
        the offset to seek back to (None: no open hole). Records before the expected offset
        were delivered already and are dropped."""
        expected = self._expected.get(partition)
        admitted: list[R] = []
        for record in records:
            offset = record.offset
            if expected is not None and offset < expected:
                continue
            if expected is not None and offset > expected:
                hole, since = self._opened.get(partition, (expected, now_s))
                if hole != expected:
                    since = now_s
                if now_s - since < self.hold_s:
                    self._opened[partition] = (expected, since)
                    self._expected[partition] = expected
                    return admitted, expected
                logger.warning(
                    "partition %s: offsets %d..%d still missing after %.1f s; reading on",
                    partition, expected, offset - 1, now_s - since,
                )  # fmt: skip
            admitted.append(record)
            expected = offset + 1
        if expected is not None:
            self._expected[partition] = expected
        self._opened.pop(partition, None)
        return admitted, None

    def admit_fetched(
        self, fetched: Mapping[P, Sequence[R]], now_s: float, seek: Callable[[P, int], None]
    ) -> tuple[dict[P, list[R]], bool]:
        """:meth:`admit` each partition's records of one fetch, calling ``seek(partition,
        offset)`` for each partition to read again from its open hole. Returns the records to
        deliver per partition, and whether any hole is open (wait
        :data:`HOLE_RETRY_S` before fetching again when nothing was delivered)."""
        admitted: dict[P, list[R]] = {}
        holes = False
        for partition, records in fetched.items():
            admitted[partition], hole = self.admit(partition, records, now_s)
            if hole is not None:
                seek(partition, hole)
                holes = True
        return admitted, holes
