"""Bounded prefetch with fake producers: the exposed data wait it leaves (measured with the
figures' wait meter), records of another job, the timeout of a take."""

from __future__ import annotations

import asyncio
import time

import torch
from opentelemetry.context import Context

from conveyor.platform.bus import Received
from conveyor.platform.bus.offsets import PartitionOffsets
from conveyor.platform.messages import Batch
from conveyor.services.trainer.data.prefetch import DeviceCopier, Prefetcher
from conveyor.services.trainer.reporting.figures import WaitMeter


def record(offset: int, job_id: str = "job1") -> Received:
    batch = Batch(
        job_id=job_id,
        batch_id=f"{job_id}:e0:train:00000:b{offset:03d}",
        shard_id=f"{job_id}:e0:train:00000",
        epoch=0,
        split="train",
        sample_ids=[offset * 2, offset * 2 + 1],
        x=torch.zeros(2, 1, 8, 8, dtype=torch.uint8),
        y=torch.zeros(2, dtype=torch.int64),
        timestamps={"read_start": 1.0, "read_end": 1.5, "augment_end": 1.75, "sent": 2.0},
    )
    return Received(
        topic="t.job.job1.batches",
        partition=0,
        offset=offset,
        key=None,
        message=batch,
        headers={},
        timestamp_ms=0,
        size_bytes=0,
        context=Context(),
        _offsets=PartitionOffsets(),
    )


class FakeSource:
    """Produces a record every ``interval_s`` seconds (0: as fast as asked)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.offset = 0

    async def get(self) -> Received:
        await asyncio.sleep(self.interval_s)
        self.offset += 1
        return record(self.offset)


def prefetcher(source: FakeSource, *, depth: int, rejected: list[str]) -> Prefetcher:
    return Prefetcher(
        source,
        DeviceCopier(torch.device("cpu")),
        job_id="job1",
        depth=depth,
        consumer_group="g",
        reject=lambda received, reason: rejected.append(reason),
    )


async def measure(source: FakeSource, compute_s: float, batches: int) -> WaitMeter:
    """Run a step loop: take a batch (wait measured apart), 'compute' for compute_s."""
    rejected: list[str] = []
    prefetch = prefetcher(source, depth=4, rejected=rejected)
    meter = WaitMeter(window_s=60.0)
    fetching = asyncio.create_task(prefetch.run())
    try:
        await asyncio.sleep(0.05)  # start-up: let prefetch fill, as the runner skips this wait
        for _ in range(batches):
            item, wait_s = await prefetch.get()
            assert item is not None
            assert item.timestamps["received"] <= item.timestamps["h2d_end"]
            started = time.perf_counter()
            await asyncio.sleep(compute_s)  # the step loop yields while the compute thread runs
            item.span.end()
            meter.add(wait_s=wait_s, compute_s=time.perf_counter() - started, samples=2)
    finally:
        fetching.cancel()
    assert rejected == []
    return meter


async def test_a_slow_producer_shows_up_as_exposed_wait() -> None:
    meter = await measure(FakeSource(interval_s=0.03), compute_s=0.003, batches=8)
    assert meter.ratio is not None and meter.ratio > 0.6
    assert meter.wait_s > 0.1


async def test_prefetch_hides_a_fast_producer() -> None:
    meter = await measure(FakeSource(interval_s=0.0), compute_s=0.02, batches=8)
    assert meter.ratio is not None and meter.ratio < 0.2
    assert meter.samples == 16


async def test_records_of_another_job_are_rejected_not_queued() -> None:
    class Mixed(FakeSource):
        async def get(self) -> Received:
            self.offset += 1
            return record(self.offset, job_id="other" if self.offset == 1 else "job1")

    rejected: list[str] = []
    prefetch = prefetcher(Mixed(0), depth=1, rejected=rejected)
    fetching = asyncio.create_task(prefetch.run())
    item, _ = await asyncio.wait_for(prefetch.get(), 5)
    fetching.cancel()
    assert item is not None and item.received.offset == 2
    assert rejected == ["batch of job other, not job1"]


async def test_get_gives_up_after_its_timeout() -> None:
    prefetch = prefetcher(FakeSource(interval_s=10.0), depth=1, rejected=[])
    fetching = asyncio.create_task(prefetch.run())
    item, waited = await prefetch.get(timeout_s=0.05)
    fetching.cancel()
    assert item is None and 0.04 <= waited < 1.0
