"""The autoscaler service against the real broker, with in-memory drivers: it reads the
trainers' data wait from their progress events, the preprocessors' busy reports and the group
lags from the broker, scales the preprocessors up while the job starves with shard tasks
waiting and the trainers up to what the queued job asks, both down to their minimum after the
job and the cooldown, and publishes every decision with its inputs (what the gateway folds)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from job_events import job_event

from conveyor.platform.bus import Producer, TopicAdmin, TopicTail, create_topology
from conveyor.platform.bus.group_lag import GroupLagReader
from conveyor.platform.config import KafkaSettings, TelemetrySettings, TopologySettings
from conveyor.platform.messages import PreprocessorLoad, ScalingDecision, Topics, TopicSpec
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.drivers import ScaleDriver
from conveyor.services.autoscaler.service import AutoscalerService
from conveyor.services.gateway.autoscaling import AutoscalerLog

JOB = "job1"


class MemoryDriver(ScaleDriver):
    name = "memory"

    def __init__(self, replicas: int) -> None:
        self.count = replicas
        self.calls: list[int] = []
        self._changed = asyncio.Event()

    async def called(self, calls: list[int], timeout_s: float) -> None:
        """Until the driver was asked for exactly ``calls``, in order."""
        async with asyncio.timeout(timeout_s):
            while self.calls != calls:
                self._changed.clear()
                await self._changed.wait()

    async def replicas(self) -> int:
        return self.count

    async def scale(self, replicas: int) -> None:
        self.calls.append(replicas)
        self.count = replicas
        self._changed.set()


async def _fill(kafka: KafkaSettings, topic: str, records: int) -> None:
    async with AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all") as producer:
        for index in range(records):
            await producer.send_and_wait(topic, f"r{index}".encode(), partition=index % 2)


async def _commit_all(kafka: KafkaSettings, group: str, topic: str) -> None:
    """The group takes every record: commits each partition's end offset."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, group_id=group,
                                enable_auto_commit=False)  # fmt: skip
    async with consumer:
        partitions = [TopicPartition(topic, p) for p in (0, 1)]
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        await consumer.commit({tp: ends[tp] for tp in partitions})


async def test_group_lag_reader_counts_uncommitted_records(kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}lag"
    async with TopicAdmin(kafka_settings) as admin:
        await admin.create_topics([TopicSpec(topic, partitions=2)])
    await _fill(kafka_settings, topic, 7)
    async with GroupLagReader(kafka_settings) as lags:
        assert await lags.partitions(topic) == [0, 1]
        before = await lags.progress("g", topic)
        assert (before.committed, before.lag, before.partitions) == (0, 7, 2)
        await _commit_all(kafka_settings, "g", topic)
        after = await lags.progress("g", topic)
        assert (after.committed, after.lag) == (7, 0)
        missing = await lags.progress("g", f"{kafka_settings.topic_prefix}gone")
        assert (missing.committed, missing.lag, missing.partitions) == (0, 0, 0)


async def test_group_lag_reader_sees_a_topic_created_after_it_started(
    kafka_settings: KafkaSettings,
) -> None:
    # A job's batches topic is created long after the autoscaler's reader started: its
    # client's cached metadata (refreshed every 5 minutes) does not know it yet.
    topic = f"{kafka_settings.topic_prefix}late-lag"
    async with GroupLagReader(kafka_settings) as lags:
        assert await lags.partitions(topic) == []
        async with TopicAdmin(kafka_settings) as admin:
            await admin.create_topics([TopicSpec(topic, partitions=2)])
        await _fill(kafka_settings, topic, 5)
        assert await lags.partitions(topic) == [0, 1]
        progress = await lags.progress("g", topic)
        assert (progress.committed, progress.lag) == (0, 5)
        gone = await lags.progress("g", f"{kafka_settings.topic_prefix}gone")
        assert (gone.committed, gone.lag) == (0, 0)
    async with TopicAdmin(kafka_settings) as admin:  # asking did not create a missing topic
        assert f"{kafka_settings.topic_prefix}gone" not in await admin.list_topics()


async def test_scales_up_a_starving_job_and_down_after_it(kafka_settings: KafkaSettings) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    await create_topology(kafka_settings, TopologySettings(shards_partitions=2))
    async with TopicAdmin(kafka_settings) as admin:
        await admin.create_topics([TopicSpec(topics.batches(JOB), partitions=2)])
    await _fill(kafka_settings, topics.shards, 6)  # 6 shard tasks nobody took yet
    await _fill(kafka_settings, topics.batches(JOB), 3)
    async with Producer(kafka_settings) as producer:
        trainer = {"worker_id": "trainer-1", "data_wait_ratio": 0.6}
        spec = {"distribution": {"trainers": 3}}
        events: list[tuple[str, dict[str, Any]]] = [
            ("submitted", {"spec": spec}), ("planned", {}), ("progress", trainer),
        ]  # fmt: skip
        for name, fields in events:
            await producer.publish(topics.jobs, job_event(JOB, name, **fields), key=JOB)
        # The preprocessor's busy report: the only record on the autoscaler topic, read from there.
        load = PreprocessorLoad(worker_id="preprocessor-1", busy_ratio=0.95, slots=2)
        await producer.publish(topics.autoscaler, load, key=load.worker_id)
    driver, trainers = MemoryDriver(replicas=1), MemoryDriver(replicas=1)
    settings = AutoscalerSettings(
        driver="kubernetes", interval_s=0.1, up_interval_s=0, cooldown_s=0.5,
        min_replicas=1, max_replicas=8, report_every_s=60,
        trainer_min_replicas=1, trainer_max_replicas=4, trainer_cooldown_s=0.5,
    )  # fmt: skip
    service = AutoscalerService(settings=settings, driver=driver, kafka=kafka_settings,
                                telemetry=TelemetrySettings(otlp_endpoint=None),
                                trainer_driver=trainers)  # fmt: skip
    running = asyncio.create_task(service.run())
    try:
        # 60% wait: 1 / 0.4 -> 3, but the shards topic has 2 partitions: 2.
        await driver.called([2], timeout_s=30)
        # The job asks 3 trainers and waits in the queue (no trainer in the pool): 1 -> 3.
        await trainers.called([3], timeout_s=30)
        async with Producer(kafka_settings) as producer:
            await producer.publish(topics.jobs, job_event(JOB, "completed"), key=JOB)
        await _commit_all(kafka_settings, topics.preprocessor_group, topics.shards)
        await driver.called([2, 1], timeout_s=30)  # the floor, after the cooldown
        await trainers.called([3, 1], timeout_s=30)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running

    log = AutoscalerLog()
    async with TopicTail(kafka_settings, topics.autoscaler) as tail:
        while len(log.decisions) < 4:
            for record in await tail.get_many(1.0):
                log.apply(record.message)
    # The job starved from the first look: no `start` report, the first decision is the step up.
    up, down = [d for d in service.decisions
                if d.action not in ("hold", "start") and d.service == "preprocessor"]  # fmt: skip
    assert (up.action, up.replicas_before, up.replicas_after) == ("up", 1, 2)
    assert (up.partitions, up.shards_lag, up.driver) == (2, 6, "memory")
    assert (up.busy_ratio, up.preprocessors_reporting) == (0.95, 1)
    assert "preprocessors 95% busy" in up.reason
    (signals,) = up.jobs
    assert (signals.job_id, signals.trainers, signals.data_wait_ratio, signals.batches_lag) == (
        JOB, 1, 0.6, 3,
    )  # fmt: skip
    assert (down.action, down.replicas_after, down.jobs, down.shards_lag) == ("down", 1, [], 0)
    assert "work is gone" in down.reason
    # What the gateway shows: the latest state and the changes, newest first.
    grow, shrink = [d for d in service.decisions
                    if d.action not in ("hold", "start") and d.service == "trainer"]  # fmt: skip
    assert (grow.action, grow.replicas_before, grow.replicas_after) == ("up", 1, 3)
    assert "jobs ask 3 trainers, 1 queued" in grow.reason
    assert (grow.min_replicas, grow.max_replicas) == (1, 4)
    assert (shrink.action, shrink.replicas_after) == ("down", 1)
    snapshot = log.snapshot()
    assert snapshot["changes"] == 4
    by_pool = [(d["service"], d["action"]) for d in snapshot["decisions"]]
    assert [action for pool, action in by_pool if pool == "preprocessor"] == ["down", "up"]
    assert [action for pool, action in by_pool if pool == "trainer"] == ["down", "up"]
    assert snapshot["state"]["replicas_after"] == 1
    assert snapshot["state"]["service"] == "preprocessor"
    assert snapshot["pools"]["trainer"]["replicas_after"] == 1
    assert all(isinstance(d, ScalingDecision) for d in log.decisions)
