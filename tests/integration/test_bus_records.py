"""The bus against the real broker: records. Round trips, DLQ, tracing, backpressure and rest,
limits, and topics (admin, missing topics, a missing dead-letter topic)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import pytest
import torch
from bus_harness import create, event, group, make_batch, metric, publish_all
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conveyor.platform.bus import (
    BusError,
    BusUnavailable,
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
from conveyor.platform.messages import Batch, DeadLetter, Topics

MiB = 1024 * 1024


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
        assert span.attributes is not None
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


async def deliveries(consumer: Consumer, count: int) -> list[str]:
    """The names of the next ``count`` records, each acked before the next get."""
    names = []
    for _ in range(count):
        received = await asyncio.wait_for(consumer.get(), 15)
        names.append(received.message.reason)  # type: ignore[attr-defined]
        consumer.ack(received)
    return names


async def test_oldest_first_delivers_across_partitions_in_the_order_produced(
    settings: KafkaSettings,
) -> None:
    # Each partition's records are spread over the sequence, as the sharder spreads an epoch's
    # tasks; the client hands one partition's fetched records over before the next's.
    topic = Topics(settings.topic_prefix).shards
    await create(settings, TopicSpec(topic, partitions=4))
    partitions = [0, 0, 0, 1, 1, 2, 0, 3, 3, 1, 2, 2]
    async with Producer(settings) as producer:
        for index, partition in enumerate(partitions):
            await (await producer.send(topic, event(index), partition=partition))
            await asyncio.sleep(0.003)  # record timestamps are in milliseconds
    produced = [f"e{i}" for i in range(len(partitions))]

    async with Consumer(
        settings, [topic], group_id=group(settings, "oldest"), max_in_flight=1, oldest_first=True
    ) as consumer:
        assert await deliveries(consumer, len(partitions)) == produced
    # The same log read in the client's order is not the produced order: the check above
    # tells the orders apart.
    async with Consumer(
        settings, [topic], group_id=group(settings, "fetch-order"), max_in_flight=1
    ) as consumer:
        fetch_order = await deliveries(consumer, len(partitions))
    assert sorted(fetch_order) == sorted(produced) and fetch_order != produced


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
    quick = settings.model_copy(update={"request_timeout_s": 2.0, "topic_wait_s": 2.0})
    consumer = Consumer(quick, [deleted, never], group_id=group(settings))
    with pytest.raises(BusUnavailable, match="not in the broker's metadata"):
        await consumer.start()  # several metadata fetches, then it gives up
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
