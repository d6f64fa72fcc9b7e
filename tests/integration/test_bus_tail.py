"""TopicTail against the real broker: whole logs, last records, lookups, live following."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from heartbeats import heartbeat

from conveyor.platform.bus import (
    BusError,
    Producer,
    Tailed,
    TopicSpec,
    TopicTail,
    ensure_topics,
    read_last,
)
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import CheckpointRequest, Heartbeat

pytestmark = pytest.mark.timeout(60)


def beat(worker: str, n: int) -> Heartbeat:
    return heartbeat("j", worker, epoch=n)


async def drain(tail: TopicTail, until: int, timeout_s: float = 10.0) -> list[Tailed]:
    records: list[Tailed] = []
    async with asyncio.timeout(timeout_s):
        while len(records) < until:
            records += await tail.get_many(0.2)
    return records


async def test_replays_follows_and_finds_the_last_records(kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}tail"
    await ensure_topics(kafka_settings, [TopicSpec(topic, partitions=3)])
    async with Producer(kafka_settings) as producer:
        for n in range(3):
            await producer.publish(topic, beat("a", n), partition=0)
        await producer.publish(topic, beat("b", 0), partition=1)  # partition 2 stays empty

        async with TopicTail(kafka_settings, topic) as whole:
            assert whole.partitions == [0, 1, 2] and not whole.caught_up
            records = await drain(whole, 4)
            assert whole.caught_up
            in_zero = [r for r in records if r.partition == 0]
            assert [r.offset for r in in_zero] == [0, 1, 2]
            assert [r.message.state.epoch for r in in_zero] == [0, 1, 2]
            await producer.publish(topic, beat("c", 7), partition=2)
            [live] = await drain(whole, 1)  # it keeps following
            assert (live.partition, live.offset) == (2, 0)

        async with TopicTail(kafka_settings, topic, start="last") as last:
            records = await drain(last, 3)
            assert sorted((r.partition, r.offset) for r in records) == [(0, 2), (1, 0), (2, 0)]
            found = await last.read_at(0, 1)
            assert found is not None and found.message.state.epoch == 1
            assert (await last.end_offsets()) == {0: 3, 1: 1, 2: 1}
            with pytest.raises(ValueError, match="no partition 5"):
                await last.read_at(5, 0)

    newest = await read_last(kafka_settings, topic)
    assert {p: r.offset for p, r in newest.items()} == {0: 2, 1: 0, 2: 0}


async def test_a_missing_topic_is_an_error(kafka_settings: KafkaSettings) -> None:
    quick = kafka_settings.model_copy(update={"topic_wait_s": 0.3})
    with pytest.raises(BusError, match="not in the broker's metadata"):
        async with TopicTail(quick, f"{kafka_settings.topic_prefix}missing"):
            pass


async def test_a_paused_tail_sends_no_fetches_and_catches_up_on_resume(
    kafka_settings: KafkaSettings, fetch_requests: Callable[[], int]
) -> None:
    settings = kafka_settings.model_copy(update={"fetch_max_wait_ms": 20})
    topic = f"{settings.topic_prefix}paused"
    await ensure_topics(settings, [TopicSpec(topic, partitions=1)])
    async with Producer(settings) as producer, TopicTail(settings, topic) as tail:
        await producer.publish(topic, beat("a", 0))
        assert [r.offset for r in await drain(tail, 1)] == [0]

        following = fetch_requests()
        deadline = time.monotonic() + 10  # a busy machine answers some fetches late
        while fetch_requests() - following < 5:  # an empty fetch every 20 ms or so
            assert await tail.get_many(0.5) == []
            assert time.monotonic() < deadline, fetch_requests() - following

        tail.pause()
        await asyncio.sleep(0.1)  # a fetch sent before the pause comes back
        paused = fetch_requests()
        for n in (1, 2):
            await producer.publish(topic, beat("a", n))
        assert await tail.get_many(1.0) == []
        assert fetch_requests() - paused <= 1

        tail.resume()
        records = await drain(tail, 2, timeout_s=5.0)
        assert [r.offset for r in records] == [1, 2]
        assert [r.message.state.epoch for r in records] == [1, 2]  # type: ignore[attr-defined]


async def test_a_tail_of_some_types_passes_the_others_over(kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}tail-types"
    await ensure_topics(kafka_settings, [TopicSpec(topic, partitions=1)])
    request = CheckpointRequest(job_id="j", reason="every_s", requested_at=1.0)
    async with Producer(kafka_settings) as producer:
        await producer.publish(topic, beat("a", 0))
        await producer.publish(topic, request)
        await producer.publish(topic, beat("a", 1))
        await producer.send_raw(topic, b"not a message")
    async with TopicTail(kafka_settings, topic, types=[CheckpointRequest]) as tail:
        records: list[Tailed] = []
        async with asyncio.timeout(10):
            while not tail.caught_up:
                records += await tail.get_many(0.2)
        assert [(r.offset, r.message) for r in records] == [(1, request)]
        assert tail.position(0) == 4  # past the heartbeats and the undecodable record
