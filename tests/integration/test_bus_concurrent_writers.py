"""Several producers appending to one partition while readers follow it live: every record is
delivered once, in offset order (the embedded broker can show offset n+1 before a concurrent n;
see conveyor.platform.bus.holes)."""

from __future__ import annotations

import asyncio

import pytest
from heartbeats import heartbeat

from conveyor.platform.bus import Consumer, Producer, TopicSpec, TopicTail, ensure_topics
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import Heartbeat

pytestmark = pytest.mark.timeout(120)

WRITERS = 4
PER_WRITER = 150


def beat(worker: int, n: int) -> Heartbeat:
    return heartbeat("j", f"w{worker}", epoch=n)


async def write(settings: KafkaSettings, topic: str, worker: int) -> None:
    async with Producer(settings) as producer:
        for n in range(PER_WRITER):
            await producer.publish(topic, beat(worker, n), partition=0)


async def test_every_record_of_concurrent_writers_is_delivered_once_in_order(
    kafka_settings: KafkaSettings,
) -> None:
    settings = kafka_settings.for_gradient_plane()  # short fetch waits: readers chase the end
    topic = f"{settings.topic_prefix}contended"
    await ensure_topics(settings, [TopicSpec(topic, partitions=1)])
    total = WRITERS * PER_WRITER
    tailed: list[int] = []
    consumed: list[int] = []

    async def tail() -> None:
        async with TopicTail(settings, topic) as reader:
            while len(tailed) < total:
                tailed.extend(r.offset for r in await reader.get_many(0.05))

    async def consume(consumer: Consumer) -> None:
        while len(consumed) < total:
            received = await consumer.get()
            consumed.append(received.offset)
            consumer.ack(received)

    async with Consumer(settings, [topic], group_id=f"{settings.topic_prefix}g") as consumer:
        readers = [asyncio.create_task(tail()), asyncio.create_task(consume(consumer))]
        await asyncio.gather(*(write(settings, topic, w) for w in range(WRITERS)))
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*readers)
        except TimeoutError:
            # A stall seen once in a clean-clone run and never again in 20 reruns: say where.
            position, highwater = consumer.offsets(topic, 0)
            pytest.fail(
                f"readers stalled: tail {len(tailed)} of {total} (missing "
                f"{sorted(set(range(total)) - set(tailed))[:10]}), group consumer "
                f"{len(consumed)} (missing {sorted(set(range(total)) - set(consumed))[:10]}, "
                f"fetch position {position}, high-water {highwater}, paused {consumer.paused}, "
                f"resting {consumer.resting}, in flight {consumer.in_flight})"
            )
    assert tailed == list(range(total))
    assert consumed == list(range(total))
