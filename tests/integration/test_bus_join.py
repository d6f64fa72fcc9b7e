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
