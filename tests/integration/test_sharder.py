"""The sharder against the real broker: plan, flow-controlled releases, failures, restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from job_events import job_event
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from serving import running

from conveyor.platform.bus import Producer, TopicAdmin
from conveyor.platform.codec import decode
from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.messages import JobEvent, Message, ShardTask, Topics
from conveyor.services.sharder.config import SharderSettings
from conveyor.services.sharder.service import SharderService
from conveyor.training.datasets import pack_npz
from conveyor.training.plan import JobPlan

DIGITS_SPEC: dict[str, Any] = {
    "name": "digits",
    "model": {"name": "small_cnn", "num_classes": 10},
    "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.2},
    "preprocess": {"augment": [{"name": "hflip"}]},
    "training": {
        "epochs": 2, "global_batch_size": 64, "micro_batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.1}, "seed": 3,
    },
    "distribution": {"aggregator_shards": 3},
    "flow": {"max_lead_batches": 5, "shard_size": 64},  # 2 batches per shard
}  # fmt: skip


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = {**DIGITS_SPEC}
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


@asynccontextmanager
async def running_sharder(
    kafka: KafkaSettings,
    topology: TopologySettings | None = None,
    storage: StorageSettings | None = None,
    **settings: Any,
) -> AsyncIterator[SharderService]:
    service = SharderService(
        # Topics go as soon as a job ends unless a test asks for the grace.
        settings=SharderSettings(**{"tick_s": 0.1, "finished_topics_grace_s": 0.0, **settings}),
        topology=topology or TopologySettings(),
        kafka=kafka,
        storage=storage or StorageSettings(uri="file://./.conveyor/objects"),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )
    async with running(service):
        yield service


class TopicReader:
    """Every record of a topic from the beginning (group-less), decoded, as it arrives."""

    def __init__(self, kafka: KafkaSettings, topic: str) -> None:
        self.topic = topic
        self.records: list[tuple[Message, dict[str, bytes]]] = []
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap, enable_auto_commit=False
        )

    async def __aenter__(self) -> TopicReader:
        await self._consumer.start()
        await self._consumer.topics()
        partitions = self._consumer.partitions_for_topic(self.topic) or set()
        assert partitions, f"{self.topic} does not exist"
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    @property
    def partitions(self) -> int:
        return len(self._consumer.assignment())

    @property
    def messages(self) -> list[Message]:
        return [message for message, _ in self.records]

    async def poll(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            batches = await self._consumer.getmany(timeout_ms=int(min(left, 0.2) * 1000))
            for records in batches.values():
                for r in records:
                    self.records.append((decode(r.value), dict(r.headers or [])))

    async def wait_for(self, predicate: Callable[[list[Message]], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.messages):
            assert time.monotonic() < deadline, f"timed out; got {self.messages}"
            await self.poll(0.2)


def events(messages: list[Message], job_id: str, name: str) -> list[JobEvent]:
    return [m for m in messages if isinstance(m, JobEvent) and m.job_id == job_id
            and name == m.EVENT]  # fmt: skip


def tasks_of(messages: list[Message], job_id: str) -> list[ShardTask]:
    """The job's shard tasks in release order (the topic's partitions interleave them)."""
    tasks = [m for m in messages if isinstance(m, ShardTask) and m.job_id == job_id]
    return sorted(tasks, key=lambda t: t.released_at)


async def publish(kafka: KafkaSettings, job_id: str, event: str, data: dict[str, Any]) -> None:
    async with Producer(kafka) as producer:
        message = job_event(job_id, event, **data)
        await producer.publish(Topics(kafka.topic_prefix).jobs, message, key=job_id)


async def topic_names(kafka: KafkaSettings) -> set[str]:
    async with TopicAdmin(kafka) as admin:
        return await admin.list_topics()


def progress(consumed: int, **extra: Any) -> dict[str, Any]:
    return {"step": 1, "consumed_batches": consumed, **extra}


async def test_creates_the_global_topics_with_the_topologys_partitions(
    kafka_settings: KafkaSettings,
) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    topology = TopologySettings(jobs_partitions=3, shards_partitions=5)
    async with running_sharder(kafka_settings, topology):
        expected = [(topics.jobs, 3), (topics.shards, 5), (topics.autoscaler, 1), (topics.dlq, 1)]
        for name, partitions in expected:
            async with TopicReader(kafka_settings, name) as topic:
                assert topic.partitions == partitions, name


async def test_plans_releases_with_flow_control_and_cancels(
    kafka_settings: KafkaSettings, spans: InMemorySpanExporter
) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    plan = JobPlan(job_id="job1", num_samples=1797, eval_fraction=0.2, seed=3, epochs=2,
                   micro_batch_size=32, shard_size=64)  # fmt: skip
    async with (
        running_sharder(kafka_settings),
        TopicReader(kafka_settings, topics.jobs) as jobs,
        TopicReader(kafka_settings, topics.shards) as shards,
    ):
        await publish(kafka_settings, "job1", "submitted", {"spec": DIGITS_SPEC})
        await jobs.wait_for(lambda m: bool(events(m, "job1", "planned")), 15)
        planned = events(jobs.messages, "job1", "planned")[0].details()
        assert planned == {
            "num_train": 1438, "num_eval": 359, "num_classes": 10, "sample_shape": [1, 8, 8],
            "train_batches_per_epoch": plan.train_batches_per_epoch,
            "eval_batches_per_epoch": plan.eval_batches_per_epoch,
            "steps_per_epoch": plan.steps_per_epoch(2),
            "shards_per_epoch": plan.tasks_per_epoch,
            "batches_topic": topics.batches("job1"), "control_topic": topics.control("job1"),
            "batches_partitions": 2,
        }  # fmt: skip
        assert {topics.batches("job1"), topics.control("job1")} <= await topic_names(kafka_settings)
        async with TopicReader(kafka_settings, topics.grads("job1")) as grads:
            assert grads.partitions == 3  # one per parameter slice
        async with TopicReader(kafka_settings, topics.params("job1")) as params:
            assert params.partitions == 3

        # Lead 5 with 2-batch shards: tasks start at 0, 2 and 4 released batches, then stop.
        await shards.wait_for(lambda m: len(tasks_of(m, "job1")) >= 3, 10)
        await shards.poll(1.0)  # ten ticks: nothing more may come
        released = tasks_of(shards.messages, "job1")
        assert [t.shard_id for t in released] == [plan.task(k).shard_id for k in range(3)]
        first = released[0]
        assert first.sample_ids == plan.task(0).sample_ids and first.micro_batch_size == 32
        assert first.dataset_uri == "builtin://sklearn-digits" and first.seed == 3
        assert first.preprocess["augment"] == [{"name": "hflip", "p": 0.5}]
        assert first.released_at > 0 and first.split == "train" and first.epoch == 0
        # No routing reported yet: the epoch's batches take the 2 partitions in turn.
        assert [t.partitions for t in released] == [[0, 1]] * 3

        # 4 consumed: tasks 3 (6 - 4 < 5) and 4 (8 - 4 < 5) may go; task 5 (10 - 4) may not.
        # They follow the coordinator's latest routing (one weight per batches partition) by
        # each batch's place in the epoch: batches 6..9 in the 3:1 cycle 0, 0, 1, 0.
        await publish(kafka_settings, "job1", "progress", progress(4, routing=[0.75, 0.25]))
        await shards.wait_for(lambda m: len(tasks_of(m, "job1")) >= 5, 10)
        await shards.poll(0.8)
        released = tasks_of(shards.messages, "job1")
        assert [t.index for t in released] == [0, 1, 2, 3, 4]
        assert [t.partitions for t in released[3:]] == [[1, 0], [0, 0]]

        await publish(kafka_settings, "job1", "cancel_requested", {"reason": "test"})
        await jobs.wait_for(lambda m: bool(events(m, "job1", "cancelled")), 10)
        deadline = time.monotonic() + 10
        while topics.batches("job1") in await topic_names(kafka_settings):
            assert time.monotonic() < deadline, "job topics not deleted"
            await asyncio.sleep(0.1)
        await publish(kafka_settings, "job1", "progress", progress(100))
        await shards.poll(0.8)
        assert len(tasks_of(shards.messages, "job1")) == 5  # nothing after the cancel

    # Planning continues the submitter's trace; each release starts a trace linked to the plan.
    finished = {s.name: s for s in spans.get_finished_spans()}
    plan_span, process = finished["plan job"], finished[f"process {topics.jobs}"]
    assert plan_span.parent is not None and process.context is not None
    assert plan_span.parent.span_id == process.context.span_id
    sends = [s for s in spans.get_finished_spans() if s.name == f"send {topics.jobs}"]
    submitted = min(sends, key=lambda s: s.start_time or 0)  # the test's submitted event
    assert process.context.trace_id == submitted.context.trace_id
    releases = [s for s in spans.get_finished_spans() if s.name == "release shard"]
    assert len(releases) == 5 and all(s.parent is None for s in releases)
    assert all(s.links[0].context.span_id == plan_span.context.span_id for s in releases)
    release_traces = {f"{s.context.trace_id:032x}" for s in releases}
    headers = [h for m, h in shards.records if isinstance(m, ShardTask)]
    assert {h["traceparent"].decode().split("-")[1] for h in headers} == release_traces


async def test_a_finished_jobs_topics_stay_for_the_grace_then_go(
    kafka_settings: KafkaSettings,
) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    grace_s = 3.0
    async with (
        running_sharder(kafka_settings, finished_topics_grace_s=grace_s),
        TopicReader(kafka_settings, topics.jobs) as jobs,
    ):
        await publish(kafka_settings, "job1", "submitted", {"spec": DIGITS_SPEC})
        await jobs.wait_for(lambda m: bool(events(m, "job1", "planned")), 15)
        await publish(kafka_settings, "job1", "cancel_requested", {"reason": "test"})
        await jobs.wait_for(lambda m: bool(events(m, "job1", "cancelled")), 10)
        ended = time.monotonic()
        # The sharder's grace starts when it reads its own cancelled event back, after the
        # event was made (``at``): time it from there, not from when this reader, which may
        # lag the sharder's by a fetch or more on a loaded machine, saw it.
        published_at = events(jobs.messages, "job1", "cancelled")[0].at
        job_topics = set(topics.job_topics("job1"))
        assert job_topics <= await topic_names(kafka_settings)  # kept: within the grace
        deadline = ended + grace_s + 10
        while job_topics & await topic_names(kafka_settings):
            assert time.monotonic() < deadline, "job topics not deleted after the grace"
            await asyncio.sleep(0.1)
        # not before it (0.1 s for the wall clock against the sharder's monotonic one)
        assert time.time() - published_at >= grace_s - 0.1


async def test_bad_jobs_fail_and_the_next_job_is_planned(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    storage = StorageSettings(uri=f"file://{tmp_path}/objects", dataset_roots=(str(tmp_path),))
    async with (
        running_sharder(kafka_settings, storage=storage),
        TopicReader(kafka_settings, topics.jobs) as jobs,
    ):
        bad_uri = f"npz://{tmp_path}/nonexistent-dataset"  # allowed, but not there
        await publish(kafka_settings, "bad-data", "submitted",
                      {"spec": spec_with(dataset={"uri": bad_uri})})  # fmt: skip
        await publish(kafka_settings, "bad-spec", "submitted",
                      {"spec": spec_with(training={"epochs": 0})})  # fmt: skip
        fp16_batch_norm = spec_with(model={"name": "resnet18", "width": 4},
                                    distribution={"compression": {"kind": "fp16"}})  # fmt: skip
        await publish(kafka_settings, "bad-model", "submitted", {"spec": fp16_batch_norm})
        await publish(kafka_settings, "good", "submitted", {"spec": DIGITS_SPEC})
        await jobs.wait_for(
            lambda m: bool(events(m, "good", "planned") and events(m, "bad-data", "failed")
                           and events(m, "bad-spec", "failed")
                           and events(m, "bad-model", "failed")),
            15,
        )  # fmt: skip
        model_reason = events(jobs.messages, "bad-model", "failed")[0].details()["reason"]
        assert "cannot train model 'resnet18'" in model_reason and "uncompressed" in model_reason
        data_reason = events(jobs.messages, "bad-data", "failed")[0].details()["reason"]
        assert bad_uri in data_reason and "cannot read dataset" in data_reason
        spec_reason = events(jobs.messages, "bad-spec", "failed")[0].details()["reason"]
        assert spec_reason.startswith("invalid job spec") and "epochs" in spec_reason
        assert not events(jobs.messages, "bad-data", "planned")
        names = await topic_names(kafka_settings)
        assert topics.batches("bad-data") not in names and topics.batches("good") in names
        await jobs.poll(0.5)
        assert len(events(jobs.messages, "bad-data", "failed")) == 1  # published once


async def test_restart_replans_and_continues_from_the_cursor(
    kafka_settings: KafkaSettings,
) -> None:
    # aiokafka sends no LeaveGroup from generation 0, Tansu's first: the second sharder waits
    # for the first one's session to expire, so keep it short.
    kafka_settings = kafka_settings.model_copy(
        update={"session_timeout_s": 3.0, "heartbeat_interval_s": 0.5}
    )
    topics = Topics(kafka_settings.topic_prefix)
    plan = JobPlan(job_id="job2", num_samples=1797, eval_fraction=0.2, seed=3, epochs=2,
                   micro_batch_size=32, shard_size=64)  # fmt: skip
    async with (
        running_sharder(kafka_settings),
        TopicReader(kafka_settings, topics.shards) as shards,
    ):
        await publish(kafka_settings, "job2", "submitted", {"spec": DIGITS_SPEC})
        await shards.wait_for(lambda m: len(tasks_of(m, "job2")) >= 3, 15)
        await publish(kafka_settings, "job2", "progress", progress(12))
        # Cursor 12: tasks 0..5 consumed; release while batches_before(k) - 12 < 5: 6, 7, 8.
        await shards.wait_for(lambda m: len(tasks_of(m, "job2")) >= 6, 10)
        await shards.poll(0.5)
        assert [t.index for t in tasks_of(shards.messages, "job2")] == [0, 1, 2, 6, 7, 8]
    async with (
        running_sharder(kafka_settings),
        TopicReader(kafka_settings, topics.shards) as shards,
        TopicReader(kafka_settings, topics.jobs) as jobs,
    ):
        # The new sharder replays submitted + progress and re-releases from the cursor only.
        await shards.wait_for(lambda m: len(tasks_of(m, "job2")) >= 9, 20)
        await shards.poll(0.8)
        again = [plan.first_unconsumed_task(12) + k for k in range(3)]
        assert [t.index for t in tasks_of(shards.messages, "job2")][6:] == again
        await jobs.poll(0.5)
        assert len(events(jobs.messages, "job2", "planned")) == 1  # not planned twice
        await publish(kafka_settings, "job2", "completed", {"summary": {}})
        deadline = time.monotonic() + 10
        while topics.batches("job2") in await topic_names(kafka_settings):
            assert time.monotonic() < deadline, "job topics not deleted"
            await asyncio.sleep(0.1)


@pytest.fixture
def datasets_tree(tmp_path: Path) -> Path:
    """The same 40-sample npz dataset in ``data/set`` and ``secret/set``; ``data/leak`` ->
    secret."""
    tmp = tmp_path.resolve()
    x, y = np.zeros((40, 8, 8), np.uint8), np.arange(40, dtype=np.int64) % 10  # [N,8,8], [N]
    for where in ("data", "secret"):
        pack_npz(x, y, f"npz://{tmp}/{where}/set", shard_size=20)
    (tmp / "data" / "leak").symlink_to(tmp / "secret")
    return tmp


async def test_jobs_naming_places_outside_the_roots_fail_unplanned(
    kafka_settings: KafkaSettings, datasets_tree: Path
) -> None:
    # Put on the jobs topic directly, past the gateway: the sharder refuses them with the same
    # check. The datasets outside are real and readable, so only the check stops them.
    tmp = datasets_tree
    storage = StorageSettings(
        uri=f"file://{tmp}/objects", output_roots=(f"{tmp}/out",), dataset_roots=(f"{tmp}/data",)
    )
    jobs_of = {
        "elsewhere": spec_with(dataset={"uri": f"npz://{tmp}/secret/set"}),
        "dotdot": spec_with(dataset={"uri": f"npz://{tmp}/data/../secret/set"}),
        "link": spec_with(dataset={"uri": f"npz://{tmp}/data/leak/set"}),
        "ckpt": spec_with(checkpoint={"uri": f"file://{tmp}/out/../written"}),
        "inside": spec_with(
            dataset={"uri": f"npz://{tmp}/data/set"}, checkpoint={"uri": f"file://{tmp}/out/j"}
        ),
    }
    topics = Topics(kafka_settings.topic_prefix)
    async with (
        running_sharder(kafka_settings, storage=storage),
        TopicReader(kafka_settings, topics.jobs) as jobs,
    ):
        for job_id, spec in jobs_of.items():
            await publish(kafka_settings, job_id, "submitted", {"spec": spec})
        refused = [job_id for job_id in jobs_of if job_id != "inside"]
        await jobs.wait_for(
            lambda m: (
                bool(events(m, "inside", "planned"))
                and all(events(m, job_id, "failed") for job_id in refused)
            ),
            20,
        )
        for job_id in refused:
            [failed] = events(jobs.messages, job_id, "failed")
            reason = failed.details()["reason"]
            field, kind, allowed = (
                ("checkpoint.uri", "output", f"(file://{tmp}/objects, file://{tmp}/out)")
                if job_id == "ckpt"
                else ("dataset.uri", "dataset", f"(file://{tmp}/objects, file://{tmp}/data)")
            )
            assert reason.startswith(f"{field}: "), reason
            assert f"is outside the allowed {kind} roots {allowed}" in reason
            assert not events(jobs.messages, job_id, "planned")
        names = await topic_names(kafka_settings)
        assert topics.batches("inside") in names
        assert not {topics.batches(job_id) for job_id in refused} & names
        [planned] = events(jobs.messages, "inside", "planned")
        assert planned.details()["num_train"] + planned.details()["num_eval"] == 40
    assert not (tmp / "written").exists()
    assert sorted(p.name for p in tmp.iterdir()) == ["data", "secret"]
