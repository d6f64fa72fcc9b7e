"""Bus benchmark: the project's Producer/Consumer vs raw aiokafka, same broker, same bytes.

Each repeat runs both cases, in alternating order, each through a fresh topic (deleted after,
since the embedded broker keeps everything in memory):
    raw  AIOKafkaProducer sends N records whose value is the batch's tensor bytes; an
         AIOKafkaConsumer (same group settings, manual commit) reads them back with getmany
         and commits once at the end;
    bus  Producer.send of N Batch messages holding those tensors (encode included), then
         Consumer.get + ack per message (decode included), committing as it goes and at the end.
Both use the client options the bus derives from KafkaSettings, so the difference is the
bus's own work. Clients are started and the group joined before the clock starts; the time
is produce-all (every ack received) + consume-all. Throughput = tensor bytes / time.
ratio = median over repeats of bus/raw, both taken in the same repeat. The last line printed
is one JSON object: {"bus_vs_raw_aiokafka": <ratio>}.

    .venv/bin/python -m loadtests.bench_bus --messages 200 --size-bytes 786432 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial

import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from rich.console import Console
from rich.table import Table

from conveyor.embedded.broker import EmbeddedBroker
from conveyor.platform.bus import Consumer, Producer, TopicAdmin, TopicSpec
from conveyor.platform.bus.options import consumer_options, producer_options
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import Batch

IMAGE_BYTES = 3 * 32 * 32
"""One CIFAR-like uint8 image [3, 32, 32]."""


def make_batch(size_bytes: int) -> Batch:
    """A Batch whose x holds ``size_bytes`` bytes: [B, 3, 32, 32] when that divides, else
    [1, 1, 1, size_bytes]."""
    if size_bytes % IMAGE_BYTES == 0:
        shape = (size_bytes // IMAGE_BYTES, 3, 32, 32)
    else:
        shape = (1, 1, 1, size_bytes)
    rows = shape[0]
    generator = torch.Generator().manual_seed(0)
    return Batch(
        job_id="bench",
        batch_id="bench-0",
        shard_id="bench-shard",
        epoch=0,
        split="train",
        sample_ids=list(range(rows)),
        x=torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator),  # [B, C, H, W]
        y=torch.randint(0, 10, (rows,), dtype=torch.int64, generator=generator),  # [B]
        timestamps={"preprocessed": 0.0},
    )


def tensor_bytes(batch: Batch) -> bytes:
    """The raw case's record value: the same tensor bytes the Batch carries."""
    return batch.x.numpy().tobytes() + batch.y.numpy().tobytes()


async def wait_assigned(assignment: Callable[[], object], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not assignment():
        if time.monotonic() > deadline:
            raise TimeoutError("consumer got no partition")
        await asyncio.sleep(0.02)


async def run_raw(settings: KafkaSettings, topic: str, value: bytes, count: int) -> float:
    """Seconds to produce ``count`` records (all acked) and consume them with raw aiokafka."""
    producer = AIOKafkaProducer(**producer_options(settings))
    consumer = AIOKafkaConsumer(**consumer_options(settings, f"{topic}.raw"))
    await producer.start()
    await consumer.start()
    try:
        consumer.subscribe([topic])
        await wait_assigned(consumer.assignment)
        started = time.perf_counter()
        acks = [await producer.send(topic, value) for _ in range(count)]
        await asyncio.gather(*acks)
        received = 0
        while received < count:
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                received += sum(1 for r in records if len(r.value) == len(value))
        await consumer.commit()
        return time.perf_counter() - started
    finally:
        await consumer.stop()
        await producer.stop()


async def run_bus(settings: KafkaSettings, topic: str, batch: Batch, count: int) -> float:
    """Seconds to send ``count`` Batch messages (all acked) and get + ack them via the bus."""
    async with (
        Producer(settings) as producer,
        Consumer(settings, [topic], group_id=f"{topic}.bus") as consumer,
    ):
        await wait_assigned(consumer.assignment)
        started = time.perf_counter()
        acks = [await producer.send(topic, batch) for _ in range(count)]
        await asyncio.gather(*acks)
        for _ in range(count):
            received = await consumer.get()
            if received.message.x.numel() != batch.x.numel():  # type: ignore[attr-defined]
                raise AssertionError("wrong message")
            consumer.ack(received)
        await consumer.commit()
        return time.perf_counter() - started


async def fresh_topic(settings: KafkaSettings, run: Callable[[str], Awaitable[float]]) -> float:
    topic = f"{settings.topic_prefix}bench.{uuid.uuid4().hex[:8]}"
    async with TopicAdmin(settings) as admin:
        await admin.create_topics([TopicSpec(topic)])
    try:
        return await run(topic)
    finally:
        async with TopicAdmin(settings) as admin:
            await admin.delete_topics([topic])


async def bench(settings: KafkaSettings, count: int, size_bytes: int, repeats: int) -> None:
    batch = make_batch(size_bytes)
    value = tensor_bytes(batch)
    total_bytes = len(value) * count
    cases: dict[str, Callable[[str], Awaitable[float]]] = {
        "raw": lambda topic: run_raw(settings, topic, value, count),
        "bus": lambda topic: run_bus(settings, topic, batch, count),
    }
    throughput: dict[str, list[float]] = {"raw": [], "bus": []}
    ratios = []
    for repeat in range(repeats + 1):  # repeat 0 warms up (connections, imports, allocator)
        order = ["raw", "bus"] if repeat % 2 else ["bus", "raw"]
        result = {name: total_bytes / await fresh_topic(settings, cases[name]) for name in order}
        if repeat == 0:
            continue
        for name, value_bps in result.items():
            throughput[name].append(value_bps)
        ratios.append(result["bus"] / result["raw"])

    table = Table(title=f"{count} records x {len(value)} bytes, {repeats} repeats (medians)")
    table.add_column("case")
    table.add_column("MB/s", justify="right")
    table.add_column("min..max MB/s", justify="right")
    for name in ("raw", "bus"):
        values = throughput[name]
        table.add_row(
            name,
            f"{statistics.median(values) / 1e6:.0f}",
            f"{min(values) / 1e6:.0f}..{max(values) / 1e6:.0f}",
        )
    ratio = statistics.median(ratios)
    table.add_row("bus / raw", f"{ratio:.3f}", f"{min(ratios):.3f}..{max(ratios):.3f}")
    Console().print(table)
    print(json.dumps({"bus_vs_raw_aiokafka": round(ratio, 4)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="an existing broker; default: start an embedded one")
    parser.add_argument("--messages", type=int, default=200, help="records per case and repeat")
    parser.add_argument(
        "--size-bytes", type=int, default=256 * IMAGE_BYTES, help="bytes of x per Batch"
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.messages < 1 or args.size_bytes < 1 or args.repeats < 1:
        parser.error("--messages, --size-bytes and --repeats must be >= 1")
    logging.basicConfig(level=logging.WARNING)

    def settings_for(bootstrap: str, session_timeout_s: float) -> KafkaSettings:
        return KafkaSettings(
            bootstrap=bootstrap,
            topic_prefix=f"bench{uuid.uuid4().hex[:6]}.",
            session_timeout_s=session_timeout_s,
            heartbeat_interval_s=0.5,
        )

    run = partial(bench, count=args.messages, size_bytes=args.size_bytes, repeats=args.repeats)
    if args.bootstrap:
        # Real Kafka refuses sessions under 6 s (group.min.session.timeout.ms).
        asyncio.run(run(settings_for(args.bootstrap, 6.0)))
        return
    # Tansu completes a group join after half the session timeout: keep joins short.
    with EmbeddedBroker() as broker:
        asyncio.run(run(settings_for(broker.bootstrap, 2.0)))


if __name__ == "__main__":
    main()
