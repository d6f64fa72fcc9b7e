"""Flow control and failover on a stack of two preprocessors and two aggregators (`--scale`)
and a trainer slowed to a simulated slow accelerator (CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S).

The flow-control test runs first; then the failover tests, which SIGKILL a preprocessor and an
aggregator.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from e2e_stack import (
    RunningStack,
    digits_spec,
    metric_sum,
    metric_values,
    running_stack,
    wait_for,
)
from ledger_check import assert_exactly_once

from conveyor.cli.client import TERMINAL_STATES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEP_DELAY_S = 0.05
"""Simulated extra compute per micro-batch: the trainer (~15 batches/s) is the bottleneck."""
LEAD = 8
"""flow.max_lead_batches of the flow-control job."""
SHARD_BATCHES = 2
MICRO = 32
SAMPLE_EVERY_S = 0.2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with running_stack(
        tmp_path_factory.mktemp("flow") / "state",
        args=["--scale", "preprocessor=2", "--scale", "aggregator=2"],
        env={"CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S": str(STEP_DELAY_S)},
    ) as running:
        yield running


def finished_batches(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    """Batches the trainer has trained or evaluated: its ``consumed_batches``, read live from
    its /metrics instead of from progress reports, which lag."""
    return metric_sum(metrics, "conveyor_trainer_batches_total", outcome="done")


@dataclass
class Backlog:
    unique: int
    """Distinct batch ids seen on the job's batches topic."""
    unfinished: float
    """``unique`` minus the batches the trainer had finished a moment *later*."""
    reported: int
    """``unique`` minus the consumed count of the gateway's latest progress report."""


@dataclass
class BatchesReader:
    """Reads a batches topic from the beginning (no group, nothing committed) and counts its
    records and distinct batch ids (the record keys). Counting records, not end offsets:
    Tansu 0.6 answers ListOffsets(latest) with the last record batch's base offset + 1, which
    undercounts whenever a producer put several records in one batch."""

    consumer: AIOKafkaConsumer
    ids: set[bytes] = field(default_factory=set)
    records: int = 0

    async def run(self) -> None:
        while True:
            fetched = await self.consumer.getmany(timeout_ms=100)
            for records in fetched.values():
                for record in records:
                    self.records += 1
                    self.ids.add(record.key or b"")


async def sample_backlog(stack: RunningStack, job_id: str) -> tuple[list[Backlog], int]:
    """Sample the job's batch backlog every SAMPLE_EVERY_S until it ends; returns the samples
    and the records read (duplicates included)."""
    trainer = stack.service("trainer")
    gateway = stack.state.gateway_url
    samples: list[Backlog] = []
    async with httpx.AsyncClient(timeout=10) as http:

        async def get_job() -> dict[str, Any]:
            response = await http.get(f"{gateway}/v1/jobs/{job_id}")
            response.raise_for_status()
            job: dict[str, Any] = response.json()
            return job

        async def finished() -> float:
            return finished_batches(metric_values((await http.get(trainer.metrics_url)).text))

        baseline = await finished()  # the trainer's counters are per process, not per job
        job = await get_job()
        while job.get("plan") is None and job["state"] not in TERMINAL_STATES:
            await asyncio.sleep(0.05)
            job = await get_job()
        plan = job["plan"]
        partitions = [
            TopicPartition(plan["batches_topic"], p) for p in range(plan["batches_partitions"])
        ]
        consumer = AIOKafkaConsumer(
            bootstrap_servers=stack.state.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=20,
        )
        await consumer.start()
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        reader = BatchesReader(consumer)
        reading = asyncio.create_task(reader.run())
        try:
            while job["state"] not in TERMINAL_STATES:
                if reading.done():  # an error; expected only once the job ended (topic gone)
                    job = await get_job()
                    if job["state"] in TERMINAL_STATES:
                        break
                    raise AssertionError(f"the batches reader stopped: {reading.exception()!r}")
                # Ids seen first, the trainer's count second: the difference can only
                # underestimate the backlog at the moment the ids were counted.
                unique = len(reader.ids)
                unfinished = unique - (await finished() - baseline)
                job = await get_job()
                reported = unique - int(job["progress"]["batches_consumed"])
                samples.append(Backlog(unique, unfinished, reported))
                await asyncio.sleep(SAMPLE_EVERY_S)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await consumer.stop()
    return samples, reader.records


def test_backlog_stays_within_the_lead_of_a_slow_trainer(stack: RunningStack) -> None:
    """Bound, from the sharder's rule (flow.py): task k is released only while
    ``batches_before(k) - C_s < LEAD``, with C_s the consumed count of the latest progress
    report the sharder has read. Reports lag the trainer, so C_s <= C(t), the batches the
    trainer has finished at any later time t, and a task adds at most SHARD_BATCHES: the
    distinct batches ever produced exceed C(t) by at most ``LEAD - 1 + SHARD_BATCHES``.
    The test counts distinct ids (a redelivered task's duplicates do not count) and reads
    C(t) from the trainer's /metrics right after, so no slack for report latency is needed.
    The gateway-based figure (unique minus the last reported count, which lags by up to one
    report) is in the failure message for comparison."""
    spec = digits_spec(
        "flow-control", flow={"max_lead_batches": LEAD, "shard_size": SHARD_BATCHES * MICRO}
    )
    job_id = stack.submit(spec)
    samples, records = asyncio.run(sample_backlog(stack, job_id))
    job = stack.wait_job(job_id)
    assert job["state"] == "completed", job.get("reason")

    plan = job["plan"]
    total = (plan["train_batches_per_epoch"] + plan["eval_batches_per_epoch"]) * 2
    assert len(samples) >= 10, samples
    assert max(sample.unique for sample in samples) <= total <= records
    bound = LEAD - 1 + SHARD_BATCHES
    worst = max(sample.unfinished for sample in samples)
    detail = f"bound {bound}, samples {[(s.unfinished, s.reported) for s in samples]}"
    assert worst <= bound, detail
    # The preprocessors ran ahead of the trainer, so the bound was really put to the test.
    assert worst >= LEAD // 2, detail
    # The simulated slow accelerator is in effect (it counts as compute time).
    trainer = stack.metrics(stack.service("trainer"))
    compute_s = metric_sum(trainer, "conveyor_trainer_compute_seconds_sum")
    computed = metric_sum(trainer, "conveyor_trainer_compute_seconds_count")
    assert compute_s / computed >= STEP_DELAY_S
    assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=2)
    print(detail, f"records {records}")


def shard_tasks_in_progress(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    """Shard tasks a preprocessor has taken and not finished (nor dropped) yet."""
    taken = metric_sum(metrics, "conveyor_bus_consumed_records_total", topic_kind="shards")
    finished = metric_sum(metrics, "conveyor_preprocessor_shard_seconds_count")
    dropped = metric_sum(metrics, "conveyor_preprocessor_tasks_dropped_total")
    return taken - finished - dropped


def test_preprocessor_killed_mid_shard_loses_and_repeats_nothing(stack: RunningStack) -> None:
    # 3 ms of CPU per sample: the preprocessors, not the slowed trainer, are the bottleneck, so
    # each of them always holds a shard task in progress (0.2 s of work per 64-sample shard).
    spec = digits_spec(
        "preprocessor-failover",
        preprocess={
            "normalize": {"mean": [0.5], "std": [0.5]},
            "augment": [{"name": "cpu_cost", "ms": 2.0}],
        },
        flow={"max_lead_batches": 16, "shard_size": 64},
    )
    victim, survivor = stack.service("preprocessor-1"), stack.service("preprocessor-2")
    survivor_before = metric_sum(stack.metrics(survivor), "conveyor_preprocessor_batches_total")
    job_id = stack.submit(spec)

    def mid_shard_in_epoch_0() -> dict[str, Any] | None:
        job = stack.job(job_id)
        progress, plan = job["progress"], job.get("plan") or {}
        assert job["state"] not in TERMINAL_STATES, job
        if progress["batches_consumed"] < 2:
            return None  # batches were produced and trained before the kill
        assert progress["consumed_train_batches"] < plan["train_batches_per_epoch"], (
            "epoch 0 ended before the victim was seen working on a shard"
        )
        return job if shard_tasks_in_progress(stack.metrics(victim)) >= 1 else None

    at_kill = wait_for(mid_shard_in_epoch_0, timeout_s=90, interval_s=0.02, what="mid-shard")
    stack.kill(victim.name)
    survivor_at_kill = metric_sum(stack.metrics(survivor), "conveyor_preprocessor_batches_total")

    job = stack.wait_job(job_id, timeout_s=120)
    assert job["state"] == "completed", job.get("reason")
    assert job["summary"]["samples"] == job["plan"]["num_train"] * 2
    assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=2)
    # The survivor took over the victim's shard partitions and produced the rest of the job.
    survivor_after = metric_sum(stack.metrics(survivor), "conveyor_preprocessor_batches_total")
    assert survivor_after > survivor_at_kill
    assert stack.alive() == {**{s.name: True for s in stack.state.services}, victim.name: False}
    before, after = survivor_at_kill - survivor_before, survivor_after - survivor_at_kill
    print(f"killed {victim.name} at {at_kill['progress']}; survivor batches {before} + {after}")


def test_aggregator_killed_mid_job_hands_its_slice_over_and_the_job_completes(
    stack: RunningStack,
) -> None:
    # Two slices over two aggregator processes: each owns one partition of the job's grads
    # topic. Killing one moves its slice (a consumer-group rebalance) to the survivor, which
    # rebuilds it exactly (the latest checkpoint, then the log after it: optimizer state
    # included) and closes the remaining steps.
    spec = digits_spec("aggregator-failover", distribution={"aggregator_shards": 2})
    job_id = stack.submit(spec)
    victim, survivor = stack.service("aggregator-1"), stack.service("aggregator-2")

    def some_steps_applied() -> dict[str, Any] | None:
        job = stack.job(job_id)
        assert job["state"] not in TERMINAL_STATES, job
        return job if job["progress"]["step"] >= 5 else None

    at_kill = wait_for(some_steps_applied, timeout_s=90, interval_s=0.05, what="5 steps")
    stack.kill(victim.name)
    victim_log = Path(victim.process.log_path).read_text()
    assert re.search(rf"job {job_id}: serving slice \d+ from version", victim_log), (
        "the victim held no slice of the job: the kill would prove nothing"
    )

    job = stack.wait_job(job_id, timeout_s=150)
    assert job["state"] == "completed", job.get("reason")
    assert job["summary"]["steps"] > at_kill["progress"]["step"]
    assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=2)
    assert job["summary"]["eval_accuracy"] > 0.7
    log = Path(survivor.process.log_path).read_text()
    moved = re.findall(rf"job {job_id}: slice \d+ restored at .*\(optimizer state (\w+)\)", log)
    assert moved and set(moved) == {"exact"}, f"the moved slice was not rebuilt exactly: {moved}"
    served = {int(i) for i in re.findall(rf"job {job_id}: serving slice (\d+) from version", log)}
    assert served == {0, 1}, f"the survivor served slices {served}"
