"""Consumer.joined() against the real broker: a member knows when the group has taken it in."""

from __future__ import annotations

import asyncio
import time

import pytest

from conveyor.platform.bus import Consumer, TopicSpec, ensure_topics
from conveyor.platform.config import KafkaSettings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def settings(kafka_settings: KafkaSettings) -> KafkaSettings:
    """Tansu completes a join after half the session timeout."""
    return kafka_settings.model_copy(update={"session_timeout_s": 2.0, "heartbeat_interval_s": 0.3})


async def test_joined_returns_with_the_first_assignment_even_an_empty_one(
    settings: KafkaSettings,
) -> None:
    topic = f"{settings.topic_prefix}joined"
    await ensure_topics(settings, [TopicSpec(topic, partitions=1)])
    a = Consumer(settings, [topic], group_id=f"{settings.topic_prefix}joined")
    b = Consumer(settings, [topic], group_id=f"{settings.topic_prefix}joined")
    async with a, b:
        await asyncio.wait_for(asyncio.gather(a.joined(), b.joined()), 15)
        deadline = time.monotonic() + 15
        while sum(len(c.assignment()) for c in (a, b)) != 1:  # a revoke may still be on its way
            assert time.monotonic() < deadline, "group did not settle"
            await asyncio.sleep(0.05)
        # One partition for two members: one of them joined with nothing assigned.
        assert sorted(len(c.assignment()) for c in (a, b)) == [0, 1]
    idle = Consumer(settings, [topic], group_id=f"{settings.topic_prefix}never-started")
    with pytest.raises(TimeoutError):  # not started: never joined
        await asyncio.wait_for(idle.joined(), 0.2)


async def test_a_member_knows_when_a_rebalance_takes_its_assignment_and_gives_it_back(
    settings: KafkaSettings,
) -> None:
    topic = f"{settings.topic_prefix}settle"
    await ensure_topics(settings, [TopicSpec(topic, partitions=2)])
    group = f"{settings.topic_prefix}settle"
    a = Consumer(settings, [topic], group_id=group)
    async with a:
        await asyncio.wait_for(a.joined(), 15)
        assert not a.rebalancing and len(a.assignment()) == 2
        b = Consumer(settings, [topic], group_id=group)
        async with b:  # b joining makes the group rebalance: a gives its partitions back
            deadline = time.monotonic() + 15
            while not a.rebalancing:
                assert time.monotonic() < deadline, "a never saw the rebalance"
                await asyncio.sleep(0.01)
            await asyncio.wait_for(asyncio.gather(a.settled(), b.joined()), 15)
            deadline = time.monotonic() + 15
            while sum(len(c.assignment()) for c in (a, b)) != 2 or a.rebalancing:
                assert time.monotonic() < deadline, "group did not settle"
                await asyncio.sleep(0.05)
            assert sorted(len(c.assignment()) for c in (a, b)) == [1, 1]
            assert not b.rebalancing
