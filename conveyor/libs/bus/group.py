"""Consumer-group plumbing under :class:`~conveyor.libs.bus.consumer.Consumer` that reaches into
aiokafka: the rebalance callbacks, leaving the group on stop (which aiokafka skips on Tansu),
and the fetch position read without awaiting."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import LeaveGroupRequest

if TYPE_CHECKING:
    from conveyor.libs.bus.consumer import Consumer

logger = logging.getLogger(__name__)


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commits acked offsets before partitions move, and resets bookkeeping after."""

    def __init__(self, owner: Consumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._owner._on_assigned(set(assigned))


async def stop_and_leave(consumer: AIOKafkaConsumer, group_id: str) -> None:
    """Stop ``consumer`` and leave the group, so that its partitions move at once.

    aiokafka sends LeaveGroup only when the generation is > 0, but Tansu numbers a group's
    first generation 0; its members would hold their partitions until their session timed
    out. For that case the request is sent here (aiokafka 0.14 internals; the version is
    pinned), after the coordinator stopped heartbeating and before the connection closes.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    member_id = getattr(coordinator, "member_id", "")
    if coordinator is not None and getattr(coordinator, "generation", -1) == 0 and member_id:
        await coordinator.close()  # idempotent: consumer.stop() calls it again
        try:
            await coordinator._send_req(LeaveGroupRequest(group_id, member_id))
        except KafkaError as exc:
            logger.warning("group %s: LeaveGroup failed: %s", group_id, exc)
    await consumer.stop()


def fetch_position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    # aiokafka only exposes the position as a coroutine (it may wait for a reset); the lag
    # gauge is read synchronously at scrape time, so read the known position, if any.
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except (AttributeError, KeyError):
        return None
    return state.position if state.has_valid_position else None
