"""Readers started before their topic exists, against the real broker: a job's processes
may ask for its topics before the broker lists them (the sharder creates them as it plans
the job; a Kafka cluster spreads new topics' metadata to its brokers asynchronously). A
group member that joined without the topic got no partitions and kept none until the
client's next metadata refresh (5 minutes), which left a job at step 0; a tail failed at
once and restarted its process."""

from __future__ import annotations

import asyncio

import pytest
from bus_harness import create, event, group, publish_all, wait_assigned

from conveyor.platform.bus import BusUnavailable, Consumer, TopicSpec, TopicTail
from conveyor.platform.config import KafkaSettings

pytestmark = pytest.mark.timeout(60)

LATE_S = 1.5
"""How long after the reader's start the topic is created."""


async def create_later(settings: KafkaSettings, spec: TopicSpec) -> None:
    await asyncio.sleep(LATE_S)
    await create(settings, spec)


async def test_a_member_started_before_its_topic_exists_gets_its_partitions(
    settings: KafkaSettings,
) -> None:
    topic = f"{settings.topic_prefix}late-grads"
    consumer = Consumer(settings, [topic], group_id=group(settings, "late"))
    creating = asyncio.create_task(create_later(settings, TopicSpec(topic, partitions=2)))
    async with consumer:
        await creating
        await wait_assigned(consumer, partitions=2, timeout_s=20)
        await publish_all(settings, topic, [event(0), event(1)])
        got: list[str] = []
        async with asyncio.timeout(20):
            async for received in consumer:
                got.append(received.message.reason)  # type: ignore[attr-defined]
                consumer.ack(received)
                if len(got) == 2:
                    break
    assert sorted(got) == ["e0", "e1"]


async def test_a_tail_started_before_its_topic_exists_reads_it(settings: KafkaSettings) -> None:
    topic = f"{settings.topic_prefix}late-params"
    creating = asyncio.create_task(create_later(settings, TopicSpec(topic, partitions=3)))
    async with TopicTail(settings, topic) as tail:
        assert creating.done()  # the start waited for the topic
        assert tail.partitions == [0, 1, 2]


async def test_a_topic_that_never_comes_is_a_retriable_error(settings: KafkaSettings) -> None:
    quick = settings.model_copy(update={"topic_wait_s": 0.5})
    missing = f"{settings.topic_prefix}never"
    with pytest.raises(BusUnavailable, match=r"never.*after 0\.5 s"):
        async with TopicTail(quick, missing):
            pass
    consumer = Consumer(quick, [missing], group_id=group(settings, "never"))
    with pytest.raises(BusUnavailable, match=r"never.*after 0\.5 s"):
        await consumer.start()
