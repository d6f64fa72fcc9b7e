"""Exposed data-wait accounting (prefetch + meter) with fake producers, and stage latencies."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from opentelemetry.context import Context

from conveyor.platform.bus import Received
from conveyor.platform.bus.offsets import PartitionOffsets
from conveyor.platform.messages import Batch
from conveyor.services.trainer.data.prefetch import DeviceCopier, Prefetcher
from conveyor.services.trainer.reporting.timing import (
    STEP_PARTS,
    Rates,
    StageLatencies,
    StepTimes,
    WaitMeter,
)


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


def test_wait_meter_window_and_job_totals() -> None:
    now = [0.0]
    meter = WaitMeter(window_s=10.0, clock=lambda: now[0])
    assert meter.ratio is None and meter.recent() == Rates(None, 0.0, 0.0)
    meter.add(wait_s=3.0, compute_s=1.0, samples=40)
    now[0] = 20.0  # the first entry leaves the window
    meter.add(wait_s=1.0, compute_s=2.0, samples=100)
    meter.add(sync_s=2.0)  # the gradient plane's time is step time too
    assert meter.ratio == pytest.approx(4.0 / 9.0)
    rates = meter.recent()
    assert rates.data_wait_ratio == pytest.approx(1.0 / 5.0)
    assert rates.samples_per_second == pytest.approx(100 / 5.0)  # wall: wait + compute + sync
    assert rates.compute_samples_per_second == pytest.approx(50.0)  # compute only
    with pytest.raises(ValueError):
        meter.add(wait_s=-1.0)


def test_step_times_average_the_recent_steps() -> None:
    times = StepTimes(window=2)
    assert times.means() == dict.fromkeys(STEP_PARTS, 0.0)
    times.add(data_wait=9.0, compute=9.0)  # leaves the window
    times.add(data_wait=1.0, h2d=0.5, compute=2.0, grad_send=0.2, param_wait=0.4)
    times.add(compute=4.0, param_wait=0.2)
    assert times.means() == pytest.approx(
        {"data_wait": 0.5, "h2d": 0.25, "compute": 3.0, "grad_send": 0.1, "param_wait": 0.3}
    )
    with pytest.raises(ValueError, match="unknown"):
        times.add(update=1.0)


def test_stage_latencies_from_batch_stamps() -> None:
    stages = StageLatencies(window=3)
    for k in range(4):
        stamps = {
            "read_start": 0.0,
            "read_end": 0.1 * k,
            "augment_end": 0.1 * k + 0.05,
            "sent": 1.0,
            "received": 1.5,
            "h2d_end": 1.5 + 0.01 * k,
        }
        stages.add_batch(stamps, compute_s=0.2)
    p50 = stages.percentile(50)
    assert p50["read"] == pytest.approx(0.2)  # the window keeps k = 1, 2, 3
    assert p50["augment"] == pytest.approx(0.05)
    assert p50["queue"] == pytest.approx(0.5)
    assert p50["h2d"] == pytest.approx(0.02)
    assert p50["compute"] == pytest.approx(0.2)
    partial = StageLatencies(window=3)
    partial.add_batch({"sent": 2.0, "received": 1.0}, compute_s=None)  # skewed clocks
    assert partial.percentile(50) == {"queue": 0.0}
