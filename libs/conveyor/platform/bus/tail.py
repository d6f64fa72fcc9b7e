"""TopicTail: a group-less reader of every partition of one topic (nothing committed).

For logs that every process reads whole and on its own (a job's control topic, read from the
beginning) or whose newest records are the state (a job's params topic: the last record of
each partition is the newest parameter slice). Each reader and each restart positions itself;
no consumer group, no offsets committed, so readers never disturb each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from opentelemetry.context import Context

from conveyor.platform import telemetry
from conveyor.platform.bus.errors import BusError, BusUnavailable, from_kafka_error
from conveyor.platform.bus.holes import HOLE_RETRY_S, HoleGuard
from conveyor.platform.bus.metrics import topic_kind, topic_metrics
from conveyor.platform.bus.options import consumer_options
from conveyor.platform.bus.topic_wait import start_when_listed
from conveyor.platform.bus.tracing import extract_context
from conveyor.platform.codec import CodecError, CodecLimits, decode, message_type
from conveyor.platform.config import KafkaSettings
from conveyor.platform.lifecycle import AsyncLifecycle
from conveyor.platform.messages import Message

logger = logging.getLogger(__name__)


SKIPPED_RECORDS = telemetry.counter(
    "bus",
    "tail_skipped_records_total",
    "Records a group-less reader could not decode and skipped.",
    ["topic_kind"],
)

Start = Literal["beginning", "last"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Tailed:
    """One decoded record read by a :class:`TopicTail`."""

    topic: str
    partition: int
    offset: int
    message: Message
    """The decoded message; its tensors are views over the record's bytes (no copy)."""
    timestamp_ms: int
    size_bytes: int
    context: Context = field(default_factory=Context)
    """OpenTelemetry context extracted from the record's W3C headers (empty when none)."""


class TopicTail(AsyncLifecycle):
    """Reads every partition of ``topic`` without a group; ``async with`` starts and stops it.

    ``start`` positions each partition at its first record (``start="beginning"``) or at its
    last one (``"last"``: end - 1; an empty partition from its start); ``offsets`` instead
    reads only the partitions it names, each from the offset given (or its first record when
    that is older). The end offsets of that moment are captured: :attr:`caught_up` turns True
    once every partition was read up to them (the replay is over). A record that does not
    decode is logged, counted and skipped (a reader does not write the dead-letter topic:
    every reader would add a copy). With ``types``, records of other message types are passed
    over undecoded (:func:`~conveyor.platform.codec.message_type`): they cost no decode, and a
    reader of plain messages never imports torch for a tensor-carrying one.
    Broker failures raise :class:`BusError` (:class:`BusUnavailable` when retriable).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        *,
        start: Start = "beginning",
        offsets: Mapping[int, int] | None = None,
        limits: CodecLimits | None = None,
        types: Iterable[type[Message]] | None = None,
    ) -> None:
        if start not in ("beginning", "last"):
            raise ValueError(f"start must be 'beginning' or 'last', got {start!r}")
        self._settings = settings
        self.topic = topic
        self._start = start
        self._offsets = dict(offsets) if offsets is not None else None
        self._limits = limits or CodecLimits(max_message_bytes=settings.max_message_bytes)
        self._types = frozenset(cls.TYPE for cls in types) if types is not None else None
        self._consumer: AIOKafkaConsumer | None = None
        self._assigned: list[TopicPartition] = []
        self._targets: dict[int, int] = {}
        self._positions: dict[int, int] = {}
        self._holes = HoleGuard()
        self._skipped = SKIPPED_RECORDS.labels(topic_kind(topic, settings.topic_prefix))

    @property
    def partitions(self) -> list[int]:
        """The topic's partitions (known after :meth:`start`)."""
        return [tp.partition for tp in self._assigned]

    @property
    def caught_up(self) -> bool:
        """True once every partition was read up to its end offset captured at start."""
        return all(self._positions.get(p, 0) >= end for p, end in self._targets.items())

    async def start(self) -> None:
        """Assign every partition and position them. :class:`BusUnavailable` if the broker
        does not list the topic within ``topic_wait_s`` (:mod:`.topic_wait`)."""
        if self._consumer is not None:
            return
        options = consumer_options(self._settings, group_id="unused")
        options.update(group_id=None)
        try:
            consumer = await start_when_listed(
                lambda: AIOKafkaConsumer(**options),
                [self.topic],
                timeout_s=self._settings.topic_wait_s,
            )
        except KafkaError as exc:
            raise from_kafka_error(exc, f"reading {self.topic}") from exc
        try:
            partitions = sorted(consumer.partitions_for_topic(self.topic) or ())
            if self._offsets is not None:
                if unknown := set(self._offsets) - set(partitions):
                    raise BusError(f"topic {self.topic} has no partitions {sorted(unknown)}")
                partitions = sorted(self._offsets)
            assigned = [TopicPartition(self.topic, p) for p in partitions]
            consumer.assign(assigned)
            firsts = await consumer.beginning_offsets(assigned)
            ends = await consumer.end_offsets(assigned)
            for tp in assigned:
                first = firsts[tp]
                if self._offsets is not None:
                    offset = max(first, self._offsets[tp.partition])
                else:
                    offset = first if self._start == "beginning" else max(first, ends[tp] - 1)
                consumer.seek(tp, offset)
                self._positions[tp.partition] = offset
                self._holes.expect(tp, offset)
        except KafkaError as exc:
            await consumer.stop()
            raise from_kafka_error(exc, f"reading {self.topic}") from exc
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        self._assigned = assigned
        self._targets = {tp.partition: offset for tp, offset in ends.items()}

    async def stop(self) -> None:
        """Close the consumer. Safe to call twice."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()

    async def get_many(self, timeout_s: float) -> list[Tailed]:
        """The records that arrived, waiting up to ``timeout_s`` for the first; in offset
        order within each partition (no order between partitions)."""
        consumer = self._running()
        try:
            batches = await consumer.getmany(timeout_ms=int(timeout_s * 1000))
        except KafkaError as exc:
            raise from_kafka_error(exc, f"reading {self.topic}") from exc
        out: list[Tailed] = []
        admitted, holes = self._holes.admit_fetched(batches, time.monotonic(), consumer.seek)
        for tp, records in admitted.items():
            for record in records:
                tailed = self._decode(record)
                if tailed is not None:
                    out.append(tailed)
                self._positions[tp.partition] = record.offset + 1
        if holes and not out:
            await asyncio.sleep(HOLE_RETRY_S)
        return out

    def pause(self) -> None:
        """Send no more fetches until :meth:`resume` (an idle reader at a short fetch wait costs
        the broker and this process CPU on every empty fetch). Nothing is lost: what a pending
        fetch brings back meanwhile is dropped unread and fetched again after the resume."""
        self._running().pause(*self._assigned)

    def resume(self) -> None:
        """Fetch again at once (after :meth:`pause`; a no-op otherwise)."""
        self._running().resume(*self._assigned)

    def position(self, partition: int) -> int | None:
        """The next offset :meth:`get_many` returns from ``partition`` (None before start)."""
        return self._positions.get(partition)

    def highwater(self, partition: int) -> int | None:
        """The partition's end offset as of the last fetch response (None before one)."""
        consumer = self._consumer
        if consumer is None:
            return None
        highwater: int | None = consumer.highwater(TopicPartition(self.topic, partition))
        return highwater

    async def end_offsets(self) -> dict[int, int]:
        """Current end offset (next offset to be written) of every partition."""
        consumer = self._running()
        try:
            ends = await consumer.end_offsets(self._assigned)
        except KafkaError as exc:
            raise from_kafka_error(exc, f"reading {self.topic}") from exc
        return {tp.partition: offset for tp, offset in ends.items()}

    async def read_at(self, partition: int, offset: int, timeout_s: float = 10.0) -> Tailed | None:
        """The record at ``offset`` of ``partition`` (or the next one after a gap), None when
        none arrives within ``timeout_s``, it does not decode or is not of ``types``. Moves
        that partition's read position: use a dedicated tail for lookups, not the one being
        followed."""
        consumer = self._running()
        tp = TopicPartition(self.topic, partition)
        if tp not in self._assigned:
            raise ValueError(f"{self.topic} has no partition {partition}")
        consumer.seek(tp, offset)
        self._holes.forget(tp)
        try:
            batches = await consumer.getmany(tp, timeout_ms=int(timeout_s * 1000), max_records=1)
        except KafkaError as exc:
            raise from_kafka_error(exc, f"reading {self.topic}") from exc
        for record in batches.get(tp, ()):
            if record.offset >= offset:
                return self._decode(record)
        return None

    def _running(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise BusError(f"TopicTail of {self.topic} is not started")
        return self._consumer

    def _decode(self, record: Any) -> Tailed | None:
        """``record``: an aiokafka ``ConsumerRecord``."""
        value: bytes | None = record.value
        partition: int = record.partition
        offset: int = record.offset
        size_bytes = len(value) if value is not None else 0
        topic_metrics(self.topic, self._settings.topic_prefix).consumed_bytes.inc(size_bytes)
        if self._types is not None:
            name = message_type(value or b"")
            if name is not None and name not in self._types:
                return None  # not asked for; one that is not a message is decoded to say why
        try:
            message = decode(value or b"", limits=self._limits)
        except CodecError as exc:
            self._skipped.inc()
            logger.warning("skipping %s[%d]@%d: %s", self.topic, partition, offset, exc)
            return None
        return Tailed(
            topic=self.topic,
            partition=partition,
            offset=offset,
            message=message,
            timestamp_ms=int(record.timestamp),
            size_bytes=size_bytes,
            context=extract_context(dict(record.headers) if record.headers else {}),
        )


async def read_last(
    settings: KafkaSettings, topic: str, *, timeout_s: float = 10.0
) -> dict[int, Tailed]:
    """The last record of every non-empty partition of ``topic`` (partition -> record).

    Raises :class:`BusUnavailable` when the last record of a non-empty partition could not be
    read (or decoded) within ``timeout_s``: a caller must not take the partition for empty.
    """
    last: dict[int, Tailed] = {}
    async with TopicTail(settings, topic, start="last") as tail:
        ends = await tail.end_offsets()
        for partition in tail.partitions:
            if ends[partition] == 0:
                continue  # empty
            record = await tail.read_at(partition, ends[partition] - 1, timeout_s)
            if record is None:
                raise BusUnavailable(
                    f"the last record of {topic}[{partition}] (offset {ends[partition] - 1}) "
                    f"was not read within {timeout_s}s"
                )
            last[partition] = record
    return last
