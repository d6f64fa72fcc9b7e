"""Trainers through the gradient plane, against the real broker, with the real services.

A digits job (2 epochs) runs through the real sharder, a preprocessor, two aggregators (K = 2
slices) and two trainers: it must complete with a good accuracy and an exactly-once ledger
(written by the coordinator from the sample ids the trainers computed on), also when one
trainer process is killed (SIGKILL) in the middle of a local-mode window, and a slowed trainer
must get fewer batches than a fast one (throughput-weighted routing). A trainer that runs a
micro-batch twice must fail the exactly-once check.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import BatchComputedTwice
from job_events import job_event
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from plane_harness import (
    MEMBER_TIMEOUT_S,
    Jobs,
    assert_exactly_once,
    follow,
    job_log,
    pipeline,
    submit,
    trainer,
)
from serving import running

from conveyor.platform.bus import Producer, TopicTail, ensure_topics
from conveyor.platform.bus.tracing import destination_template
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import Heartbeat, StepClose, Topics
from conveyor.services.trainer.reporting.figures import STEP_PARTS

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
SPEC: dict[str, Any] = {
    "name": "digits-trainers",
    "model": {"name": "small_cnn", "channels": [16, 32, 64]},
    "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.2},
    "preprocess": {"normalize": {"mean": [0.5], "std": [0.5]}},
    "training": {
        "epochs": 2, "global_batch_size": 64, "micro_batch_size": 32, "seed": 0,
        "optimizer": {"name": "adam", "lr": 0.006},
    },
    "distribution": {"trainers": 2, "aggregator_shards": 2, "mode": "sync"},
    # One compute thread: this process also runs the broker clients and the other services.
    "resources": {"device": "cpu", "threads": 1},
    "flow": {"max_lead_batches": 24, "shard_size": 64},
}  # fmt: skip
ONE_TRAINER = {**SPEC["distribution"], "trainers": 1}
"""For a job of one trainer: the scheduler starts a job once the pool has what it asks."""


@pytest.fixture
def kafka(kafka_settings: KafkaSettings) -> KafkaSettings:
    """Short sessions: Tansu completes the join of a group after half of it, and a killed
    trainer's partitions move to the survivor after it."""
    return kafka_settings.model_copy(update={"session_timeout_s": 3.0})


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()  # the job's resources.threads is process-wide
    yield
    torch.set_num_threads(threads)


def assert_completed(jobs: Jobs, job_id: str, objects: Path) -> dict[str, Any]:
    summary: dict[str, Any] = jobs.of("completed", job_id)[0]["summary"]
    assert summary["epochs"] == 2 and summary["eval_accuracy"] > 0.85, summary
    assert [e["epoch"] for e in jobs.of("epoch_completed", job_id)] == [0, 1]
    assert (objects / f"jobs/{job_id}/model.safetensors").is_file()
    assert_exactly_once(objects, job_id, SPEC)
    # Trainers report their own figures, never the flow-control count (the coordinator's).
    trained = [p for p in jobs.of("progress", job_id) if p.get("worker_id", "").startswith("t-")]
    assert trained and all("consumed_batches" not in p for p in trained)
    assert not [e for e in jobs.of("completed", job_id) if e.get("worker_id", "").startswith("t-")]
    return summary


async def test_two_trainers_train_a_digits_job_through_two_aggregators(
    kafka: KafkaSettings, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    objects, job_id = tmp_path / "objects", "digits2t"
    async with job_log(kafka) as (topics, jobs), pipeline(kafka, objects):
        async with running(trainer(kafka, "t-a")), running(trainer(kafka, "t-b")):
            await submit(kafka, topics, job_id, SPEC)
            await jobs.wait_for(lambda: jobs.of("planned", job_id))
            control: list[Any] = []  # read while the job runs: its topics go when it ends
            following = asyncio.create_task(follow(kafka, topics.control(job_id), control))
            await jobs.wait_for(lambda: jobs.of("completed", job_id))
            following.cancel()
        beats = [m for m in control if isinstance(m, Heartbeat)]

    assert_completed(jobs, job_id, objects)
    for name in ("t-a", "t-b"):
        mine = [p for p in jobs.of("progress", job_id, worker_id=name)]
        assert mine[-1]["samples_trained"] > 0  # both trained
        assert set(mine[-1]["stage_latency_s"]) == {"read", "augment", "queue", "h2d", "compute"}
    assert {"t-a", "t-b"} <= {b.worker_id for b in beats}
    for name in ("t-a", "t-b"):
        infos = [b.state for b in beats if b.worker_id == name and not b.leaving]
        assert max(info.samples_per_second for info in infos) > 0  # what allocation uses
        assert all(set(info.step_time_s) == set(STEP_PARTS) for info in infos)
        # A beat sent during the first step has no step times yet (all zero); every later one
        # averages sent steps, each with compute and a gradient send.
        stepped = [info.step_time_s for info in infos if any(info.step_time_s.values())]
        assert stepped, f"no heartbeat of {name} reported a step"
        assert all(times["compute"] > 0 and times["grad_send"] > 0 for times in stepped)
        assert not any(info.gpu for info in infos)  # no GPU here: no GPU fields
    assert_grad_send_spans(spans, topics.batches(job_id))


def assert_grad_send_spans(spans: InMemorySpanExporter, batches_topic: str) -> None:
    """Each trained batch: ``process <topic template>`` with a ``compute`` child; the
    ``grad send`` span of its contribution (a fan-in) is the child of one of its batches and
    links to the others; its slices are its children."""
    finished = spans.get_finished_spans()
    template = destination_template(batches_topic)
    processed = {
        s.context.span_id: s
        for s in finished
        if s.name == f"process {template}" and s.context is not None
    }
    assert processed and all(
        s.attributes is not None and s.attributes["messaging.destination.name"] == batches_topic
        for s in processed.values()
    )
    sends = [s for s in finished if s.name == "grad send"]
    assert sends and all(s.parent and s.parent.span_id in processed for s in sends)
    assert all(link.context.span_id in processed for s in sends for link in s.links)
    inputs = {link.context.span_id for s in sends for link in s.links}
    inputs |= {s.parent.span_id for s in sends if s.parent}
    computed = {s.parent.span_id for s in finished if s.name == "compute" and s.parent is not None}
    assert inputs <= computed
    send_ids = {s.context.span_id for s in sends if s.context is not None}
    slice_sends = [s for s in finished if s.name.startswith("send ") and "grads" in s.name]
    assert slice_sends and all(s.parent is not None and s.parent.span_id in send_ids
                               for s in slice_sends)  # fmt: skip


async def test_a_slow_trainer_gets_fewer_batches_and_a_fast_one_more(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """Throughput-weighted routing: one of two trainers is ~10x slower per micro-batch. The
    coordinator allocates 3 + 1 micro-batches per step (each takes at least one) and routes
    the batches so that each trainer *receives* its share; the fast one trains ~3x the
    samples (without routing, each would own half of every epoch's batches)."""
    objects, job_id = tmp_path / "objects", "digitsrouted"
    spec = {
        **SPEC,
        # 4 micro-batches per step; 90 train batches per epoch.
        "training": {**SPEC["training"], "global_batch_size": 64, "micro_batch_size": 16},
        "flow": {"max_lead_batches": 16, "shard_size": 32},
    }
    async with (
        job_log(kafka) as (topics, jobs),
        pipeline(kafka, objects),
        running(trainer(kafka, "t-fast")),
        running(trainer(kafka, "t-slow", simulated_step_delay_s=0.04)),
    ):
        await submit(kafka, topics, job_id, spec)
        await jobs.wait_for(lambda: jobs.of("planned", job_id))
        control: list[Any] = []  # read while the job runs: its topics go when it ends
        following = asyncio.create_task(follow(kafka, topics.control(job_id), control))
        await jobs.wait_for(lambda: jobs.of("completed", job_id))
        following.cancel()

    assert_completed(jobs, job_id, objects)  # exactly-once ledger, accuracy, both epochs
    trained = {
        name: jobs.of("progress", job_id, worker_id=name)[-1]["samples_trained"]
        for name in ("t-fast", "t-slow")
    }
    assert trained["t-slow"] > 0 and trained["t-fast"] >= 1.8 * trained["t-slow"], trained
    closes = [m for m in control if isinstance(m, StepClose)]
    assert {"t-fast": 3, "t-slow": 1} in [c.allocation for c in closes]
    # The routing the coordinator published: 4 partitions, the fast one's weighted 3:1.
    owned: dict[str, list[int]] = {}
    for name in ("t-fast", "t-slow"):
        beats = [b for b in control if isinstance(b, Heartbeat) and b.worker_id == name]
        reported: list[list[int]] = [b.state.batches_partitions for b in beats]
        owned[name] = max(reported, key=reported.count)  # what it held most of the job
    assert sorted(owned["t-fast"] + owned["t-slow"]) == [0, 1, 2, 3]
    # Empty routing = unweighted (reports before any trainer's rate is known).
    routings = [p["routing"] for p in jobs.of("progress", job_id, worker_id="coordinator")
                if p["routing"]]  # fmt: skip
    assert routings and all(len(r) == 4 and sum(r) == pytest.approx(1.0) for r in routings)
    usual = max(routings, key=routings.count)  # before throughputs are known: equal
    assert sum(usual[p] for p in owned["t-fast"]) == pytest.approx(0.75), routings


def trainer_process(kafka: KafkaSettings, name: str, delay_s: float) -> subprocess.Popen[bytes]:
    """A trainer in its own process, so that it can be killed for real."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "CONVEYOR_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "CONVEYOR_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "CONVEYOR_KAFKA_SESSION_TIMEOUT_S": str(kafka.session_timeout_s),
        "CONVEYOR_TRAINER_WORKER_ID": name,
        "CONVEYOR_TRAINER_HEARTBEAT_INTERVAL_S": "0.5",
        "CONVEYOR_TRAINER_PROGRESS_INTERVAL_S": "0.2",
        "CONVEYOR_TRAINER_MEMBER_TIMEOUT_S": str(MEMBER_TIMEOUT_S),
        "CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S": str(delay_s),
    }
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor", "service", "trainer"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


LOCAL_WINDOW = 8
LOCAL_SPEC: dict[str, Any] = {
    **SPEC,
    "distribution": {**SPEC["distribution"], "mode": "local", "sync_every_steps": LOCAL_WINDOW},
}
"""SPEC in local mode (DiLoCo-style: Adam inner steps, the default outer Nesterov step). A
sync trainer killed mid-job is the end-to-end test's (tests/e2e/test_e2e_pipeline.py)."""


async def test_a_trainer_killed_mid_window_loses_nothing_and_counts_nothing_twice(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    objects, job_id = tmp_path / "objects", "digitskill"
    # The victim trains alone first, slowed down (the simulation knob) so that its window of
    # 8 inner steps is still running when the second trainer has joined and it is killed.
    # The job is elastic (it runs with one trainer and grows to two).
    # The next window's first steps overlap the round trip (departure 37): the carried steps
    # of a window the kill cut off must be lost and redone like the rest of it.
    distribution = {**LOCAL_SPEC["distribution"], "min_trainers": 1, "overlap_steps": 2}
    spec = {**LOCAL_SPEC, "distribution": distribution}
    victim = trainer_process(kafka, "t-victim", delay_s=0.1)
    try:
        async with job_log(kafka) as (topics, jobs), pipeline(kafka, objects):
            await submit(kafka, topics, job_id, spec)

            def trained(name: str) -> bool:
                mine = jobs.of("progress", job_id, worker_id=name)
                return bool(mine) and mine[-1]["samples_trained"] > 0

            await jobs.wait_for(lambda: trained("t-victim"))
            async with running(trainer(kafka, "t-a")):
                await jobs.wait_for(lambda: trained("t-a"))
                victim.send_signal(signal.SIGKILL)  # no goodbye, nothing flushed
                victim.wait(10)
                coordinator = jobs.of("progress", job_id, worker_id="coordinator")
                # Training is still on, and the victim spends most of it inside a window
                # (8 inner steps of its slowed compute, >= 0.8 s, then a round trip).
                assert coordinator and coordinator[-1]["consumed_train_batches"] < 2 * 45
                await jobs.wait_for(lambda: jobs.of("completed", job_id))
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)

    summary = assert_completed(jobs, job_id, objects)  # accuracy, epochs, the ledger
    # Windows, not steps: sync takes at least 2 x 23 steps of 2 of the 45 micro-batches an
    # epoch; a window of both trainers takes up to 16 (shorter when a trainer runs dry).
    assert math.ceil(2 * 45 / 16) <= summary["steps"] < 23, summary


async def test_a_batch_computed_twice_fails_the_exactly_once_check(
    kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger counts what the trainers computed on, not what the plan says their batches
    hold: a trainer that runs one micro-batch twice into a contribution, and says so (its
    batch id once, its sample ids twice), passes every batch-id check of the coordinator; the
    ledger check of the finished job names the samples counted twice."""
    objects, job_id = tmp_path / "objects", "digitstwice"
    spec = {**SPEC, "training": {**SPEC["training"], "epochs": 1}, "distribution": ONE_TRAINER}
    fault = BatchComputedTwice("t-twice")
    fault.install(monkeypatch)
    async with (
        job_log(kafka) as (topics, jobs),
        pipeline(kafka, objects),
        running(trainer(kafka, "t-twice")),
    ):
        await submit(kafka, topics, job_id, spec)
        await jobs.wait_for(lambda: jobs.of("completed", job_id))

    assert fault.batch_id is not None and len(fault.sample_ids) == 32
    # Every batch was applied once; the step with the fault summed one micro-batch more.
    (planned,) = jobs.of("planned", job_id)
    assert jobs.of("completed", job_id)[0]["summary"]["samples"] == planned["num_train"] + 32
    with pytest.raises(AssertionError) as failed:
        assert_exactly_once(objects, job_id, spec)
    repeated = {sample: 2 for sample in sorted(fault.sample_ids)}
    assert str(failed.value).startswith(f"epoch 0: samples trained more than once: {repeated}")


async def publish(
    kafka: KafkaSettings, topics: Topics, job_id: str, event: str, **data: Any
) -> None:
    async with Producer(kafka) as producer:
        message = job_event(job_id, event, **data)
        await producer.publish(topics.jobs, message, key=job_id)


async def plan_by_hand(
    kafka: KafkaSettings, topics: Topics, job_id: str, spec: dict[str, Any]
) -> None:
    """What the sharder does before training starts: topics, ``submitted``, ``planned``."""
    await ensure_topics(kafka, topics.job_topic_specs(job_id, batches_partitions=2, slices=2))
    planned = {
        "num_train": 1438, "num_eval": 359, "num_classes": 10, "sample_shape": [1, 8, 8],
        "train_batches_per_epoch": 45, "eval_batches_per_epoch": 12, "steps_per_epoch": 12,
        "batches_topic": topics.batches(job_id), "control_topic": topics.control(job_id),
        "batches_partitions": 2,
    }  # fmt: skip
    await publish(kafka, topics, job_id, "submitted", spec=spec, idempotency_key=None)
    await publish(kafka, topics, job_id, "planned", **planned)


async def test_an_unbuildable_job_fails_and_a_cancelled_job_is_left(kafka: KafkaSettings) -> None:
    service = trainer(kafka, "t-a")
    async with job_log(kafka) as (topics, jobs), running(service):
        alone = {**SPEC, "distribution": ONE_TRAINER}  # the pool is this one trainer
        # BatchNorm statistics cannot travel with fp16 gradients
        unbuildable = {
            **alone,
            "model": {"name": "resnet18", "width": 8, "norm": "batch"},
            "distribution": {**ONE_TRAINER, "compression": {"kind": "fp16"}},
        }
        await plan_by_hand(kafka, topics, "badjob", unbuildable)
        await jobs.wait_for(lambda: jobs.of("failed", "badjob"))
        assert "uncompressed" in jobs.of("failed", "badjob")[0]["reason"]

        await plan_by_hand(kafka, topics, "canceljob", alone)
        await jobs.wait_for(lambda: jobs.of("running", "canceljob"))
        assert service.current_job == "canceljob"  # waiting for version 0: no aggregator here
        await publish(kafka, topics, "canceljob", "cancel_requested", reason="test")
        await jobs.wait_for(lambda: jobs.of("cancelled", "canceljob"))
        assert jobs.of("cancelled", "canceljob")[0]["reason"] == "cancel requested"
        assert service.current_job is None  # idle again, waiting for the next job
        beats: list[Any] = []
        await asyncio.wait_for(
            follow_until_caught_up(kafka, topics.control("canceljob"), beats), 10
        )
        assert beats and beats[-1].leaving is True  # left the job's membership


async def follow_until_caught_up(kafka: KafkaSettings, topic: str, into: list[Any]) -> None:
    async with TopicTail(kafka, topic) as tail:
        while not tail.caught_up:
            into += [r.message for r in await tail.get_many(0.5)]
