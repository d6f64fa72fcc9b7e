"""The bus against the real broker: group membership and crashes. A member leaving hands over the
rest, a leave during a join does not wedge the group, revokes commit acked records and let
records in flight finish, a killed member's records are redelivered."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time

import pytest
from aiokafka import TopicPartition
from bus_harness import create, event, group, publish_all, wait_assigned

from conveyor.platform.bus import Consumer, TopicSpec
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import Topics


async def test_member_leaving_hands_over_the_rest(settings: KafkaSettings) -> None:
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic, partitions=4))
    total = 400
    await publish_all(settings, topic, (event(i) for i in range(total)))
    seen: dict[str, list[str]] = {"a": [], "b": []}

    async def consume(name: str, consumer: Consumer, stop_after: int | None) -> None:
        async for received in consumer:
            seen[name].append(received.message.reason)  # type: ignore[attr-defined]
            consumer.ack(received)
            if stop_after is not None and len(seen[name]) >= stop_after:
                await consumer.stop()
            await asyncio.sleep(0.002)  # keep both members busy long enough to overlap

    a = Consumer(settings, [topic], group_id=group(settings), commit_interval_s=0.1)
    b = Consumer(settings, [topic], group_id=group(settings), commit_interval_s=0.1)
    async with a, b:
        await wait_assigned(a, b, partitions=4)
        task_a = asyncio.create_task(consume("a", a, stop_after=40))
        task_b = asyncio.create_task(consume("b", b, stop_after=None))
        await asyncio.wait_for(task_a, 15)
        assert a.assignment() == frozenset()
        deadline = time.monotonic() + 20
        while set(seen["a"]) | set(seen["b"]) != {f"e{i}" for i in range(total)}:
            assert time.monotonic() < deadline, "records were lost"
            await asyncio.sleep(0.05)
        assert len(b.assignment()) == 4
        task_b.cancel()
    assert len(seen["a"]) == 40
    assert len(seen["b"]) >= total - 40


@pytest.mark.parametrize("generation", [0, 1])
async def test_leaving_while_another_member_joins_does_not_wedge_the_group(
    settings: KafkaSettings, generation: int
) -> None:
    # Tansu 0.6 wedges a group for good when its leader sends LeaveGroup while another
    # member's JoinGroup is pending (every SyncGroup then fails); the bus leaves by session
    # timeout in that case. The leaving member heartbeats rarely, so it has not yet heard of
    # the join when it stops, as an aggregator stopped right after a new one started. At
    # generation 1 the leader leaves a group that another member stays in, as a trainer
    # taken off an elastic job while a third one joins it.
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic, partitions=4))
    quiet = settings.model_copy(update={"heartbeat_interval_s": settings.session_timeout_s * 0.8})
    leaving = Consumer(quiet, [topic], group_id=group(settings))
    staying = [Consumer(settings, [topic], group_id=group(settings)) for _ in range(generation)]
    joining = Consumer(settings, [topic], group_id=group(settings))
    await leaving.start()
    try:
        await wait_assigned(leaving, partitions=4)
        for consumer in staying:
            await consumer.start()
            await wait_assigned(leaving, *staying, partitions=4)
        await joining.start()
        await asyncio.sleep(0.2)  # its JoinGroup is at the broker, which holds joins a while
        await leaving.stop()
        settle_s = 6 * settings.session_timeout_s
        await wait_assigned(*staying, joining, partitions=4, timeout_s=settle_s)
    finally:
        for consumer in (leaving, *staying, joining):
            await consumer.stop()


async def read_by_all(*consumers: Consumer, count: int) -> list[str]:
    """The reasons of the records ``consumers`` read (acking each) until ``count`` came, and
    0.3 s more: a redelivery, if any, would show up then."""
    read: list[str] = []

    async def drain(consumer: Consumer) -> None:
        async for received in consumer:
            read.append(received.message.reason)  # type: ignore[attr-defined]
            consumer.ack(received)

    tasks = [asyncio.create_task(drain(c)) for c in consumers]
    deadline = time.monotonic() + 15
    while len(read) < count:
        assert time.monotonic() < deadline, f"only {len(read)} records came back"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    for task in tasks:
        task.cancel()
    return read


async def test_revoke_commits_acked_records_so_the_new_owner_skips_them(
    settings: KafkaSettings,
) -> None:
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic, partitions=2))
    total = 40
    await publish_all(settings, topic, (event(i) for i in range(total)))
    no_periodic_commit = 3600.0
    a = Consumer(settings, [topic], group_id=group(settings), commit_interval_s=no_periodic_commit)
    b = Consumer(settings, [topic], group_id=group(settings), commit_interval_s=no_periodic_commit)
    async with a:
        first = [await asyncio.wait_for(a.get(), 15) for _ in range(10)]
        for received in first:
            a.ack(received)
        async with b:  # joining revokes a's partitions: a commits its acks before they move
            await wait_assigned(a, b, partitions=2)
            later = await read_by_all(a, b, count=total - len(first))
    acked_first = {r.message.reason for r in first}  # type: ignore[attr-defined]
    assert not acked_first & set(later)
    assert acked_first | set(later) == {f"e{i}" for i in range(total)}
    assert len(later) == total - len(first)


@pytest.mark.parametrize("grace_s", [15.0, 0.0])
async def test_revoke_grace_lets_records_in_flight_finish_so_none_is_done_twice(
    settings: KafkaSettings, grace_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic, partitions=2))
    total = 40
    await publish_all(settings, topic, (event(i) for i in range(total)))
    no_periodic_commit = 3600.0
    a = Consumer(settings, [topic], group_id=group(settings),
                 commit_interval_s=no_periodic_commit, revoke_grace_s=grace_s)  # fmt: skip
    b = Consumer(settings, [topic], group_id=group(settings), commit_interval_s=no_periodic_commit)
    async with a:
        in_flight = [await asyncio.wait_for(a.get(), 15) for _ in range(10)]
        revoke = a._on_revoked
        finished = asyncio.Event()

        async def revoked_while_working(revoked: set[TopicPartition]) -> None:
            def finish() -> None:  # the handlers' work ends 0.2 s into the revocation
                for received in in_flight:
                    a.ack(received)
                finished.set()

            asyncio.get_running_loop().call_later(0.2, finish)
            await revoke(revoked)

        monkeypatch.setattr(a, "_on_revoked", revoked_while_working)
        async with b:  # joining revokes a's partitions
            await wait_assigned(a, b, partitions=2)
            await asyncio.wait_for(finished.wait(), 15)
            later = await read_by_all(a, b, count=total - len(in_flight) if grace_s else total)
    in_hand = {r.message.reason for r in in_flight}  # type: ignore[attr-defined]
    assert in_hand | set(later) == {f"e{i}" for i in range(total)}
    if grace_s:  # finished within the grace: committed with the revocation, not redone
        assert not in_hand & set(later) and len(later) == total - len(in_flight)
    else:  # without it their acks came too late: the partitions' owners did them again
        assert in_hand <= set(later) and len(later) == total


_HOLDER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from conveyor.platform.bus import Consumer
    from conveyor.platform.config import KafkaSettings

    async def main() -> None:
        settings = KafkaSettings.model_validate_json(sys.argv[1])
        consumer = Consumer(settings, [sys.argv[2]], group_id=sys.argv[3], commit_interval_s=3600)
        await consumer.start()
        received = [await consumer.get() for _ in range(10)]
        for r in received[:4]:
            consumer.ack(r)
        await consumer.commit()
        print("holding", " ".join(str(r.offset) for r in received), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_killed_member_records_are_redelivered(settings: KafkaSettings) -> None:
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic, partitions=1))
    await publish_all(settings, topic, (event(i) for i in range(10)))
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER_SCRIPT,
        settings.model_dump_json(),
        topic,
        group(settings),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 30)
        assert line.decode().split() == ["holding", *map(str, range(10))]
        holder.send_signal(signal.SIGKILL)  # no commit, no LeaveGroup: its session must expire
        await holder.wait()
        # The dead member still belongs to the group until its session times out; then the
        # partition moves, from the last commit: the 6 records it held unacked come back.
        async with Consumer(settings, [topic], group_id=group(settings)) as survivor:
            redelivered = [await asyncio.wait_for(survivor.get(), 20) for _ in range(6)]
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
    assert [r.offset for r in redelivered] == list(range(4, 10))
    events = [r.message.reason for r in redelivered]  # type: ignore[attr-defined]
    assert events == [f"e{i}" for i in range(4, 10)]
