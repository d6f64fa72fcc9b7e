"""The preprocessor: turns shard tasks into ready batches on the job's batches topic.

Waits for the shards and jobs topics (the sharder creates them; not ready until then), then
consumes ``Topics.shards`` in group ``conveyor-preprocessors`` (``concurrency`` tasks at once),
across its partitions oldest task first, so tasks are taken in the order the sharder released
them (ties within a millisecond in partition order).
Per task, inside a CONSUMER span ``process <shards topic>`` that continues the task's trace:

1. the job's batches topic must exist, else the job ended: the task is dropped (acked);
2. read (span ``shard read``) and augment + collate (span ``preprocess``) in a worker thread,
   so the event loop, and with it the consumer's heartbeats, never stalls;
3. send every batch (key = batch id, pipelined), then wait for all the broker's acks; a task
   with ``partitions`` sends each batch to the partition the sharder gave it
   (:mod:`conveyor.training.routing`; the task carries them, so a redone task routes alike),
   one without to the partition of the key's hash;
4. samples left out as bad (corrupt image, bad tar member...) are reported in one
   ``SamplesSkipped`` event on the jobs topic (the sharder fails the job past
   ``dataset.max_bad_samples``);
5. only then does ``Consumer.run`` ack the task. A process killed before that leaves the task
   uncommitted: the group redelivers it and the same batch ids are produced again.

A task that cannot be processed (dataset unreadable or corrupt, bad augmentation spec, a
batch over the message size limit) fails its job: a :class:`JobFailed` with the reason is
published once per job and process, and the task is acked, so a bad job never crash-loops the
pool. Unexpected exceptions (bugs) crash the handler: the task is redelivered.

Every ``load_report_s`` the process publishes its busy ratio (:class:`PreprocessorLoad`) on
``Topics.autoscaler`` for the autoscaler, and a last one with ``leaving`` when it stops. A
report that cannot be sent is logged and skipped: it is a measurement, not work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from aiokafka.structs import RecordMetadata
from opentelemetry import trace

from conveyor.platform.bus import (
    BusError,
    Consumer,
    Producer,
    Received,
    RecordTooLarge,
    TopicAdmin,
    process_span,
    wait_for_topics,
)
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.messages import (
    Batch,
    JobFailed,
    PreprocessorLoad,
    SamplesSkipped,
    ShardTask,
    Topics,
)
from conveyor.platform.messages.job_events import MAX_SKIPPED_REASONS
from conveyor.platform.service import Service
from conveyor.platform.telemetry import counter, gauge, histogram
from conveyor.services.preprocessor.busy_meter import BusyMeter
from conveyor.services.preprocessor.config import PreprocessorSettings
from conveyor.services.preprocessor.dataset_cache import DatasetCache
from conveyor.services.preprocessor.work import (
    ShardOutput,
    augmenter_for,
    make_batches,
    read_shard,
)
from conveyor.training.datasets import DatasetError

logger = logging.getLogger(__name__)

_FAILED_JOBS_KEPT = 1024
"""Failed job ids remembered so that their remaining tasks are dropped without a new event."""
_T = TypeVar("_T")


class PreprocessorService(Service):
    """See the module docstring."""

    name = "preprocessor"

    def __init__(
        self,
        *,
        settings: PreprocessorSettings,
        kafka: KafkaSettings,
        storage: StorageSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        super().__init__(telemetry=telemetry)
        self.settings = settings
        self.kafka = kafka
        self.topics = Topics(kafka.topic_prefix)
        self.group_id = self.topics.preprocessor_group
        self.datasets = DatasetCache(
            storage=storage,
            size=settings.dataset_cache_size,
            open_timeout_s=settings.dataset_open_timeout_s,
        )
        self.busy = BusyMeter(window_s=settings.busy_window_s, slots=settings.concurrency)
        self._tracer = trace.get_tracer(__name__)
        self._producer: Producer | None = None
        self._admin: TopicAdmin | None = None
        self._consumer: Consumer | None = None
        self._failed_jobs: OrderedDict[str, None] = OrderedDict()
        self._batches = counter("preprocessor", "batches_total", "Batches produced (acked).")
        self._samples = counter("preprocessor", "samples_total", "Samples in produced batches.")
        self._skipped = counter(
            "preprocessor", "samples_skipped_total", "Samples left out of batches as bad."
        )
        self._dropped = counter(
            "preprocessor", "tasks_dropped_total", "Shard tasks of ended or failed jobs, skipped."
        )
        self._shard_seconds = histogram(
            "preprocessor", "shard_seconds", "Time from taking a shard task to all batches acked."
        )
        busy_ratio = gauge(
            "preprocessor",
            "busy_ratio",
            "Share of worker-slot time spent reading and preprocessing, over a recent window.",
        )
        busy_ratio.set_function(self.busy.ratio)

    def readiness(self) -> bool:
        return super().readiness() and self._consumer is not None

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        topics = self.topics
        await wait_for_topics(self.kafka, [topics.shards, topics.jobs, topics.autoscaler])
        async with (
            Producer(self.kafka) as producer,
            TopicAdmin(self.kafka) as admin,
            Consumer(
                self.kafka,
                [self.topics.shards],
                group_id=self.group_id,
                max_in_flight=self.settings.concurrency,
                drain_timeout_s=max(1.0, self.drain_timeout_s - 5.0),
                revoke_grace_s=self.settings.revoke_grace_s,
                # The sharder releases an epoch's train tasks, then its eval tasks, then the
                # next epoch's, spread over the partitions: taken in fetch order, a lead of more
                # than an epoch had the next epoch trained before this one was evaluated.
                oldest_first=True,
                dead_letter_producer=producer,
            ) as consumer,
        ):
            self._producer, self._admin, self._consumer = producer, admin, consumer
            reporting = asyncio.create_task(self._report_load(), name="preprocessor.load")
            try:
                await consumer.run(self._handle, concurrency=self.settings.concurrency)
            finally:
                reporting.cancel()
                await self._publish_load(leaving=True)
                self._producer = self._admin = self._consumer = None

    async def _report_load(self) -> None:
        """Publish the busy ratio every ``load_report_s`` until cancelled."""
        while True:
            await self._publish_load(leaving=False)
            await asyncio.sleep(self.settings.load_report_s)

    async def _publish_load(self, *, leaving: bool) -> None:
        if self._producer is None:
            return
        load = PreprocessorLoad(worker_id=self.settings.worker_id, busy_ratio=self.busy.ratio(),
                                slots=self.settings.concurrency, leaving=leaving)  # fmt: skip
        try:
            await self._producer.publish(self.topics.autoscaler, load, key=load.worker_id)
        except BusError as exc:
            logger.warning("busy report not sent: %s", exc)

    async def drain(self) -> None:
        # Let the tasks in progress finish and be committed, then leave the group.
        if self._consumer is not None:
            await self._consumer.stop()

    # -- one task --------------------------------------------------------------------------

    async def _handle(self, received: Received) -> None:
        task = received.message
        if not isinstance(task, ShardTask):
            logger.warning("ignoring %s on %s", type(task).__name__, received.topic)
            return
        with process_span(received, consumer_group=self.group_id) as span:
            span.set_attribute("conveyor.job_id", task.job_id)
            span.set_attribute("conveyor.shard_id", task.shard_id)
            await self._process(task)

    async def _process(self, task: ShardTask) -> None:
        started_s = time.perf_counter()
        if task.job_id in self._failed_jobs:
            self._drop(task, "its job failed")
            return
        try:
            topic = self.topics.batches(task.job_id, incarnation=task.incarnation)
        except ValueError as exc:
            self._drop(task, str(exc))
            return
        if not await self._topic_exists(topic):
            self._drop(task, f"{topic} does not exist (the job ended)")
            return
        try:
            output = await self._work(task)
        except (DatasetError, ValueError) as exc:
            await self._fail_job(task, f"shard {task.shard_id}: {exc}")
            return
        batches = output.batches
        try:
            sent = await self._send(topic, batches, task.partitions)
        except RecordTooLarge as exc:
            await self._fail_job(task, f"shard {task.shard_id}: {exc}")
            return
        if not sent:
            self._drop(task, f"{topic} was deleted while sending (the job ended)")
            return
        if output.bad:
            await self._report_skipped(task, output)
        self._batches.inc(len(batches))
        self._samples.inc(len(task.sample_ids))
        self._shard_seconds.observe(time.perf_counter() - started_s)

    async def _work(self, task: ShardTask) -> ShardOutput:
        """Read, augment and collate in worker threads; retries a retriable DatasetError."""
        augmenter = augmenter_for(task.preprocess)
        attempt = 1
        while True:
            try:
                dataset = await self.datasets.get(task.dataset_uri)
                with self._tracer.start_as_current_span("shard read"):
                    samples = await self._in_thread(read_shard, dataset, task)
                with self._tracer.start_as_current_span("preprocess"):
                    return await self._in_thread(make_batches, task, samples, augmenter)
            except DatasetError as exc:
                if not exc.retriable or attempt >= self.settings.dataset_attempts:
                    raise
                backoff_s = self.settings.retry_backoff_s * 2 ** (attempt - 1)
                logger.warning("shard %s: %s; retry in %.1fs", task.shard_id, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                attempt += 1

    async def _report_skipped(self, task: ShardTask, output: ShardOutput) -> None:
        assert self._producer is not None
        self._skipped.inc(len(output.bad))
        logger.warning("shard %s: %d bad sample(s) skipped, first: %s",
                       task.shard_id, len(output.bad), output.bad[0])  # fmt: skip
        event = SamplesSkipped(
            job_id=task.job_id,
            shard_id=task.shard_id,
            sample_ids=[bad.sample_id for bad in output.bad],
            reasons=[str(bad) for bad in output.bad[:MAX_SKIPPED_REASONS]],
        )
        await self._producer.publish(self.topics.jobs, event, key=task.job_id)

    async def _in_thread(self, function: Callable[..., _T], *args: object) -> _T:
        with self.busy.busy():
            return await asyncio.to_thread(function, *args)

    async def _send(self, topic: str, batches: list[Batch], partitions: list[int]) -> bool:
        """Send every batch (to its partition in ``partitions``, when given: one per batch),
        wait for every ack. False when the topic vanished (job ended). RecordTooLarge (a
        batch over the size limit: the job's fault) and other bus errors propagate; the task
        is then not acked."""
        assert self._producer is not None
        acks: list[asyncio.Future[RecordMetadata]] = []
        error: BusError | None = None
        try:
            for position, batch in enumerate(batches):
                batch.timestamps["sent"] = time.time()
                partition = partitions[position] if partitions else None
                acks.append(
                    await self._producer.send(topic, batch, key=batch.batch_id, partition=partition)
                )
        except BusError as exc:
            error = exc
        results = await asyncio.gather(*acks, return_exceptions=True)
        if isinstance(error, RecordTooLarge):
            raise error
        error = error or next((r for r in results if isinstance(r, BusError)), None)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, BusError):
                raise result
        if error is None:
            return True
        if await self._topic_exists(topic):
            raise error
        return False

    async def _topic_exists(self, topic: str) -> bool:
        assert self._admin is not None
        return topic in await self._admin.list_topics()

    def _drop(self, task: ShardTask, why: str) -> None:
        self._dropped.inc()
        logger.info("dropping shard %s: %s", task.shard_id, why)

    async def _fail_job(self, task: ShardTask, reason: str) -> None:
        """Publish the job's ``failed`` event, once per job and process (concurrent tasks of
        the job see it marked before the publish completes)."""
        assert self._producer is not None
        if task.job_id in self._failed_jobs:
            self._drop(task, "its job failed")
            return
        self._failed_jobs[task.job_id] = None
        while len(self._failed_jobs) > _FAILED_JOBS_KEPT:
            self._failed_jobs.popitem(last=False)
        logger.error("job %s fails: %s", task.job_id, reason)
        event = JobFailed(job_id=task.job_id, reason=reason)
        try:
            await self._producer.publish(self.topics.jobs, event, key=task.job_id)
        except BaseException:
            # Not published: the task is not acked either, so its redelivery tries again.
            self._failed_jobs.pop(task.job_id, None)
            raise
