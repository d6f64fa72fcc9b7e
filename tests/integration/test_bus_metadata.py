"""A producer stops tracking the metadata of topics it no longer sends to (a finished job's,
deleted), against the real broker: aiokafka would ask for them at every metadata refresh and
log an error for each."""

from __future__ import annotations

import asyncio
import logging

import pytest
from heartbeats import heartbeat

from conveyor.platform.bus import Producer, TopicAdmin, TopicSpec, ensure_topics
from conveyor.platform.config import KafkaSettings

pytestmark = pytest.mark.timeout(60)


def tracked(producer: Producer) -> set[str]:
    assert producer._producer is not None
    return set(producer._producer.client._topics)


async def refresh_logs_missing(
    producer: Producer, topic: str, caplog: pytest.LogCaptureFixture
) -> bool:
    """Whether a metadata refresh now logs ``topic`` as missing."""
    assert producer._producer is not None
    caplog.clear()
    await producer._producer.client.force_metadata_update()
    return f"Topic {topic} not found in cluster metadata" in caplog.text


async def test_a_deleted_topic_leaves_the_metadata_once_idle(
    kafka_settings: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="aiokafka.cluster")
    settings = kafka_settings.model_copy(update={"producer_metadata_idle_s": 0.4})
    busy, finished = (f"{settings.topic_prefix}{name}" for name in ("busy", "finished"))
    async with Producer(settings) as producer:
        # Created after the producer started (as a job's are): tracked from their first send.
        await ensure_topics(settings, [TopicSpec(busy, 1), TopicSpec(finished, 1)])
        await producer.publish(finished, heartbeat("j", "w", epoch=0))
        await producer.publish(busy, heartbeat("j", "w", epoch=0))
        assert tracked(producer) == {busy, finished}
        async with TopicAdmin(settings) as admin:
            await admin.delete_topics([finished])  # the job ended
        assert await refresh_logs_missing(producer, finished, caplog)
        for epoch in range(1, 9):  # 0.8 s of sends to the other topic only
            await asyncio.sleep(0.1)
            await producer.publish(busy, heartbeat("j", "w", epoch=epoch))
        assert tracked(producer) == {busy}
        assert not await refresh_logs_missing(producer, finished, caplog)
        ack = await producer.publish(busy, heartbeat("j", "w", epoch=9))
        assert ack.offset == 9
