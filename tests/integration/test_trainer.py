"""The trainer against the real broker and a file object store.

The test plays the sharder and the preprocessors: it publishes ``submitted`` and ``planned``,
then releases the digits job's shards in the release order with flow control (a shard is
published only while the batches ahead of the trainer's reported ``consumed_batches`` stay
under the lead), turning each into batches with the preprocessor's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once

from conveyor.libs.augment import build_augmenter
from conveyor.libs.bus import Producer, TopicSpec, ensure_topics
from conveyor.libs.codec import decode
from conveyor.libs.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.libs.datasets import open_dataset
from conveyor.libs.jobspec import JobSpec
from conveyor.libs.jobview import JobLogReader, JobsView, JobView
from conveyor.libs.messages import Heartbeat, JobEvent, ShardTask, Topics, shard_id_for
from conveyor.services.preprocessor.work import process_shard
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.service import TrainerService

pytestmark = pytest.mark.timeout(180)

JOB_ID = "digitsjob1"
MICRO = 32
SHARD_SIZE = 64  # two micro-batches per shard
LEAD = 16
SPEC = JobSpec.from_dict(
    {
        "name": "digits-trainer-test",
        "model": {"name": "small_cnn", "channels": [16, 32, 64]},
        "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.2},
        "preprocess": {"normalize": {"mean": [0.5], "std": [0.5]}},
        "training": {
            "epochs": 2,
            "global_batch_size": 2 * MICRO,
            "micro_batch_size": MICRO,
            "optimizer": {"name": "adam", "lr": 0.004},
            "seed": 0,
        },
        "checkpoint": {"every_steps": 3},
        # One compute thread: the test process also runs the broker clients and the feeder.
        "resources": {"device": "cpu", "threads": 1},
        "flow": {"max_lead_batches": LEAD, "shard_size": SHARD_SIZE},
    }
)


@dataclass
class Plan:
    """A digits job's release sequence, as the sharder cuts it."""

    job_id: str
    train_ids: np.ndarray
    eval_ids: np.ndarray
    tasks: list[ShardTask] = field(default_factory=list)

    @classmethod
    def make(cls, job_id: str = JOB_ID) -> Plan:
        seed = SPEC.training.seed
        num_samples = open_dataset(SPEC.dataset.uri).num_samples
        permutation = np.random.default_rng(seed).permutation(num_samples)
        num_eval = int(num_samples * SPEC.dataset.eval_fraction)
        plan = cls(job_id, np.sort(permutation[num_eval:]), np.sort(permutation[:num_eval]))
        for epoch in range(SPEC.training.epochs):
            order = plan.train_ids[
                np.random.default_rng([seed, epoch]).permutation(plan.train_ids.size)
            ]
            for split, ids in (("train", order), ("eval", plan.eval_ids)):
                for index, start in enumerate(range(0, ids.size, SHARD_SIZE)):
                    plan.tasks.append(
                        ShardTask(
                            job_id=job_id,
                            shard_id=shard_id_for(job_id, epoch, split, index),
                            epoch=epoch,
                            index=index,
                            split=split,
                            dataset_uri=SPEC.dataset.uri,
                            sample_ids=ids[start : start + SHARD_SIZE].tolist(),
                            micro_batch_size=MICRO,
                            seed=seed,
                            preprocess={},
                        )
                    )
        return plan

    def batches(self, split: str) -> int:
        """Batches of ``split`` per epoch."""
        return sum(
            -(-len(t.sample_ids) // MICRO) for t in self.tasks if t.split == split and t.epoch == 0
        )

    def planned_data(self, topics: Topics) -> dict[str, Any]:
        train, evals = self.batches("train"), self.batches("eval")
        return {
            "num_train": int(self.train_ids.size),
            "num_eval": int(self.eval_ids.size),
            "num_classes": 10,
            "sample_shape": [1, 8, 8],
            "train_batches_per_epoch": train,
            "eval_batches_per_epoch": evals,
            "steps_per_epoch": -(-train // 2),
            "batches_topic": topics.batches(self.job_id),
            "control_topic": topics.control(self.job_id),
            "batches_partitions": 2,
        }


class Jobs:
    """The jobs topic as the test sees it: the folded view plus every event of the job."""

    def __init__(self, kafka: KafkaSettings, topic: str) -> None:
        self.events: list[JobEvent] = []
        self.changed = asyncio.Event()
        self.reader = JobLogReader(
            kafka, topic, JobsView(), service="trainer_test", on_applied=self._on_applied
        )

    def _on_applied(self, job: JobView, event: JobEvent) -> None:
        self.events.append(event)
        self.changed.set()

    def of(self, name: str, job_id: str = JOB_ID) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.event == name and e.job_id == job_id]

    def consumed(self, job_id: str = JOB_ID) -> int:
        progress = self.of("progress", job_id)
        return int(progress[-1]["consumed_batches"]) if progress else 0

    async def wait_for(self, predicate: Any, timeout_s: float = 90.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


async def feed(
    kafka: KafkaSettings,
    topics: Topics,
    plan: Plan,
    jobs: Jobs,
    duplicate_tasks: frozenset[int] = frozenset(),
    pause_at: int | None = None,
    resume: asyncio.Event | None = None,
) -> None:
    """Release the shards with flow control; the tasks in ``duplicate_tasks`` go out twice.
    Once ``pause_at`` batches are out, wait for ``resume`` before releasing more."""
    dataset = open_dataset(SPEC.dataset.uri)
    augmenter = build_augmenter([])
    released = 0
    async with Producer(kafka) as producer:
        for k, task in enumerate(plan.tasks):
            await jobs.wait_for(lambda ahead=released: ahead - jobs.consumed(plan.job_id) < LEAD)
            if pause_at is not None and released >= pause_at and resume is not None:
                await resume.wait()
            batches = await asyncio.to_thread(process_shard, dataset, task, augmenter)
            for _ in range(2 if k in duplicate_tasks else 1):
                for batch in batches:
                    batch.timestamps["sent"] = time.time()
                    await producer.publish(topics.batches(plan.job_id), batch, key=batch.batch_id)
            released += len(batches)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """A global SDK tracer provider for this test (OpenTelemetry allows one per process)."""
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@pytest.fixture
def kafka(kafka_settings: KafkaSettings) -> KafkaSettings:
    """The test's settings with a short session timeout: Tansu completes the join of a new
    group after half of it, and every trainer start joins the job's group."""
    return kafka_settings.model_copy(update={"session_timeout_s": 3.0})


@asynccontextmanager
async def trainer(kafka: KafkaSettings, objects: str, name: str) -> AsyncIterator[TrainerService]:
    service = TrainerService(
        settings=TrainerSettings(
            worker_id=name, progress_interval_s=0.2, heartbeat_interval_s=0.5, drain_timeout_s=30
        ),
        kafka=kafka,
        storage=StorageSettings(uri=objects),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )
    threads = torch.get_num_threads()  # the job's resources.threads is process-wide
    serving = asyncio.create_task(service.serve())
    try:
        yield service
    finally:
        service.request_stop()
        assert await asyncio.wait_for(serving, 60) == 0
        torch.set_num_threads(threads)


async def publish(
    kafka: KafkaSettings, topics: Topics, job_id: str, *events: tuple[str, dict[str, Any]]
) -> None:
    async with Producer(kafka) as producer:
        for event, data in events:
            message = JobEvent(job_id=job_id, event=event, at=time.time(), data=data)
            await producer.publish(topics.jobs, message, key=job_id)


async def submit(kafka: KafkaSettings, topics: Topics, plan: Plan, spec: dict[str, Any]) -> None:
    """Create the job's topics, then publish its submitted and planned events."""
    await ensure_topics(
        kafka,
        [
            TopicSpec(topics.batches(plan.job_id), partitions=2),
            TopicSpec(topics.control(plan.job_id)),
        ],
    )
    await publish(
        kafka,
        topics,
        plan.job_id,
        ("submitted", {"spec": spec, "idempotency_key": None}),
        ("planned", plan.planned_data(topics)),
    )


@asynccontextmanager
async def job_log(kafka: KafkaSettings) -> AsyncIterator[tuple[Topics, Jobs]]:
    topics = Topics(kafka.topic_prefix)
    await ensure_topics(kafka, [TopicSpec(topics.jobs, partitions=2)])
    jobs = Jobs(kafka, topics.jobs)
    await jobs.reader.start()
    reading = asyncio.create_task(jobs.reader.run())
    try:
        yield topics, jobs
    finally:
        reading.cancel()
        await jobs.reader.stop()


@asynccontextmanager
async def job_setup(kafka: KafkaSettings) -> AsyncIterator[tuple[Topics, Plan, Jobs]]:
    async with job_log(kafka) as (topics, jobs):
        plan = Plan.make()
        await submit(kafka, topics, plan, SPEC.to_dict())
        yield topics, plan, jobs


def assert_exactly_once(objects: Path, plan: Plan) -> None:
    ledger = json.loads((objects / f"jobs/{JOB_ID}/ledger.json").read_text())["epochs"]
    expected = {str(i): 1 for i in plan.train_ids.tolist()}
    assert sorted(ledger) == ["0", "1"]
    for epoch in ("0", "1"):
        assert ledger[epoch] == expected, f"epoch {epoch}: a sample is missing or counted twice"


async def test_trains_a_digits_job_exactly_once_despite_duplicates(
    kafka: KafkaSettings, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    objects = tmp_path / "objects"
    async with (
        job_setup(kafka) as (topics, plan, jobs),
        trainer(kafka, f"file://{objects}", "trainer-a"),
    ):
        # Tasks 3 (train, epoch 0), 24 (eval, epoch 0) and 30 (train, epoch 1) go out twice.
        await feed(kafka, topics, plan, jobs, duplicate_tasks=frozenset({3, 24, 30}))
        await jobs.wait_for(lambda: jobs.of("completed"))
        heartbeats = await read_heartbeats(kafka, topics.control(JOB_ID))

    summary = jobs.of("completed")[0]["summary"]
    train_batches = plan.batches("train")
    assert summary["state"] == "completed" and summary["epochs"] == 2
    assert summary["steps"] == 2 * -(-train_batches // 2)
    assert summary["samples"] == 2 * plan.train_ids.size
    assert summary["eval_accuracy"] > 0.8
    assert summary["checkpoint"] == f"file://{objects}/jobs/{JOB_ID}/model.safetensors"
    assert (objects / f"jobs/{JOB_ID}/config.json").is_file()
    assert 0.0 <= summary["data_wait_ratio"] < 1.0
    assert_exactly_once(objects, plan)

    epochs = jobs.of("epoch_completed")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert all(e["eval_accuracy"] is not None for e in epochs)
    progress = jobs.of("progress")
    last = progress[-1]
    assert last["consumed_batches"] == 2 * (train_batches + plan.batches("eval"))
    assert last["consumed_train_batches"] == 2 * train_batches
    assert last["duplicates"] == 2 + 2 + 2  # two batches per duplicated shard
    assert set(last["stage_latency_s"]) == {"read", "augment", "queue", "h2d", "compute"}
    assert jobs.of("running") == [{"worker_id": "trainer-a"}]
    assert heartbeats and heartbeats[0].role == "trainer" and "step_time_s" in heartbeats[0].info
    assert "gpu" not in heartbeats[0].info  # no GPU here: no GPU fields
    assert_batch_traces(spans.get_finished_spans(), topics.batches(JOB_ID))


def assert_batch_traces(finished: Sequence[ReadableSpan], topic: str) -> None:
    """Each batch: ``process <topic>`` (child of the sender's ``send <topic>``) with ``h2d``
    and ``compute`` children; each step links to the process spans of its batches."""
    by_id = {span.context.span_id: span for span in finished if span.context is not None}
    processed = [s for s in finished if s.name == f"process {topic}"]
    done = [s for s in processed if s.attributes and "conveyor.outcome" not in s.attributes]
    assert len(done) == 2 * (45 + 12)  # train and eval batches of two epochs
    for span in done:
        assert span.kind is SpanKind.CONSUMER and span.parent is not None
        assert by_id[span.parent.span_id].name == f"send {topic}"  # continues the batch's trace
    children: dict[int, set[str]] = {}
    for span in finished:
        if span.parent is not None and span.name in ("h2d", "compute"):
            children.setdefault(span.parent.span_id, set()).add(span.name)
    assert all(children.get(span.context.span_id) == {"h2d", "compute"} for span in done)
    steps = [s for s in finished if s.name == "step"]
    assert len(steps) == 46 and sum(len(s.links) for s in steps) == 2 * 45
    assert {link.context.span_id for s in steps for link in s.links} <= set(by_id)


async def test_a_restarted_trainer_resumes_from_its_checkpoint_exactly_once(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    objects = tmp_path / "objects"
    latest = objects / f"jobs/{JOB_ID}/trainer/latest"

    def checkpointed_step() -> int:
        return int(json.loads(latest.read_text())["step"]) if latest.exists() else 0

    async with job_setup(kafka) as (topics, plan, jobs):
        # 16 batches = 8 steps: durable at step 6 (every 3 steps), steps 7-8 only in memory.
        resume = asyncio.Event()
        feeding = asyncio.create_task(feed(kafka, topics, plan, jobs, pause_at=16, resume=resume))
        async with trainer(kafka, f"file://{objects}", "trainer-a"):
            await jobs.wait_for(lambda: jobs.consumed() == 16 and checkpointed_step() == 6)
        assert checkpointed_step() == 6 and not jobs.of("completed")
        resume.set()
        async with trainer(kafka, f"file://{objects}", "trainer-b") as second:
            await jobs.wait_for(lambda: jobs.of("completed"))
            await feeding
            assert second.last_summary == jobs.of("completed")[0]["summary"]

    resumed = [
        e.data for e in jobs.events if e.event == "progress" and e.data["worker_id"] == "trainer-b"
    ]
    assert resumed and resumed[0]["step"] >= 6  # resumed, not restarted from scratch
    summary = jobs.of("completed")[0]["summary"]
    assert summary["steps"] == 2 * -(-plan.batches("train") // 2)
    assert summary["eval_accuracy"] > 0.8
    assert_exactly_once(objects, plan)


async def read_heartbeats(kafka: KafkaSettings, topic: str) -> list[Heartbeat]:
    """Every heartbeat on ``topic`` so far (group-less: nothing to join)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        end = (await consumer.end_offsets([partition]))[partition]
        records = []
        while await consumer.position(partition) < end:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records += batch
    finally:
        await consumer.stop()
    return [m for r in records if isinstance(m := decode(r.value), Heartbeat)]


async def test_an_unbuildable_job_fails_a_cancelled_job_is_left_and_max_steps_ends_a_job(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with (
        job_log(kafka) as (topics, jobs),
        trainer(kafka, f"file://{tmp_path}/objects", "trainer-a") as service,
    ):
        bad_spec = SPEC.to_dict()
        bad_spec["model"] = {"name": "small_cnn", "depth": 3}  # not an option of small_cnn
        await submit(kafka, topics, Plan.make("badjob"), bad_spec)
        await jobs.wait_for(lambda: jobs.of("failed", "badjob"))
        assert "unknown option(s) ['depth']" in jobs.of("failed", "badjob")[0]["reason"]

        await submit(kafka, topics, Plan.make("canceljob"), SPEC.to_dict())
        await jobs.wait_for(lambda: jobs.of("running", "canceljob"))
        await publish(kafka, topics, "canceljob", ("cancel_requested", {"reason": "test"}))
        await jobs.wait_for(lambda: jobs.of("cancelled", "canceljob"))
        assert jobs.of("cancelled", "canceljob")[0]["reason"] == "cancel requested"
        assert service.current_job is None  # idle again, waiting for the next job
        cancelled = jobs.reader.view.get("canceljob")
        assert cancelled is not None and cancelled.state == "cancelled"

        short = SPEC.to_dict()
        short["training"]["max_steps"] = 4
        plan = Plan.make("shortjob")
        await submit(kafka, topics, plan, short)
        feeding = asyncio.create_task(feed(kafka, topics, plan, jobs))
        await jobs.wait_for(lambda: jobs.of("completed", "shortjob"))
        feeding.cancel()  # it waits for consumption that max_steps cut short
        with contextlib.suppress(asyncio.CancelledError):
            await feeding
    summary = jobs.of("completed", "shortjob")[0]["summary"]
    assert summary["steps"] == 4 and summary["samples"] == 4 * 2 * MICRO
    assert summary["epochs"] == 0 and summary["eval_accuracy"] is None  # stopped within epoch 0
    ledger = json.loads((tmp_path / "objects/jobs/shortjob/ledger.json").read_text())["epochs"]
    assert len(ledger["0"]) == 4 * 2 * MICRO and set(ledger["0"].values()) == {1}
