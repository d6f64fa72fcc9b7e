"""A consumer group's lag on a topic, read from outside the group (the autoscaler).

Lag of a partition = its end offset - the group's committed offset (the whole partition when
the group committed nothing there). Consumers report their own lag in-app
(:mod:`conveyor.platform.bus.metrics`); this reader is for a process that is not a member.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from conveyor.platform.bus.errors import BusError, from_kafka_error
from conveyor.platform.bus.options import admin_options, consumer_options
from conveyor.platform.config import KafkaSettings
from conveyor.platform.lifecycle import AsyncLifecycle


@dataclass(kw_only=True, slots=True, frozen=True)
class GroupProgress:
    """Where a group stands on a topic, summed over the topic's partitions."""

    committed: int
    """Records the group committed (offsets, from each partition's start)."""
    lag: int
    """Records after the group's committed offsets."""
    partitions: int
    """The topic's partitions (0 when it does not exist)."""


class GroupLagReader(AsyncLifecycle):
    """Reads committed offsets (admin OffsetFetch) and end offsets (ListOffsets) over two
    connections; ``async with`` starts and stops them. Broker errors raise :class:`BusError`
    (:class:`BusUnavailable` when retriable)."""

    def __init__(self, settings: KafkaSettings) -> None:
        self._settings = settings
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        if self._admin is not None:
            return
        options = consumer_options(self._settings, group_id="unused")
        options.update(group_id=None)
        admin = AIOKafkaAdminClient(**admin_options(self._settings))
        consumer = AIOKafkaConsumer(**options)
        try:
            await admin.start()
            await consumer.start()
        except KafkaError as exc:
            await admin.close()
            await consumer.stop()
            raise from_kafka_error(exc, f"connecting to {self._settings.bootstrap}") from exc
        self._admin, self._consumer = admin, consumer

    async def stop(self) -> None:
        """Close both connections. Safe to call twice."""
        admin, self._admin = self._admin, None
        consumer, self._consumer = self._consumer, None
        if admin is not None:
            await admin.close()
        if consumer is not None:
            await consumer.stop()

    async def partitions(self, topic: str) -> list[int]:
        """The topic's partitions (empty when it does not exist).

        Asked of the broker each time: a job's topics come and go while this reader runs,
        and a client's cached metadata knows a new topic only after its next refresh (5
        minutes). Every topic's metadata is asked for, not this one's: a broker that creates
        topics on demand (the embedded one) would create a missing topic asked for by name.
        """
        admin = self._running()[0]
        try:
            described = await admin.describe_topics()
        except KafkaError as exc:
            raise from_kafka_error(exc, f"reading the metadata of {topic}") from exc
        for entry in described:
            if entry["topic"] == topic and entry["error_code"] == 0:
                return sorted(part["partition"] for part in entry["partitions"])
        return []

    async def progress(self, group: str, topic: str) -> GroupProgress:
        """Records of ``topic`` committed and not yet committed by ``group``; zeros for a topic
        that does not exist (a job's topics go when it ends)."""
        admin, consumer = self._running()
        partitions = [TopicPartition(topic, p) for p in await self.partitions(topic)]
        if not partitions:
            return GroupProgress(committed=0, lag=0, partitions=0)
        try:
            committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
            ends = await consumer.end_offsets(partitions)
        except KafkaError as exc:
            raise from_kafka_error(exc, f"reading the lag of {group} on {topic}") from exc
        done = lag = 0
        for tp in partitions:
            meta = committed.get(tp)
            position = meta.offset if meta is not None and meta.offset >= 0 else 0
            done += position
            lag += max(0, ends[tp] - position)
        return GroupProgress(committed=done, lag=lag, partitions=len(partitions))

    def _running(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        if self._admin is None or self._consumer is None:
            raise BusError("GroupLagReader is not started; use `async with`")
        return self._admin, self._consumer
