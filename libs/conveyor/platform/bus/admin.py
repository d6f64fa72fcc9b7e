"""Create, delete and list topics (the broker creates none by itself); create the topology
(the sharder, its one owner) and wait for it (everyone else)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)

from conveyor.platform.bus.errors import BusError, from_kafka_error
from conveyor.platform.bus.options import admin_options, topic_config
from conveyor.platform.config import KafkaSettings, TopologySettings
from conveyor.platform.lifecycle import AsyncLifecycle
from conveyor.platform.messages.topics import Topics, TopicSpec

logger = logging.getLogger(__name__)


class TopicAdmin(AsyncLifecycle):
    """Topic management over one admin connection; ``async with`` starts and stops it.

    Every topic is created with the bus's size limit (``max.message.bytes``) so that a real
    Kafka accepts what the producers are allowed to send. Broker errors raise
    :class:`BusError` (:class:`BusUnavailable` when retriable).
    """

    def __init__(self, settings: KafkaSettings) -> None:
        self._settings = settings
        self._client: AIOKafkaAdminClient | None = None

    async def start(self) -> None:
        """Connect to the cluster. Raises :class:`BusUnavailable` when it cannot be reached."""
        if self._client is not None:
            return
        client = AIOKafkaAdminClient(**admin_options(self._settings))
        try:
            await client.start()
        except KafkaError as exc:
            await client.close()
            raise from_kafka_error(exc, f"connecting to {self._settings.bootstrap}") from exc
        self._client = client

    async def stop(self) -> None:
        """Close the connection. Safe to call twice."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _require_client(self) -> AIOKafkaAdminClient:
        if self._client is None:
            raise BusError("TopicAdmin is not started; use `async with TopicAdmin(...)`")
        return self._client

    async def create_topics(self, specs: Iterable[TopicSpec], *, exist_ok: bool = True) -> None:
        """Create the topics; an existing topic is an error only when ``exist_ok`` is False.

        An existing topic keeps its partition count and configs (they are not compared).
        """
        client = self._require_client()
        new_topics = [
            NewTopic(
                spec.name,
                spec.partitions,
                self._settings.replication_factor,
                topic_configs={**topic_config(self._settings), **spec.config},
            )
            for spec in specs
        ]
        if not new_topics:
            return
        try:
            response = await client.create_topics(new_topics)
        except KafkaError as exc:
            raise from_kafka_error(exc, "create_topics") from exc
        failures = []
        for topic, code, *message in response.topic_errors:
            if code == 0 or (exist_ok and for_code(code) is TopicAlreadyExistsError):
                continue
            detail = message[0] if message and message[0] else for_code(code).__name__
            failures.append(f"{topic}: {detail}")
        if failures:
            raise BusError("create_topics failed: " + "; ".join(failures))
        logger.debug("created topics %s", [t.name for t in new_topics])

    async def delete_topics(self, names: Iterable[str], *, missing_ok: bool = True) -> None:
        """Delete the topics (freeing the embedded broker's memory); a missing topic is an
        error only when ``missing_ok`` is False."""
        client = self._require_client()
        topics = list(names)
        if not topics:
            return
        try:
            response = await client.delete_topics(topics)
        except KafkaError as exc:
            raise from_kafka_error(exc, "delete_topics") from exc
        failures = [
            f"{topic}: {for_code(code).__name__}"
            for topic, code in response.topic_error_codes
            if code != 0 and not (missing_ok and for_code(code) is UnknownTopicOrPartitionError)
        ]
        if failures:
            raise BusError("delete_topics failed: " + "; ".join(failures))

    async def list_topics(self) -> set[str]:
        """Names of every topic in the cluster (internal ones included)."""
        client = self._require_client()
        try:
            return set(await client.list_topics())
        except KafkaError as exc:
            raise from_kafka_error(exc, "list_topics") from exc


async def ensure_topics(settings: KafkaSettings, specs: Iterable[TopicSpec]) -> None:
    """Create the topics that do not exist yet, over a short-lived admin connection."""
    async with TopicAdmin(settings) as admin:
        await admin.create_topics(specs, exist_ok=True)


async def create_topology(kafka: KafkaSettings, topology: TopologySettings) -> None:
    """Create the global topics (:meth:`Topics.global_topics`: jobs, shards, dead letters) that
    do not exist yet; existing ones keep their partitions.

    The sharder, the topics' one owner, calls this on start; so do tests that run a service
    without a sharder. Raises :class:`BusError` (:class:`BusUnavailable` when retriable).
    """
    topics = Topics(kafka.topic_prefix)
    await ensure_topics(
        kafka,
        topics.global_topics(
            jobs_partitions=topology.jobs_partitions,
            shards_partitions=topology.shards_partitions,
        ),
    )


async def wait_for_topics(
    settings: KafkaSettings, names: Iterable[str], *, poll_s: float = 1.0
) -> None:
    """Return once every topic in ``names`` exists; the services that do not own the topology
    call this before they read or write them (the sharder creates them).

    Logs what it waits for (again when that changes). A broker that cannot be reached
    (retriable :class:`BusError`) is retried every ``poll_s`` seconds too; other broker errors
    raise. Cancellable.
    """
    wanted = set(names)
    waiting_for: set[str] = set()
    while True:
        try:
            async with TopicAdmin(settings) as admin:
                while missing := wanted - await admin.list_topics():
                    if missing != waiting_for:
                        logger.info("waiting for %s", ", ".join(sorted(missing)))
                        waiting_for = missing
                    await asyncio.sleep(poll_s)
            return
        except BusError as exc:
            if not exc.retriable:
                raise
            logger.info("waiting for the broker at %s: %s", settings.bootstrap, exc)
            await asyncio.sleep(poll_s)
