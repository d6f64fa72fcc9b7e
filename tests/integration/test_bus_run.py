"""Consumer.run against the real broker: bounded concurrency, draining stop, crash on failure."""

from __future__ import annotations

import asyncio
import os

import pytest

from conveyor.platform.bus import Consumer, Producer, Received, TopicAdmin, TopicSpec
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import CancelRequested, Topics


@pytest.fixture
def settings(kafka_settings: KafkaSettings) -> KafkaSettings:
    """Fast group joins (Tansu completes a join after half the session timeout)."""
    session_s = 6.0 if os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP") else 2.0
    return kafka_settings.model_copy(
        update={"session_timeout_s": session_s, "heartbeat_interval_s": 0.3}
    )


async def prepare(settings: KafkaSettings, count: int) -> tuple[str, str]:
    """A one-partition topic holding ``count`` events e0..; returns (topic, group id)."""
    topic = Topics(settings.topic_prefix).shards
    async with TopicAdmin(settings) as admin:
        await admin.create_topics([TopicSpec(topic)])
    async with Producer(settings) as producer:
        events = [CancelRequested(job_id="j", at=0.0, reason=f"e{i}") for i in range(count)]
        await asyncio.gather(*[await producer.send(topic, e) for e in events])
    return topic, f"{settings.topic_prefix}g"


async def first_offset(settings: KafkaSettings, topic: str, group_id: str) -> int:
    """Where the group resumes: the offset of the first record a new member gets."""
    async with Consumer(settings, [topic], group_id=group_id) as consumer:
        return (await asyncio.wait_for(consumer.get(), 15)).offset


async def test_run_bounds_concurrency_and_stop_drains(settings: KafkaSettings) -> None:
    topic, group_id = await prepare(settings, 200)
    handled: list[int] = []
    running = 0
    most_running = 0
    enough = asyncio.Event()

    async def handler(received: Received) -> None:
        nonlocal running, most_running
        running += 1
        most_running = max(most_running, running)
        await asyncio.sleep(0.01)
        running -= 1
        handled.append(received.offset)
        if len(handled) >= 40:
            enough.set()

    consumer = Consumer(settings, [topic], group_id=group_id, max_in_flight=8)
    await consumer.start()
    runner = asyncio.create_task(consumer.run(handler, concurrency=4))
    await asyncio.wait_for(enough.wait(), 15)
    await consumer.stop()  # handlers in flight finish and are acked before the final commit
    await asyncio.wait_for(runner, 5)

    assert most_running == 4
    assert sorted(handled) == list(range(len(handled)))
    assert len(handled) < 200
    # Everything handled was committed, nothing else: the group resumes right after it.
    assert await first_offset(settings, topic, group_id) == len(handled)


async def test_handler_failure_crashes_run_and_the_record_comes_back(
    settings: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    topic, group_id = await prepare(settings, 10)
    handled: list[str] = []

    async def handler(received: Received) -> None:
        assert isinstance(received.message, CancelRequested)
        if received.message.reason == "e3":
            raise RuntimeError("cannot handle e3")
        handled.append(received.message.reason)

    async with Consumer(settings, [topic], group_id=group_id) as consumer:
        with pytest.raises(RuntimeError, match="cannot handle e3"):
            await asyncio.wait_for(consumer.run(handler), 15)
    assert handled == ["e0", "e1", "e2"]
    assert "handler failed" in caplog.text and "RuntimeError" in caplog.text
    assert await first_offset(settings, topic, group_id) == 3
