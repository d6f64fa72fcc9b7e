"""Consumer-group plumbing under :class:`~conveyor.platform.bus.consumer.Consumer` that reaches into
aiokafka: the rebalance callbacks, leaving the group on stop (which aiokafka skips on Tansu),
and the fetch position read without awaiting."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, RebalanceInProgressError
from aiokafka.protocol.group import HeartbeatRequest, LeaveGroupRequest

if TYPE_CHECKING:
    from conveyor.platform.bus.consumer import Consumer

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
"""Longest the heartbeat before a LeaveGroup may take."""
LEAVE_TIMEOUT_S = 4.0
"""Longest leaving a group may take: the probe, closing the coordinator, the LeaveGroup."""


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commits acked offsets before partitions move, and resets bookkeeping after."""

    def __init__(self, owner: Consumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._owner._on_assigned(set(assigned))


async def stop_and_leave(consumer: AIOKafkaConsumer, group_id: str) -> None:
    """Stop ``consumer`` and leave the group, so that its partitions move at once, unless
    another member is joining right now. Bounded: leaving gets :data:`LEAVE_TIMEOUT_S`, after
    which the broker drops the member at its session timeout.

    aiokafka sends LeaveGroup only when the generation is > 0, but Tansu numbers a group's
    first generation 0; its members would hold their partitions until their session timed
    out. And aiokafka's stop is unbounded: it awaits its coordination task, which can sit in
    a JoinGroup that the broker holds (Tansu held one until the session timeout of a member
    that had left without LeaveGroup, below), then a LeaveGroup that may wait the whole
    request timeout (30 s); a service's stop may take 10 s. So the request is sent here for
    every generation (aiokafka 0.14 internals; the version is pinned), after the coordinator
    stopped heartbeating and before the connection closes, and the whole leave is bounded.

    Tansu 0.6 wedges a group for good when its leader leaves while another member's
    JoinGroup is pending: every later join names the departed member as leader and every
    SyncGroup fails with REBALANCE_IN_PROGRESS, fresh members included (an aggregator stopped
    while a second one joined hung its job at generation 0; the scheduling test's elastic
    job hung at generation 3 the same way; a test reproduces it at generation 1). So a
    heartbeat goes first, at any generation; when it says the group is rebalancing, no
    LeaveGroup goes out and the broker drops this member after its session timeout instead,
    which Tansu handles. The others' join then waits out that timeout: a slower rebalance,
    once, instead of a dead group.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    try:
        async with asyncio.timeout(LEAVE_TIMEOUT_S):
            await _leave(coordinator, group_id)
    except TimeoutError:
        logger.warning(
            "group %s: leaving took over %.0fs; the broker drops this member at its session "
            "timeout", group_id, LEAVE_TIMEOUT_S,
        )  # fmt: skip
        heartbeat = getattr(coordinator, "_heartbeat_task", None)
        if heartbeat is not None:
            heartbeat.cancel()  # the cut-short close did not get to it
    await consumer.stop()  # the coordinator is closed (or cancelled): connections close


async def _leave(coordinator: Any, group_id: str) -> None:
    """Close ``coordinator`` without aiokafka's own LeaveGroup and send ours (see above)."""
    member_id = getattr(coordinator, "member_id", "")
    generation = getattr(coordinator, "generation", -1)
    if coordinator is None or generation < 0 or not member_id:
        return
    rebalancing = await _rebalancing(coordinator, group_id, generation, member_id)
    if rebalancing:
        logger.info(
            "group %s: a member is joining; leaving by session timeout, not LeaveGroup",
            group_id,
        )
    coordinator.generation = -1  # what a member that never joined has: no aiokafka leave
    await coordinator.close()  # idempotent: consumer.stop() calls it again
    if not rebalancing:
        try:
            await coordinator._send_req(LeaveGroupRequest(group_id, member_id))
        except KafkaError as exc:
            logger.warning("group %s: LeaveGroup failed: %s", group_id, exc)


async def _rebalancing(coordinator: Any, group_id: str, generation: int, member_id: str) -> bool:
    """Whether the group coordinator answers a heartbeat with REBALANCE_IN_PROGRESS, or not
    within :data:`PROBE_TIMEOUT_S` (Tansu can hold it during a join: assume the worst)."""
    request = HeartbeatRequest(group_id, generation, member_id)
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            response = await coordinator._send_req(request)
    except TimeoutError:
        return True
    except KafkaError:
        return False  # no coordinator to wedge
    return bool(response.error_code == RebalanceInProgressError.errno)


def fetch_position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    # aiokafka only exposes the position as a coroutine (it may wait for a reset); the lag
    # gauge is read synchronously at scrape time, so read the known position, if any.
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except (AttributeError, KeyError):
        return None
    return state.position if state.has_valid_position else None
