"""Helpers of the bus tests against the real broker (test_bus_groups.py, test_bus_records.py):
topics created, batches and small events built and published, a group settled, a group id and a
metric read (the ``settings`` fixture for fast group changes is in conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import torch
from prometheus_client import REGISTRY

from conveyor.platform.bus import Consumer, Producer, TopicAdmin, TopicSpec
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import Batch, CancelRequested


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
