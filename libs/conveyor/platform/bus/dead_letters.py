"""The dead-letter topic: where records that cannot be decoded are parked, with the reason."""

from __future__ import annotations

import logging
import time
from typing import Any

from conveyor.platform.bus.errors import BusError
from conveyor.platform.bus.producer import Producer
from conveyor.platform.codec import CodecLimits
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import DeadLetter, Topics

logger = logging.getLogger(__name__)

_OVERHEAD_BYTES = 64 * 1024
"""Room left for a DeadLetter's other fields when its payload must be truncated (bytes)."""

_DEFAULT_LIMITS = CodecLimits()


class DeadLetters:
    """Publishes :class:`DeadLetter` messages to ``Topics(settings.topic_prefix).dlq``.

    Uses the given started ``producer``, or starts (and stops) its own. The topic is not
    created here: the sharder creates it with the other global topics
    (:func:`~conveyor.platform.bus.admin.create_topology`).
    """

    def __init__(self, settings: KafkaSettings, producer: Producer | None = None) -> None:
        self._settings = settings
        self.topic = Topics(settings.topic_prefix).dlq
        self._producer = producer
        self._owns_producer = producer is None

    async def start(self) -> None:
        """Start the producer when it is this object's own."""
        if self._producer is None:
            self._producer = Producer(self._settings)
            await self._producer.start()

    async def stop(self) -> None:
        """Stop the producer if it is this object's own. Safe to call twice."""
        if self._owns_producer and self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def park(self, record: Any, reason: str) -> None:
        """Publish ``record`` (an aiokafka ``ConsumerRecord``) with ``reason`` and wait for the
        ack. A payload too large to fit the size limit with the other fields is truncated (the
        reason says so). Raises :class:`BusError` when the dead letter cannot be published
        (logged as an error: a missing dead-letter topic is not created here)."""
        if self._producer is None:
            raise AssertionError("DeadLetters.park before start")
        payload: bytes = record.value or b""
        # ``payload`` is a bytes field: it travels in the msgpack header, whose limit is the
        # smaller of the two.
        header_limit = min(self._settings.max_message_bytes, _DEFAULT_LIMITS.max_header_bytes)
        budget = header_limit - _OVERHEAD_BYTES
        if len(payload) > budget:
            reason += f" (payload truncated from {len(payload)} to {budget} bytes)"
            payload = payload[:budget]
        logger.warning(
            "dead-lettering %s[%d]@%d to %s: %s",
            record.topic,
            record.partition,
            record.offset,
            self.topic,
            reason,
        )
        letter = DeadLetter(
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            reason=reason,
            payload=payload,
            failed_at=time.time(),
        )
        try:
            await self._producer.publish(self.topic, letter, key=record.key)
        except BusError as exc:
            logger.error(
                "cannot dead-letter %s[%d]@%d: %s; does %s exist? The sharder creates it "
                "with the other global topics",
                record.topic,
                record.partition,
                record.offset,
                exc,
                self.topic,
            )
            raise
