"""Producer: encode, size-check, trace and send messages; acks arrive as futures."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from functools import partial

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from conveyor.platform.bus.errors import BusError, RecordTooLarge, from_kafka_error
from conveyor.platform.bus.metrics import TopicMetrics, topic_metrics
from conveyor.platform.bus.options import producer_options
from conveyor.platform.bus.tracing import inject_headers, key_attribute, messaging_span
from conveyor.platform.codec import CodecLimits, MessageTooLarge, encode
from conveyor.platform.config import KafkaSettings
from conveyor.platform.lifecycle import AsyncLifecycle
from conveyor.platform.messages import Message

logger = logging.getLogger(__name__)

Key = bytes | str | None


class Producer(AsyncLifecycle):
    """Sends messages to topics that exist; it creates none (the sharder owns the topology) and
    never relies on auto-creation: a send to a missing topic fails after ``request_timeout_s``.

    ``async with`` starts and stops it. Each record is refused with :class:`RecordTooLarge` when
    value + key + headers exceed ``settings.max_message_bytes``. Delivery is at-least-once: acks
    come from every in-sync replica (``acks=all``), retries may duplicate a record (no idempotent
    producer on Tansu), so consumers deduplicate by message id. Each send is a PRODUCER span
    ``send <topic template>`` (``send conveyor.job.{id}.batches``) whose context travels in
    the record's W3C headers.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        limits: CodecLimits | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self._settings = settings
        self._limits = limits or CodecLimits(max_message_bytes=settings.max_message_bytes)
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
        self._producer: AIOKafkaProducer | None = None
        self._sent_at: dict[str, float] = {}
        """Topic -> monotonic time of its last send: the topics whose metadata is tracked."""
        self._pruned_at = time.monotonic()

    @property
    def settings(self) -> KafkaSettings:
        return self._settings

    async def start(self) -> None:
        """Connect. Raises :class:`BusError` on failure."""
        if self._producer is not None:
            return
        producer = AIOKafkaProducer(**producer_options(self._settings))
        try:
            await producer.start()
        except KafkaError as exc:
            await producer.stop()
            raise from_kafka_error(exc, f"connecting to {self._settings.bootstrap}") from exc
        self._producer = producer

    async def stop(self) -> None:
        """Send what is queued, wait for its acks, close. Safe to call twice."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def send(
        self,
        topic: str,
        message: Message,
        *,
        key: Key = None,
        partition: int | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Encode and enqueue ``message``; return once queued, with a future for the ack.

        Awaiting this call may wait while the client's batch buffer is full (backpressure).
        The returned future resolves to the record's metadata (partition, offset) or raises
        :class:`BusError`. Raises :class:`RecordTooLarge` (nothing sent) for a record over the
        size limit and the codec's errors for a message that cannot be encoded.
        """
        try:
            value = encode(message, limits=self._limits)
        except MessageTooLarge as exc:
            raise RecordTooLarge(
                f"{type(message).__name__} for {topic}: {exc} "
                f"(max_message_bytes={self._settings.max_message_bytes})"
            ) from exc
        return await self.send_raw(topic, value, key=key, partition=partition, headers=headers)

    async def publish(
        self,
        topic: str,
        message: Message,
        *,
        key: Key = None,
        partition: int | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> RecordMetadata:
        """:meth:`send` and wait for the broker's ack."""
        ack = await self.send(topic, message, key=key, partition=partition, headers=headers)
        return await ack

    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: Key = None,
        partition: int | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Enqueue already-encoded bytes (same contract as :meth:`send`)."""
        producer = self._producer
        if producer is None:
            raise BusError("Producer is not started; use `async with Producer(...)`")
        key_bytes = key.encode() if isinstance(key, str) else key
        header_list = list(headers.items()) if headers else []
        size = len(value) + (len(key_bytes) if key_bytes else 0)
        size += sum(len(name) + len(data) for name, data in header_list)
        if size > self._settings.max_message_bytes:
            raise RecordTooLarge(
                f"record for {topic} is {size} bytes, over max_message_bytes="
                f"{self._settings.max_message_bytes}; not sent"
            )
        name, attributes = messaging_span("send", topic)
        attributes["messaging.message.body.size"] = len(value)
        if key_bytes is not None:
            attributes["messaging.kafka.message.key"] = key_attribute(key_bytes)
        span = self._tracer.start_span(name, kind=SpanKind.PRODUCER, attributes=attributes)
        inject_headers(header_list, trace.set_span_in_context(span))
        started_s = time.perf_counter()
        try:
            ack = await producer.send(
                topic, value, key=key_bytes, partition=partition, headers=header_list
            )
        except BaseException as exc:
            _end_span(span, exc)
            if isinstance(exc, KafkaError):
                raise from_kafka_error(exc, f"send to {topic}") from exc
            raise
        self._track(topic, producer)
        result: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        ack.add_done_callback(
            partial(
                _on_ack,
                result,
                span,
                topic_metrics(topic, self._settings.topic_prefix),
                topic,
                started_s,
                len(value),
            )
        )
        return result

    def _track(self, topic: str, producer: AIOKafkaProducer) -> None:
        """Note a send to ``topic``; now and then, stop tracking the metadata of the topics
        idle for ``producer_metadata_idle_s`` (aiokafka adds a topic back on its next send).
        Never all of them: an empty set would ask the broker for every topic."""
        now = time.monotonic()
        self._sent_at[topic] = now
        idle_s = self._settings.producer_metadata_idle_s
        if now - self._pruned_at < idle_s / 4:
            return
        self._pruned_at = now
        idle = [t for t, at in self._sent_at.items() if now - at > idle_s]
        if idle:
            for name in idle:
                del self._sent_at[name]
            # A subset of the tracked topics: no metadata request, only the set shrinks.
            producer.client.set_topics(list(self._sent_at))
            logger.debug("stopped tracking the metadata of %d idle topics", len(idle))

    async def flush(self) -> None:
        """Send everything queued now and wait until the broker answered for it."""
        if self._producer is not None:
            await self._producer.flush()


def _on_ack(
    result: asyncio.Future[RecordMetadata],
    span: Span,
    metrics: TopicMetrics,
    topic: str,
    started_s: float,
    value_bytes: int,
    ack: asyncio.Future[RecordMetadata],
) -> None:
    if ack.cancelled():
        _end_span(span, None)
        result.cancel()
        return
    exc = ack.exception()
    if exc is not None:
        metrics.send_errors.inc()
        _end_span(span, exc)
        if not result.done():
            if isinstance(exc, KafkaError):
                error = from_kafka_error(exc, f"send to {topic}")
                error.__cause__ = exc
                result.set_exception(error)
            else:
                result.set_exception(exc)
        return
    metadata = ack.result()
    metrics.produced_records.inc()
    metrics.produced_bytes.inc(value_bytes)
    metrics.send_latency.observe(time.perf_counter() - started_s)
    if span.is_recording():
        span.set_attribute("messaging.destination.partition.id", str(metadata.partition))
        span.set_attribute("messaging.kafka.offset", metadata.offset)
    span.end()
    if not result.done():
        result.set_result(metadata)


def _end_span(span: Span, exc: BaseException | None) -> None:
    if exc is not None and span.is_recording():
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
    span.end()
