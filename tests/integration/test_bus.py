"""The bus against the real broker: round trips, group membership, crashes, DLQ, tracing, limits."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterable

import pytest
import torch
from aiokafka import TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from conveyor.platform.bus import (
    BusError,
    Consumer,
    Producer,
    Received,
    RecordTooLarge,
    TopicAdmin,
    TopicSpec,
    create_topology,
    process_span,
)
from conveyor.platform.config import KafkaSettings, TopologySettings
from conveyor.platform.messages import Batch, CancelRequested, DeadLetter, Topics

MiB = 1024 * 1024


@pytest.fixture
def settings(kafka_settings: KafkaSettings) -> KafkaSettings:
    """Settings for fast group changes: Tansu completes a join after half the session timeout;
    a real Kafka refuses sessions under 6 s (group.min.session.timeout.ms)."""
    session_s = 6.0 if os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP") else 2.0
    return kafka_settings.model_copy(
        update={"session_timeout_s": session_s, "heartbeat_interval_s": 0.3}
    )


async def create(settings: KafkaSettings, *specs: TopicSpec) -> None:
    async with TopicAdmin(settings) as admin:
        await admin.create_topics(specs)


def make_batch(index: int, *, rows: int = 4, side: int = 8) -> Batch:
    generator = torch.Generator().manual_seed(index)
    return Batch(
        job_id="j1",
        batch_id=f"b{index}",
        shard_id="s0",
        epoch=0,
        split="train",
        sample_ids=list(range(index * rows, (index + 1) * rows)),
        x=torch.randint(0, 256, (rows, 3, side, side), dtype=torch.uint8, generator=generator),
        y=torch.randint(0, 10, (rows,), dtype=torch.int64, generator=generator),
        timestamps={"sent": 1.5},
    )


def event(index: int) -> CancelRequested:
    """A small message whose ``reason`` names it (``e<index>``)."""
    return CancelRequested(job_id="j1", at=float(index), reason=f"e{index}")


async def publish_all(
    settings: KafkaSettings, topic: str, messages: Iterable[CancelRequested]
) -> None:
    async with Producer(settings) as producer:
        acks = [await producer.send(topic, m, key=m.reason) for m in messages]
        await asyncio.gather(*acks)


async def wait_assigned(*consumers: Consumer, partitions: int, timeout_s: float = 15.0) -> None:
    """Wait until the consumers together hold ``partitions`` partitions, each at least one."""
    deadline = time.monotonic() + timeout_s
    while not (
        all(c.assignment() for c in consumers)
        and sum(len(c.assignment()) for c in consumers) == partitions
    ):
        assert time.monotonic() < deadline, "group did not settle"
        await asyncio.sleep(0.05)


def group(settings: KafkaSettings, name: str = "g") -> str:
    """A group id unique to the test (group ids are shared across tests on one broker)."""
    return f"{settings.topic_prefix}{name}"


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_round_trip_keeps_tensors_keys_and_headers(settings: KafkaSettings) -> None:
    topic = Topics(settings.topic_prefix).batches("j1")
    await create(settings, TopicSpec(topic, partitions=2))
    sent = [make_batch(i) for i in range(6)]
    produced_before = metric("conveyor_bus_produced_records_total", topic_kind="batches")
    consumed_before = metric("conveyor_bus_consumed_records_total", topic_kind="batches")
    async with Producer(settings) as producer:
        acks = [
            await producer.send(topic, b, key=b.batch_id, headers={"origin": b"test"}) for b in sent
        ]
        metadata = await asyncio.gather(*acks)
    assert len({(m.partition, m.offset) for m in metadata}) == len(sent)

    by_id: dict[str, Received] = {}
    async with Consumer(settings, [topic], group_id=group(settings)) as consumer:
        while len(by_id) < len(sent):
            received = await asyncio.wait_for(consumer.get(), 15)
            by_id[received.message.batch_id] = received  # type: ignore[attr-defined]
            consumer.ack(received)
        await consumer.commit()
        assert consumer.lag() == 0
    assert (
        metric("conveyor_bus_produced_records_total", topic_kind="batches") == produced_before + 6
    )
    assert (
        metric("conveyor_bus_consumed_records_total", topic_kind="batches") == consumed_before + 6
    )
    for batch in sent:
        got = by_id[batch.batch_id]
        assert isinstance(got.message, Batch)
        assert torch.equal(got.message.x, batch.x)
        assert torch.equal(got.message.y, batch.y)
        assert got.message.sample_ids == batch.sample_ids
        assert got.message.timestamps == {"sent": 1.5}
        assert got.key == batch.batch_id.encode()
        assert got.headers["origin"] == b"test"
        assert got.size_bytes > batch.x.numel()
        assert got.topic == topic


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


async def test_undecodable_record_goes_to_dlq_and_consumption_continues(
    settings: KafkaSettings,
) -> None:
    topics = Topics(settings.topic_prefix)
    topic = topics.batches("j1")
    await create_topology(settings, TopologySettings())  # the dead-letter topic, as the sharder
    await create(settings, TopicSpec(topic))
    garbage = os.urandom(333)
    before = metric("conveyor_bus_dead_letters_total", topic_kind="batches")
    async with Producer(settings) as producer:
        await (await producer.send_raw(topic, garbage, key=b"bad"))
        await producer.publish(topic, make_batch(1), key="good")

    async with Consumer(settings, [topic], group_id=group(settings)) as consumer:
        received = await asyncio.wait_for(consumer.get(), 15)
        assert received.offset == 1
        assert received.message.batch_id == "b1"  # type: ignore[attr-defined]
        consumer.ack(received)
        await consumer.commit()
    assert metric("conveyor_bus_dead_letters_total", topic_kind="batches") == before + 1

    async with Consumer(settings, [topics.dlq], group_id=group(settings, "dlq-reader")) as reader:
        letter = (await asyncio.wait_for(reader.get(), 15)).message
    assert isinstance(letter, DeadLetter)
    assert (letter.source_topic, letter.partition, letter.offset) == (topic, 0, 0)
    assert letter.key == b"bad"
    assert letter.payload == garbage
    assert letter.reason.startswith(("MalformedMessage", "MessageTooLarge", "UnknownMessageType"))
    assert abs(letter.failed_at - time.time()) < 60

    # The group committed past both records: a restarted member starts after them.
    async with Producer(settings) as producer:
        await producer.publish(topic, make_batch(2))
    async with Consumer(settings, [topic], group_id=group(settings)) as consumer:
        assert (await asyncio.wait_for(consumer.get(), 15)).offset == 2


async def test_trace_context_crosses_a_hop(settings: KafkaSettings) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    topic = Topics(settings.topic_prefix).batches("j1")
    await create(settings, TopicSpec(topic))

    async with Producer(settings, tracer_provider=provider) as producer:
        with provider.get_tracer("test").start_as_current_span("preprocess") as parent:
            await producer.publish(topic, make_batch(0), key="b0")
    async with Consumer(settings, [topic], group_id=group(settings)) as consumer:
        received = await asyncio.wait_for(consumer.get(), 15)
        with process_span(received, tracer_provider=provider, consumer_group=group(settings)):
            pass
        consumer.ack(received)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    template = f"{settings.topic_prefix}job.{{id}}.batches"  # no job id in a span name
    send, process = spans[f"send {template}"], spans[f"process {template}"]
    for span in (send, process):
        assert span.attributes["messaging.destination.name"] == topic
        assert span.attributes["messaging.destination.template"] == template
    carried = trace.get_current_span(received.context).get_span_context()
    assert "traceparent" in received.headers
    assert carried.trace_id == send.context.trace_id == parent.get_span_context().trace_id
    assert carried.span_id == send.context.span_id
    assert send.kind == trace.SpanKind.PRODUCER and process.kind == trace.SpanKind.CONSUMER
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert process.context.trace_id == send.context.trace_id
    assert send.attributes is not None and process.attributes is not None
    assert send.attributes["messaging.system"] == "kafka"
    assert send.attributes["messaging.destination.name"] == topic
    assert send.attributes["messaging.kafka.message.key"] == "b0"
    assert send.attributes["messaging.kafka.offset"] == 0
    assert process.attributes["messaging.destination.partition.id"] == "0"
    assert process.attributes["messaging.consumer.group.name"] == group(settings)


async def test_backpressure_pauses_at_max_in_flight(settings: KafkaSettings) -> None:
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic))
    await publish_all(settings, topic, (event(i) for i in range(5)))
    async with Consumer(settings, [topic], group_id=group(settings), max_in_flight=2) as consumer:
        first = [await asyncio.wait_for(consumer.get(), 15) for _ in range(2)]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consumer.get(), 1.0)
        assert consumer.in_flight == 2
        assert consumer.paused
        assert consumer.lag() == 3
        assert metric("conveyor_bus_consumer_lag_records", topic_kind="shards") == 3

        consumer.ack(first[1])  # out of order: frees a slot, commit point stays at 0
        assert not consumer.paused
        third = await asyncio.wait_for(consumer.get(), 5)
        assert third.offset == 2
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consumer.get(), 0.5)

        consumer.ack(first[0])
        consumer.ack(third)
        rest = [await asyncio.wait_for(consumer.get(), 5) for _ in range(2)]
        assert [r.offset for r in rest] == [3, 4]
        consumer.ack(rest[0])
        assert consumer.in_flight == 1


async def test_resting_sends_no_fetches_and_loses_nothing(
    settings: KafkaSettings, fetch_requests: Callable[[], int]
) -> None:
    settings = settings.model_copy(update={"fetch_max_wait_ms": 20})
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic))
    await publish_all(settings, topic, (event(i) for i in range(2)))
    async with Consumer(settings, [topic], group_id=group(settings), max_in_flight=2) as consumer:
        first = [await asyncio.wait_for(consumer.get(), 15) for _ in range(2)]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consumer.get(), 0.3)
        assert consumer.paused  # backpressure: 2 unacked

        consumer.rest(True)
        for received in first:
            consumer.ack(received)  # frees the slots; resting still holds the fetches
        assert not consumer.paused and consumer.resting
        await publish_all(settings, topic, (event(i) for i in range(2, 5)))
        await asyncio.sleep(0.1)  # a fetch sent before the rest comes back
        resting = fetch_requests()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consumer.get(), 1.0)
        assert fetch_requests() - resting <= 1

        consumer.rest(False)
        later = [await asyncio.wait_for(consumer.get(), 5) for _ in range(2)]
        assert [r.offset for r in later] == [2, 3]
        consumer.ack(later[0])
        last = await asyncio.wait_for(consumer.get(), 5)
        assert last.offset == 4 and last.message == event(4)


async def test_records_over_max_message_bytes_are_refused(settings: KafkaSettings) -> None:
    settings = settings.model_copy(update={"max_message_bytes": 1 * MiB})
    topic = Topics(settings.topic_prefix).batches("j1")
    await create(settings, TopicSpec(topic))
    async with Producer(settings) as producer:
        with pytest.raises(RecordTooLarge, match="max_message_bytes"):
            await producer.send(topic, make_batch(0, rows=40, side=96))  # 1.1 MB of pixels
        with pytest.raises(RecordTooLarge, match="max_message_bytes"):
            await producer.send_raw(topic, bytes(MiB - 10), key=b"k" * 11)
        metadata = await producer.publish(topic, make_batch(1, rows=4, side=96))
    assert metadata.offset == 0  # the refused records never reached the broker


async def test_admin_creates_lists_and_deletes(settings: KafkaSettings) -> None:
    names = [f"{settings.topic_prefix}a", f"{settings.topic_prefix}b"]
    async with TopicAdmin(settings) as admin:
        await admin.create_topics([TopicSpec(names[0], partitions=3), TopicSpec(names[1])])
        await admin.create_topics([TopicSpec(names[0], partitions=3)])  # exist_ok
        with pytest.raises(BusError, match=names[0]):
            await admin.create_topics([TopicSpec(names[0])], exist_ok=False)
        assert set(names) <= await admin.list_topics()
        await admin.delete_topics([*names, f"{settings.topic_prefix}missing"])
        assert not set(names) & await admin.list_topics()
        with pytest.raises(BusError, match="missing"):
            await admin.delete_topics([f"{settings.topic_prefix}missing"], missing_ok=False)
    with pytest.raises(ValueError, match="partitions"):
        TopicSpec("x", partitions=0)


async def test_clients_of_a_missing_topic_do_not_create_it(settings: KafkaSettings) -> None:
    """A late consumer or producer of a deleted job topic must not bring it back (brokers with
    auto-creation on, Tansu included, create any topic a client asks metadata for)."""
    topics = Topics(settings.topic_prefix)
    deleted, never = topics.grads("ended"), topics.grads("never")
    await create(settings, TopicSpec(deleted))
    async with TopicAdmin(settings) as admin:
        await admin.delete_topics([deleted])
    quick = settings.model_copy(update={"request_timeout_s": 2.0})
    async with Consumer(quick, [deleted, never], group_id=group(settings)) as consumer:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consumer.get(), 3)  # several metadata refreshes
        async with Producer(quick) as producer:
            with pytest.raises(BusError, match=never):
                await producer.publish(never, event(0))
    async with TopicAdmin(settings) as admin:
        assert not {deleted, never, topics.dlq} & await admin.list_topics()


async def test_dead_lettering_without_the_dead_letter_topic_fails_loudly(
    settings: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """The sharder creates the dead-letter topic; a consumer that finds it missing logs an error
    and keeps the record (redelivered by the next get) instead of creating the topic."""
    topics = Topics(settings.topic_prefix)
    topic = topics.batches("j1")
    await create(settings, TopicSpec(topic))
    async with Producer(settings) as producer:
        await (await producer.send_raw(topic, b"not a message", key=b"bad"))
    quick = settings.model_copy(update={"request_timeout_s": 2.0})
    with caplog.at_level(logging.ERROR, logger="conveyor.platform.bus.dead_letters"):
        async with Consumer(quick, [topic], group_id=group(settings)) as consumer:
            with pytest.raises(BusError, match=topics.dlq):
                await asyncio.wait_for(consumer.get(), 15)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"does {topics.dlq} exist?" in message for message in errors), errors
    async with TopicAdmin(settings) as admin:
        assert topics.dlq not in await admin.list_topics()
