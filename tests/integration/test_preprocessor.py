"""The preprocessor against the real broker: batches out, commits after acks, failures, kill."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import serving
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conveyor.platform.bus import Producer, TopicAdmin, TopicSpec, create_topology, ensure_topics
from conveyor.platform.codec import decode
from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.messages import (
    Batch,
    JobEvent,
    Message,
    PreprocessorLoad,
    ShardTask,
    Topics,
)
from conveyor.services.preprocessor.config import PreprocessorSettings
from conveyor.services.preprocessor.service import PreprocessorService
from conveyor.training.datasets import open_array_dataset, pack_npz
from conveyor.training.plan import JobPlan

DIGITS = "builtin://sklearn-digits"
SLOW = "synthetic://?n=4000&shape=1x8x8&classes=10&seed=2&cost_ms=4"
STAMPS = {"released", "read_start", "read_end", "augment_end", "sent"}


def make_service(
    kafka: KafkaSettings, storage: StorageSettings | None = None, **settings: Any
) -> PreprocessorService:
    return PreprocessorService(
        settings=PreprocessorSettings(**settings),
        kafka=kafka,
        storage=storage or StorageSettings(uri="file://./.conveyor/objects"),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )


@asynccontextmanager
async def running(
    kafka: KafkaSettings, storage: StorageSettings | None = None, **settings: Any
) -> AsyncIterator[PreprocessorService]:
    service = make_service(kafka, storage, **settings)
    async with serving.running(service):
        yield service


async def setup_topics(kafka: KafkaSettings, *batch_jobs: str) -> Topics:
    """The global topics and the batches topics of ``batch_jobs``, as the sharder makes them."""
    topics = Topics(kafka.topic_prefix)
    await create_topology(kafka, TopologySettings(jobs_partitions=2, shards_partitions=2))
    await ensure_topics(kafka, [TopicSpec(topics.batches(job), partitions=2) for job in batch_jobs])
    return topics


def shard_tasks(
    job_id: str, uri: str, num_samples: int, count: int, **extra: Any
) -> list[ShardTask]:
    plan = JobPlan(job_id=job_id, num_samples=num_samples, eval_fraction=0.2, seed=4, epochs=1,
                   micro_batch_size=16, shard_size=64)  # fmt: skip
    tasks = []
    for k in range(count):
        shard = plan.task(k)
        tasks.append(ShardTask(
            job_id=job_id, shard_id=shard.shard_id, epoch=shard.epoch, index=shard.index,
            split=shard.split, dataset_uri=uri, sample_ids=shard.sample_ids,
            micro_batch_size=16, seed=4, preprocess=extra.get("preprocess", {"augment": []}),
            released_at=time.time(),
        ))  # fmt: skip
    return tasks


async def publish_tasks(kafka: KafkaSettings, tasks: list[ShardTask]) -> None:
    topic = Topics(kafka.topic_prefix).shards
    async with Producer(kafka) as producer:
        for task in tasks:
            await producer.publish(topic, task, key=task.shard_id)


def expected_ids(tasks: list[ShardTask]) -> set[str]:
    return {f"{t.shard_id}:b{k:03d}" for t in tasks for k in range(-(-len(t.sample_ids) // 16))}


class TopicReader:
    """Every record of a topic from the beginning (group-less), decoded, as it arrives."""

    def __init__(self, kafka: KafkaSettings, topic: str) -> None:
        self.topic = topic
        self.records: list[tuple[Message, dict[str, bytes], float]] = []
        self.partitions: dict[str, int] = {}
        """Batch id -> the partition it was read from."""
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap, enable_auto_commit=False
        )

    async def __aenter__(self) -> TopicReader:
        await self._consumer.start()
        await self._consumer.topics()
        tps = [TopicPartition(self.topic, p)
               for p in sorted(self._consumer.partitions_for_topic(self.topic) or ())]  # fmt: skip
        assert tps, f"{self.topic} does not exist"
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    @property
    def messages(self) -> list[Message]:
        return [message for message, _, _ in self.records]

    async def written(self) -> int:
        """Records the topic holds now (the sum of its partitions' end offsets)."""
        ends = await self._consumer.end_offsets(list(self._consumer.assignment()))
        return sum(ends.values())

    async def wait_for(self, predicate: Callable[[list[Message]], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.messages):
            assert time.monotonic() < deadline, f"timed out with {len(self.records)} records"
            await self._poll()

    async def read_to_end(self, timeout_s: float = 10.0) -> None:
        """Read every record the topic holds now."""
        ends = await self._consumer.end_offsets(list(self._consumer.assignment()))
        deadline = time.monotonic() + timeout_s
        while any([await self._consumer.position(tp) < end for tp, end in ends.items()]):
            assert time.monotonic() < deadline, f"timed out with {len(self.records)} records"
            await self._poll()

    async def _poll(self) -> None:
        for records in (await self._consumer.getmany(timeout_ms=200)).values():
            for r in records:
                message = decode(r.value)
                self.records.append((message, dict(r.headers or []), time.time()))
                if isinstance(message, Batch):
                    self.partitions[message.batch_id] = r.partition


def batch_ids_in(messages: list[Message]) -> set[str]:
    return {m.batch_id for m in messages if isinstance(m, Batch)}


async def committed_offsets(kafka: KafkaSettings, topic: str, group: str) -> dict[int, int]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = sorted(consumer.partitions_for_topic(topic) or ())
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + 10
        while True:
            committed = {tp.partition: await consumer.committed(tp) or 0 for tp in tps}
            if all(committed[tp.partition] == ends[tp] for tp in tps):
                return committed
            assert time.monotonic() < deadline, f"committed {committed}, ends {ends}"
            await asyncio.sleep(0.2)
    finally:
        await consumer.stop()


async def test_not_ready_until_the_sharders_topics_exist(kafka_settings: KafkaSettings) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    service = make_service(kafka_settings)
    serving = asyncio.create_task(service.serve())
    try:
        await asyncio.sleep(1.5)
        assert not service.readiness() and not serving.done()
        async with TopicAdmin(kafka_settings) as admin:  # the preprocessor creates none
            assert not {topics.jobs, topics.shards, topics.dlq} & await admin.list_topics()
        await setup_topics(kafka_settings)
        deadline = time.monotonic() + 10
        while not service.readiness():
            assert time.monotonic() < deadline and not serving.done(), "preprocessor never ready"
            await asyncio.sleep(0.05)
    finally:
        service.request_stop()
        assert await asyncio.wait_for(serving, 30) == 0


async def test_tasks_become_batches_with_traces_and_commits(
    kafka_settings: KafkaSettings, spans: InMemorySpanExporter
) -> None:
    topics = await setup_topics(kafka_settings, "job1")
    tasks = shard_tasks("job1", DIGITS, 1797, 4)
    tasks += shard_tasks("job1", DIGITS, 1797, 25)[-2:]  # eval shards: 359 samples, 6 tasks
    assert {t.split for t in tasks} == {"train", "eval"}
    # Routed tasks (partitions given by the sharder): every batch of task 1 to partition 1,
    # those of the eval task 4 alternating from 1; the rest by the key's hash.
    tasks[1] = dataclasses.replace(tasks[1], partitions=[1] * 4)
    tasks[4] = dataclasses.replace(tasks[4], partitions=[1, 0, 1, 0])
    x_all, y_all = open_array_dataset(DIGITS).read(list(range(1797)))
    batches = TopicReader(kafka_settings, topics.batches("job1"))
    async with running(kafka_settings, worker_id="pp-1", load_report_s=0.2), batches as out:
        await publish_tasks(kafka_settings, tasks)
        await out.wait_for(lambda m: batch_ids_in(m) >= expected_ids(tasks), 20)
        await committed_offsets(kafka_settings, topics.shards, topics.preprocessor_group)
    # Its busy reports for the autoscaler: busy while it worked, the last one as it left.
    async with TopicReader(kafka_settings, topics.autoscaler) as reports:
        await reports.wait_for(lambda m: any(getattr(r, "leaving", False) for r in m), 10)
    loads = [m for m in reports.messages if isinstance(m, PreprocessorLoad)]
    assert {load.worker_id for load in loads} == {"pp-1"} and loads[-1].leaving
    assert max(load.busy_ratio for load in loads) > 0 and {load.slots for load in loads} == {2}
    by_id = {m.batch_id: (m, headers) for m, headers, _ in out.records if isinstance(m, Batch)}
    assert set(by_id) == expected_ids(tasks)
    for task in tasks:
        for k in range(-(-len(task.sample_ids) // 16)):
            batch, headers = by_id[f"{task.shard_id}:b{k:03d}"]
            ids = task.sample_ids[16 * k : 16 * k + 16]
            assert batch.sample_ids == ids and batch.split == task.split
            assert batch.x.dtype == torch.uint8 and list(batch.x.shape) == [len(ids), 1, 8, 8]
            assert torch.equal(batch.x, torch.from_numpy(x_all[ids]))
            assert batch.y.tolist() == y_all[ids].tolist()
            assert set(batch.timestamps) == STAMPS
            assert batch.timestamps["released"] == task.released_at
            assert "traceparent" in headers
            if task.partitions:
                assert out.partitions[batch.batch_id] == task.partitions[k]
    assert {out.partitions[f"{tasks[1].shard_id}:b{k:03d}"] for k in range(4)} == {1}
    assert [out.partitions[f"{tasks[4].shard_id}:b{k:03d}"] for k in range(4)] == [1, 0, 1, 0]
    unrouted = [b for t in tasks if not t.partitions for b in expected_ids([t])]
    assert {out.partitions[b] for b in unrouted} == {0, 1}  # the key's hash spreads them

    finished = spans.get_finished_spans()
    process = [s for s in finished if s.name == f"process {topics.shards}"]
    assert len(process) == len(tasks)
    sends = {_trace(s) for s in finished if s.name == f"send {topics.shards}"}
    for span in process:
        assert _trace(span) in sends  # continues the task's trace
        children = [s for s in finished if s.parent and s.parent.span_id == _span(span)]
        names = sorted(s.name for s in children)
        assert names[:2] == ["preprocess", f"send {topics.prefix}job.{{id}}.batches"]
        assert "shard read" in names


async def test_tasks_are_taken_in_the_order_released_across_partitions(
    kafka_settings: KafkaSettings,
) -> None:
    # Two epochs released at once (a lead of more than an epoch) over four partitions: the
    # epochs' train and eval tasks must come out in release order, not a partition at a time.
    topics = Topics(kafka_settings.topic_prefix)
    await create_topology(kafka_settings, TopologySettings(shards_partitions=4))
    await ensure_topics(kafka_settings, [TopicSpec(topics.batches("job1"), partitions=2)])
    plan = JobPlan(job_id="job1", num_samples=1797, eval_fraction=0.2, seed=4, epochs=2,
                   micro_batch_size=16, shard_size=128)  # fmt: skip
    released = []
    for k in range(plan.num_tasks):
        shard = plan.task(k)
        released.append(ShardTask(
            job_id="job1", shard_id=shard.shard_id, epoch=shard.epoch, index=shard.index,
            split=shard.split, dataset_uri=DIGITS, sample_ids=shard.sample_ids,
            micro_batch_size=16, seed=4, preprocess={"augment": []}, released_at=time.time(),
        ))  # fmt: skip
    async with Producer(kafka_settings) as producer:
        for task in released:
            await producer.publish(topics.shards, task, key=task.shard_id)
            await asyncio.sleep(0.003)  # record timestamps are in milliseconds
    batches = TopicReader(kafka_settings, topics.batches("job1"))
    async with running(kafka_settings, concurrency=1), batches as out:
        await out.wait_for(lambda m: batch_ids_in(m) >= expected_ids(released), 30)
    sent = sorted((m.timestamps["sent"], m.shard_id) for m in out.messages if isinstance(m, Batch))
    worked = list(dict.fromkeys(shard_id for _, shard_id in sent))
    assert worked == [task.shard_id for task in released]


def _trace(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.trace_id)


def _span(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


async def test_ended_jobs_are_dropped_and_bad_datasets_fail_the_job(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    topics = await setup_topics(kafka_settings, "bad", "good")
    gone = shard_tasks("gone", DIGITS, 1797, 2)  # no batches topic: the job ended
    bad = shard_tasks("bad", f"npz://{tmp_path}/nonexistent/conveyor-test", 1797, 3)
    good = shard_tasks("good", DIGITS, 1797, 2)
    storage = StorageSettings(uri=f"file://{tmp_path}/objects", dataset_roots=(str(tmp_path),))
    async with (
        running(kafka_settings, storage),
        TopicReader(kafka_settings, topics.batches("good")) as out,
        TopicReader(kafka_settings, topics.jobs) as jobs,
    ):
        await publish_tasks(kafka_settings, [*gone, *bad, *good])
        await out.wait_for(lambda m: batch_ids_in(m) >= expected_ids(good), 20)
        await jobs.wait_for(lambda m: any(isinstance(e, JobEvent) for e in m), 10)
        await committed_offsets(kafka_settings, topics.shards, topics.preprocessor_group)
        await jobs.read_to_end()  # every task is done: a second failure would be written
    failed = [m for m in jobs.messages if isinstance(m, JobEvent)]
    assert [(e.job_id, e.EVENT) for e in failed] == [("bad", "failed")]  # once per job
    assert "/nonexistent/conveyor-test" in failed[0].details()["reason"]
    assert failed[0].details()["reason"].startswith("shard bad:e0:train:")


@pytest.fixture
def secret_dataset(tmp_path: Path) -> Path:
    """An 80-sample npz dataset in ``secret/set``, an empty ``data/`` and ``data/leak`` ->
    secret."""
    tmp = tmp_path.resolve()
    x, y = np.zeros((80, 8, 8), np.uint8), np.arange(80, dtype=np.int64) % 10  # [N,8,8], [N]
    pack_npz(x, y, f"npz://{tmp}/secret/set", shard_size=40)
    (tmp / "data").mkdir()
    (tmp / "data" / "leak").symlink_to(tmp / "secret")
    return tmp


async def test_a_task_whose_dataset_is_outside_the_roots_fails_its_job_unread(
    kafka_settings: KafkaSettings, secret_dataset: Path
) -> None:
    # A shard task put on the shards topic directly, past the sharder's check: the dataset is
    # real and readable, so only the preprocessor's own check keeps it from being read.
    tmp = secret_dataset
    topics = await setup_topics(kafka_settings, "outside", "linked")
    outside = shard_tasks("outside", f"npz://{tmp}/secret/set", 80, 1)
    linked = shard_tasks("linked", f"npz://{tmp}/data/leak/set", 80, 1)
    storage = StorageSettings(uri=f"file://{tmp}/objects", dataset_roots=(f"{tmp}/data",))
    async with (
        running(kafka_settings, storage) as service,
        TopicReader(kafka_settings, topics.jobs) as jobs,
        TopicReader(kafka_settings, topics.batches("outside")) as out,
    ):
        await publish_tasks(kafka_settings, [*outside, *linked])
        await jobs.wait_for(lambda m: len([e for e in m if isinstance(e, JobEvent)]) == 2, 20)
        await committed_offsets(kafka_settings, topics.shards, topics.preprocessor_group)
        assert service.readiness()  # serving on, for the jobs whose data it may read
        assert await out.written() == 0
    failed = {e.job_id: e.details()["reason"] for e in jobs.messages if isinstance(e, JobEvent)}
    assert sorted(failed) == ["linked", "outside"]
    for job_id, reason in failed.items():
        assert reason.startswith(f"shard {job_id}:e0:train:00000: dataset.uri: "), reason
        assert (
            f"is outside the allowed dataset roots (file://{tmp}/objects, file://{tmp}/data)"
            in reason
        )


async def test_a_task_cut_short_is_redone_by_the_next_member(
    kafka_settings: KafkaSettings,
) -> None:
    # aiokafka sends no LeaveGroup from generation 0 (Tansu's first): keep sessions short so
    # the second member does not wait long for the first one's partitions.
    kafka = kafka_settings.model_copy(
        update={"session_timeout_s": 3.0, "heartbeat_interval_s": 0.5}
    )
    topics = await setup_topics(kafka, "job1")
    tasks = shard_tasks("job1", SLOW, 4000, 12)  # ~0.25 s of CPU per task
    await publish_tasks(kafka, tasks)
    async with TopicReader(kafka, topics.batches("job1")) as out:
        first = make_service(kafka, concurrency=2)
        killed = asyncio.create_task(first.run())
        await out.wait_for(lambda m: len(batch_ids_in(m)) >= 2, 20)
        killed.cancel()  # mid-way: the tasks in progress are not acked
        with contextlib.suppress(asyncio.CancelledError):
            await killed
        killed_at = time.time()
        assert batch_ids_in(out.messages) < expected_ids(tasks)
        async with running(kafka, concurrency=2):
            await out.wait_for(lambda m: batch_ids_in(m) >= expected_ids(tasks), 25)
    assert batch_ids_in(out.messages) == expected_ids(tasks)  # nothing lost
    assert any(at > killed_at for _, _, at in out.records)  # the second member did work
    pixels: dict[str, bytes] = {}
    for message, _, _ in out.records:
        assert isinstance(message, Batch)
        data = message.x.numpy().tobytes()
        assert pixels.setdefault(message.batch_id, data) == data  # duplicates are identical


async def test_a_member_joining_mid_task_lets_the_tasks_in_hand_finish(
    kafka_settings: KafkaSettings,
) -> None:
    # The rebalance a joining preprocessor causes revokes every partition of the members
    # working: with the grace (CONVEYOR_PREPROCESSOR_REVOKE_GRACE_S) they finish and commit the
    # tasks in hand first, so no task is done twice. Without it each task in hand is done
    # again by its partition's next owner (shown on the bus itself in
    # test_bus_groups.py::test_revoke_grace_lets_records_in_flight_finish_so_none_is_done_twice).
    kafka = kafka_settings.model_copy(
        update={"session_timeout_s": 3.0, "heartbeat_interval_s": 0.5}
    )
    topics = await setup_topics(kafka, "job1")
    tasks = shard_tasks("job1", SLOW, 4000, 30)  # ~0.25 s of CPU per task
    await publish_tasks(kafka, tasks)
    async with TopicReader(kafka, topics.batches("job1")) as out:
        async with running(kafka, concurrency=2):
            await out.wait_for(lambda m: len(batch_ids_in(m)) >= 2, 20)  # tasks in hand
            joined_at = time.time()
            async with running(kafka, concurrency=2):
                await out.wait_for(lambda m: batch_ids_in(m) >= expected_ids(tasks), 40)
        await out.read_to_end()
    written = [m.batch_id for m in out.messages if isinstance(m, Batch)]
    assert set(written) == expected_ids(tasks)
    assert any(at > joined_at + 1.0 for _, _, at in out.records)  # it joined mid-stream
    assert len(written) == len(expected_ids(tasks))  # every batch once
