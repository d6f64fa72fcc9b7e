"""Delivering one fetched record: decoded into a :class:`Received`, or parked as a dead letter.

What a :class:`~conveyor.platform.bus.consumer.Consumer` does with each record it fetched, in
offset order: count it, decode it, and either hand it to the application (in flight from then
on, until it is acked) or, when it cannot be decoded, publish it to the dead-letter topic and
skip it.
"""

from __future__ import annotations

from typing import Any

from conveyor.platform.bus.dead_letters import DeadLetters
from conveyor.platform.bus.metrics import topic_metrics
from conveyor.platform.bus.offsets import InFlight, PartitionOffsets
from conveyor.platform.bus.received import Received
from conveyor.platform.bus.tracing import extract_context
from conveyor.platform.codec import CodecError, CodecLimits, decode


class Delivery:
    """Turns a consumer's fetched records into :class:`Received` ones, or dead letters; marks
    each in ``in_flight`` as delivered, skipped or (when the dead letter failed) put back."""

    def __init__(
        self,
        in_flight: InFlight,
        dead_letters: DeadLetters,
        *,
        limits: CodecLimits,
        topic_prefix: str,
    ) -> None:
        self._in_flight = in_flight
        self._dead_letters = dead_letters
        self._limits = limits
        self._topic_prefix = topic_prefix

    async def accept(self, record: Any, offsets: PartitionOffsets) -> Received | None:
        """Deliver ``record``: decode it, or dead-letter it and return None."""
        value = record.value
        size_bytes = len(value) if value is not None else 0
        metrics = topic_metrics(record.topic, self._topic_prefix)
        metrics.consumed_records.inc()
        metrics.consumed_bytes.inc(size_bytes)
        try:
            if value is None:
                raise _NoValue("record has no value")
            message = decode(value, limits=self._limits)
        except (CodecError, _NoValue) as exc:
            try:
                # Acked only once the dead letter is durable; else the record stays unacked.
                await self._dead_letters.park(record, f"{type(exc).__name__}: {exc}")
            except BaseException:
                self._in_flight.put_back(record, offsets)  # the next get() retries it
                raise
            metrics.dead_letters.inc()
            self._in_flight.skip(offsets, record.offset)
            return None
        self._in_flight.deliver(offsets, record.offset)
        headers = dict(record.headers) if record.headers else {}
        return Received(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            message=message,
            headers=headers,
            timestamp_ms=record.timestamp,
            size_bytes=size_bytes,
            context=extract_context(headers),
            _offsets=offsets,
        )


class _NoValue(Exception):
    """A record without a value (a tombstone): nothing to decode."""
