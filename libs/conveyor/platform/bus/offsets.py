"""Offset bookkeeping: what may be committed after out-of-order acks, what is in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any


class PartitionOffsets:
    """Delivered and acknowledged offsets of one assigned partition.

    Records are delivered in offset order and may be acknowledged in any order. The commit
    point is one past the last record of the contiguous acknowledged prefix of the delivered
    sequence, so a crash never skips an unprocessed record. Offsets need not be dense
    (compaction and control records leave gaps); only the delivery order matters.
    """

    __slots__ = ("_pending", "_unacked", "commit_offset", "committed_offset", "next_offset")

    def __init__(self) -> None:
        self._pending: deque[int] = deque()
        """Delivered offsets not yet behind the commit point, in delivery order."""
        self._unacked: set[int] = set()
        self.commit_offset: int | None = None
        """Offset to commit (last contiguous acked + 1); None until something was acked."""
        self.committed_offset: int | None = None
        """The offset last committed to the broker by this member."""
        self.next_offset: int | None = None
        """One past the last delivered offset (this member's position); None before any."""

    @property
    def unacked(self) -> int:
        """Delivered records not acknowledged yet."""
        return len(self._unacked)

    @property
    def lowest_unacked(self) -> int | None:
        """The lowest delivered offset not acknowledged yet (None: all are)."""
        return min(self._unacked, default=None)

    @property
    def needs_commit(self) -> bool:
        """True when the commit point moved past what was last committed."""
        return self.commit_offset is not None and self.commit_offset != self.committed_offset

    def delivered(self, offset: int) -> None:
        """Record that ``offset`` was handed to the application (offsets must increase)."""
        if self.next_offset is not None and offset < self.next_offset:
            raise ValueError(f"offset {offset} delivered after {self.next_offset - 1}")
        self._pending.append(offset)
        self._unacked.add(offset)
        self.next_offset = offset + 1

    def ack(self, offset: int) -> bool:
        """Mark ``offset`` processed; False when it was not delivered or is already acked."""
        if offset not in self._unacked:
            return False
        self._unacked.remove(offset)
        pending = self._pending
        while pending and pending[0] not in self._unacked:
            self.commit_offset = pending.popleft() + 1
        return True


class InFlight:
    """Bookkeeping of one consumer's current assignment, free of any I/O.

    Holds the :class:`PartitionOffsets` of each assigned partition, the records fetched but
    not delivered yet, and the count of delivered records not acknowledged, which
    ``max_in_flight`` bounds. Partition keys are ``(topic, partition)`` tuples (aiokafka's
    ``TopicPartition`` is one).

    Delivery order: fetch order, or with ``oldest_first`` the oldest (by record timestamp,
    ties in fetch order) of the first fetched record of each partition. Within a partition it
    is offset order either way.
    """

    def __init__(self, max_in_flight: int, *, oldest_first: bool = False) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.oldest_first = oldest_first
        self.partitions: dict[tuple[str, int], PartitionOffsets] = {}
        self.unacked = 0
        """Delivered, not acknowledged records of the current assignment."""
        self._fetched: deque[Any] = deque()
        """aiokafka ``ConsumerRecord``s not delivered yet (fewer than max_in_flight)."""

    @property
    def full(self) -> bool:
        """True when no more records may be delivered before an ack."""
        return self.unacked >= self.max_in_flight

    @property
    def fetched(self) -> int:
        """Records fetched and waiting for delivery."""
        return len(self._fetched)

    def fetch_budget(self) -> int:
        """How many records a fetch may take (at least 1)."""
        return max(1, self.max_in_flight - self.unacked - len(self._fetched))

    def assign(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Start fresh bookkeeping for newly assigned partitions."""
        for tp in partitions:
            self.partitions[tp] = PartitionOffsets()

    def revoke(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Forget revoked partitions: their unacked records and fetched ones."""
        revoked = set(partitions)
        for tp in revoked:
            offsets = self.partitions.pop(tp, None)
            if offsets is not None:
                self.unacked -= offsets.unacked
        self.drop_fetched(revoked)

    def clear(self) -> None:
        self.revoke(list(self.partitions))
        self._fetched.clear()

    def add_fetched(self, records: Iterable[Any]) -> None:
        self._fetched.extend(records)

    def next_fetched(self) -> tuple[Any, PartitionOffsets] | None:
        """The next record to deliver with its partition's offsets, or None (none fetched or
        ``full``). The caller then calls :meth:`deliver`, :meth:`skip` or :meth:`put_back`."""
        while self._fetched and not self.full:
            record = self._pop_oldest_head() if self.oldest_first else self._fetched.popleft()
            offsets = self.partitions.get((record.topic, record.partition))
            if offsets is not None:
                return record, offsets
        return None

    def _pop_oldest_head(self) -> Any:
        """Remove and return the oldest of the partitions' first fetched records. A linear
        scan: at most max_in_flight records plus one per partition are fetched."""
        seen: set[tuple[str, int]] = set()
        oldest_at, oldest_ts = 0, None
        for position, record in enumerate(self._fetched):
            tp = (record.topic, record.partition)
            if tp in seen:
                continue
            seen.add(tp)
            if oldest_ts is None or record.timestamp < oldest_ts:
                oldest_at, oldest_ts = position, record.timestamp
        record = self._fetched[oldest_at]
        del self._fetched[oldest_at]
        return record

    def partitions_fetched(self) -> set[tuple[str, int]]:
        """The partitions with at least one fetched, undelivered record."""
        return {(record.topic, record.partition) for record in self._fetched}

    def deliver(self, offsets: PartitionOffsets, offset: int) -> None:
        """The record was handed to the application: it is in flight until acked."""
        offsets.delivered(offset)
        self.unacked += 1

    def skip(self, offsets: PartitionOffsets, offset: int) -> None:
        """The record was dealt with by the bus (dead-lettered): past it without delivery."""
        offsets.delivered(offset)
        offsets.ack(offset)

    def put_back(self, record: Any, offsets: PartitionOffsets) -> None:
        """Return an undelivered record to the front, unless its partition moved meanwhile."""
        if self.partitions.get((record.topic, record.partition)) is offsets:
            self._fetched.appendleft(record)

    def ack(self, tp: tuple[str, int], offsets: PartitionOffsets, offset: int) -> bool:
        """Acknowledge a delivered record; False when it is stale (its assignment ended) or
        acked already."""
        if self.partitions.get(tp) is not offsets or not offsets.ack(offset):
            return False
        self.unacked -= 1
        return True

    def drop_fetched(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Forget the fetched, undelivered records of ``partitions`` (the next owner of the
        partitions reads them; nothing delivered changes)."""
        dropped = set(partitions)
        self._fetched = deque(r for r in self._fetched if (r.topic, r.partition) not in dropped)

    def unacked_in(self, partitions: Iterable[tuple[str, int]]) -> int:
        """Delivered, not acknowledged records of ``partitions``."""
        return sum(o.unacked for tp in partitions if (o := self.partitions.get(tp)) is not None)

    def offsets_to_commit(self, partitions: Iterable[tuple[str, int]]) -> dict[Any, int]:
        """``{partition: commit offset}`` for the partitions whose commit point moved."""
        result: dict[Any, int] = {}
        for tp in partitions:
            offsets = self.partitions.get(tp)
            if offsets is not None and offsets.needs_commit:
                assert offsets.commit_offset is not None
                result[tp] = offsets.commit_offset
        return result

    def committed(self, done: dict[Any, int]) -> None:
        """Record a successful commit of ``done``."""
        for tp, offset in done.items():
            offsets = self.partitions.get(tp)
            if offsets is not None:
                offsets.committed_offset = offset

    def positions(self) -> dict[tuple[str, int], int | None]:
        """Per partition, the offset of the next record the application will get, when known
        (the first fetched record waiting, else one past the last delivered)."""
        waiting: dict[tuple[str, int], int] = {}
        for record in self._fetched:
            waiting.setdefault((record.topic, record.partition), record.offset)
        return {tp: waiting.get(tp, o.next_offset) for tp, o in self.partitions.items()}
