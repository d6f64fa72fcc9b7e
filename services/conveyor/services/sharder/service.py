"""The sharder: plans submitted jobs and releases their shard tasks with flow control.

The sharder owns the topology: on start it creates the global topics (jobs, shards, dead
letters; :func:`~conveyor.platform.bus.create_topology`) and it creates and deletes every job's
topics; the other services only wait for them. One loop (``run``) reads ``Topics.jobs`` in group
``conveyor-sharder`` (a job's partition picks its sharder; a rebalance is failover) and folds
every event into the
:class:`~.jobs.JobTable`. Whenever it has caught up with the log (consumer lag 0) or
``tick_s`` passed, it acts on every job, idempotently:

- terminal job (completed/failed/cancelled in the log): delete its topics, forget it, ack its
  ``submitted`` record (only now may the committed offset pass it);
- cancel requested: publish ``cancelled`` (once), release nothing more;
- not planned yet: parse the spec, check that its dataset and checkpoint locations lie inside
  the operator's roots (:mod:`conveyor.training.locations`), open the dataset in a thread
  (``dataset_open_timeout_s``), make the :class:`~.plan.JobPlan`, create the job topics, publish
  ``planned`` (unless the log already has one); a bad spec, a location outside the roots or an
  unreadable dataset publishes ``failed`` with the reason;
- planned: release the tasks :class:`~.flow.FlowControl` allows, await their acks; each task
  carries the partition of each of its batches, from the routing of the coordinator's latest
  progress and the batch's place in its epoch (:mod:`conveyor.training.routing`);
- resumed (a ``resumed`` event, planned again like a submission): read the job's progress from
  the checkpoint it names (slice 0's file; a checkpoint that cannot be read fails the job),
  create the topics of its new incarnation (fresh names: nothing of the earlier run reaches
  them), write the ``ResumePoint`` as the first record of the control topic, then publish
  ``planned``; release only the tasks with batches left to do.

Acting only when caught up means a restarted sharder first replays a job's events (its
``submitted`` record was never committed past) and then continues from the consumed cursor of
the latest progress, instead of re-releasing the job from its first shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time

from aiokafka import TopicPartition
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link

from conveyor.platform.bus import (
    BusError,
    Consumer,
    ConsumerStopped,
    Producer,
    TopicAdmin,
    create_topology,
    process_span,
)
from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.messages import (
    JobCancelled,
    JobEvent,
    JobFailed,
    JobPlanned,
    ResumePoint,
    ShardTask,
    Topics,
)
from conveyor.platform.service import Service
from conveyor.platform.storage import StorageError, open_store
from conveyor.platform.telemetry import counter, gauge
from conveyor.services.sharder.config import SharderSettings
from conveyor.services.sharder.flow import (
    FlowControl,
    ReleaseSequence,
    RemainingSequence,
    batches_done,
    remaining_tasks,
)
from conveyor.services.sharder.jobs import JobRecord, JobTable
from conveyor.training.checkpoint import CheckpointError, CheckpointStore, read_progress
from conveyor.training.datasets import AnyDataset, DatasetError, open_dataset, output_shape
from conveyor.training.locations import output_uri, refused_locations
from conveyor.training.plan import JobPlan
from conveyor.training.routing import shard_partitions

logger = logging.getLogger(__name__)

_RETRY_BACKOFF_S = 1.0
_MAX_DATASET_ATTEMPTS = 3
"""Attempts to open a dataset whose storage is unavailable before the job fails."""


async def _load_model_builder() -> None:
    """Import the model builder (torch: ~2.5 CPU-s, ~190 MB) in a thread once the sharder
    runs, not when it plans its first job: a job submitted to a fresh stack (``conveyor run``)
    was planned ~3 s after its submission, most of it this import. A failure is logged; the
    first plan imports it again and fails that job with the reason."""
    try:
        await asyncio.to_thread(importlib.import_module, "conveyor.training.slicing")
    except Exception:
        logger.warning("loading the model builder failed; planning will try again", exc_info=True)


class _PlanFailed(Exception):
    """Planning cannot succeed; the reason goes into the job's ``failed`` event."""


class SharderService(Service):
    """Plans jobs and releases shard tasks; see the module docstring."""

    name = "sharder"

    def __init__(
        self,
        *,
        settings: SharderSettings,
        topology: TopologySettings,
        kafka: KafkaSettings,
        storage: StorageSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        super().__init__(telemetry=telemetry)
        self.settings = settings
        self.topology = topology
        self.kafka = kafka
        self.storage = storage
        self.topics = Topics(kafka.topic_prefix)
        self.group_id = self.topics.sharder_group
        self.table = JobTable(self.topics)
        self._tracer = trace.get_tracer(__name__)
        self._producer: Producer | None = None
        self._admin: TopicAdmin | None = None
        self._consumer: Consumer | None = None
        self._dataset_attempts: dict[str, int] = {}
        self._ended_at: dict[str, float] = {}
        """Terminal jobs whose topics are kept for the grace period -> when seen ended."""
        self._released = counter("sharder", "shards_released_total", "Shard tasks released.")
        self._lead = gauge(
            "sharder", "lead_batches", "Released batches not yet consumed, summed over jobs."
        )
        self._jobs_active = gauge("sharder", "jobs_active", "Planned jobs still releasing.")

    def readiness(self) -> bool:
        return super().readiness() and self._producer is not None

    async def drain(self) -> None:
        # Commit what is acked and leave the group now, so the jobs move to another sharder at
        # once; the loop then ends on ConsumerStopped.
        if self._consumer is not None:
            await self._consumer.stop()

    # -- main loop -------------------------------------------------------------------------

    async def run(self) -> None:
        await create_topology(self.kafka, self.topology)
        async with (
            Producer(self.kafka) as producer,
            TopicAdmin(self.kafka) as admin,
            Consumer(
                self.kafka,
                [self.topics.jobs],
                group_id=self.group_id,
                max_in_flight=self.settings.max_held_events,
                dead_letter_producer=producer,
            ) as consumer,
        ):
            self._producer, self._admin, self._consumer = producer, admin, consumer
            warm_up = asyncio.create_task(_load_model_builder(), name="sharder.warm-up")
            try:
                await self._loop(consumer)
            finally:
                warm_up.cancel()  # the import's thread runs on; nothing awaits it
                with contextlib.suppress(asyncio.CancelledError):
                    await warm_up
                self._producer = self._admin = self._consumer = None
                self._jobs_active.set(0)
                self._lead.set(0)

    async def _loop(self, consumer: Consumer) -> None:
        while True:
            try:
                async with asyncio.timeout(self.settings.tick_s):
                    received = await consumer.get()
            except TimeoutError:
                received = None
            except ConsumerStopped:
                return
            except BusError as exc:
                if not exc.retriable:
                    raise
                logger.warning("reading %s: %s; retrying", self.topics.jobs, exc)
                await asyncio.sleep(_RETRY_BACKOFF_S)
                continue
            if received is not None:
                if self.table.apply(received):
                    consumer.ack(received)
                for replaced in self.table.take_released():
                    await self._delete_job_topics([replaced])  # its grace ends with the resume
                    consumer.ack(replaced.submitted)
                    self._ended_at.pop(replaced.job_id, None)
                if consumer.lag() > 0:
                    continue  # later events may cancel, finish or advance a job: read them first
            try:
                await self._act(consumer)
            except BusError as exc:
                if not exc.retriable:
                    raise
                # Every step is idempotent and state only moves after success: redo next pass.
                logger.warning("acting on jobs: %s; retrying", exc)
                await asyncio.sleep(_RETRY_BACKOFF_S)

    async def _act(self, consumer: Consumer) -> None:
        assigned = consumer.assignment()
        finished: list[JobRecord] = []
        for job in self.table.records():
            if TopicPartition(*job.source) not in assigned:
                # The partition moved to another sharder, which replays the job's events.
                logger.info("job %s: handed over to another sharder", job.job_id)
                self.table.forget(job.job_id)
                self._ended_at.pop(job.job_id, None)
                self._dataset_attempts.pop(job.job_id, None)
            elif job.terminal:
                ended_at = self._ended_at.setdefault(job.job_id, time.monotonic())
                if time.monotonic() - ended_at >= self.settings.finished_topics_grace_s:
                    finished.append(job)
            elif job.outcome_published:
                continue  # our failed/cancelled event is on its way back
            elif job.cancel_requested:
                cancelled = JobCancelled(job_id=job.job_id, reason="cancel requested")
                await self._publish_outcome(job, cancelled)
            elif (too_many := job.too_many_bad_samples()) is not None:
                await self._publish_outcome(job, JobFailed(job_id=job.job_id, reason=too_many))
            else:
                if job.plan is None:
                    await self._plan(job)
                if job.active:
                    await self._release(job)
        if finished:
            await self._finish(consumer, finished)
        active = [job for job in self.table.records() if job.active]
        self._jobs_active.set(len(active))
        self._lead.set(sum(_lead(job) for job in active))

    # -- planning --------------------------------------------------------------------------

    async def _plan(self, job: JobRecord) -> None:
        with (
            process_span(job.submitted, consumer_group=self.group_id),
            self._tracer.start_as_current_span(
                "plan job", attributes={"conveyor.job_id": job.job_id}
            ) as span,
        ):
            job.plan_span = span.get_span_context()
            try:
                made = await self._make_plan(job)
            except _PlanFailed as exc:
                await self._publish_outcome(job, JobFailed(job_id=job.job_id, reason=str(exc)))
                return
            if made is None:
                return  # storage unavailable: try again on the next pass
            plan, shape, dataset = made
            if job.resume is not None and await self._resume_point(job) is None:
                return  # failed, or storage unavailable: the next pass retries
            await self._create_job_topics(job)
            if not job.planned_seen:
                if job.resume_point is not None:
                    await self._publish_control(job, job.resume_point)
                await self._publish(self._planned(job, plan, shape, dataset))
            assert job.spec is not None
            job.plan = plan
            sequence: ReleaseSequence = plan
            if job.resume_point is not None:
                sequence = RemainingSequence(remaining_tasks(plan, job.resume_point))
                job.consumed_base = batches_done(plan, job.resume_point)
            job.flow = FlowControl(sequence, max_lead_batches=job.spec.lead_batches)
            logger.info(
                "job %s: planned %d train / %d eval samples, %d tasks",
                job.job_id, plan.num_train, plan.num_eval, plan.num_tasks,
            )  # fmt: skip

    async def _resume_point(self, job: JobRecord) -> ResumePoint | None:
        """The ResumePoint of a resumed job, from the checkpoint its ``resumed`` event names;
        None after publishing ``failed`` (unreadable or unusable) or when the store is
        unavailable (retry)."""
        assert job.resume is not None and job.spec is not None
        if job.resume_point is not None:
            return job.resume_point
        version = job.resume.checkpoint_version
        try:
            store = open_store(output_uri(job.spec, self.storage), self.storage)
            checkpoints = CheckpointStore(store, job.job_id)
            progress = await asyncio.to_thread(read_progress, checkpoints, version)
            job.resume_point = progress.resume_point(job.job_id)
        except (CheckpointError, ValueError) as exc:
            reason = f"cannot resume from checkpoint v{version}: {exc}"
            await self._publish_outcome(job, JobFailed(job_id=job.job_id, reason=reason))
        except StorageError as exc:
            if not exc.retriable:
                reason = f"cannot resume from checkpoint v{version}: {exc}"
                await self._publish_outcome(job, JobFailed(job_id=job.job_id, reason=reason))
            logger.warning("job %s: reading checkpoint v%d: %s", job.job_id, version, exc)
        return job.resume_point

    async def _make_plan(
        self, job: JobRecord
    ) -> tuple[JobPlan, tuple[int, int, int], AnyDataset] | None:
        """The plan and the opened dataset; None to retry later; _PlanFailed otherwise."""
        if job.spec is None:
            raise _PlanFailed(job.spec_error or "invalid job spec")
        # The gateway refused such specs already; this catches one put on the jobs topic
        # directly, before anything reads its dataset or trains towards its checkpoint place.
        refusals = await asyncio.to_thread(refused_locations, job.spec, self.storage)
        if refusals:
            raise _PlanFailed("; ".join(str(refusal) for refusal in refusals))
        uri = job.spec.dataset.uri
        timeout_s = self.settings.dataset_open_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                dataset = await asyncio.to_thread(open_dataset, uri, storage=self.storage)
        except TimeoutError:
            raise _PlanFailed(f"dataset {uri} did not open within {timeout_s:g}s") from None
        except DatasetError as exc:
            attempts = self._dataset_attempts.get(job.job_id, 0) + 1
            if exc.retriable and attempts < _MAX_DATASET_ATTEMPTS:
                self._dataset_attempts[job.job_id] = attempts
                logger.warning(
                    "job %s: dataset %s unavailable (%s); retrying", job.job_id, uri, exc
                )
                return None
            raise _PlanFailed(f"cannot read dataset {uri}: {exc}") from exc
        except Exception as exc:
            # A dataset library bug or a corrupt file it did not wrap: fail the job, keep serving.
            logger.exception("job %s: opening dataset %s failed", job.job_id, uri)
            raise _PlanFailed(f"cannot read dataset {uri}: {type(exc).__name__}: {exc}") from exc
        self._dataset_attempts.pop(job.job_id, None)
        preprocess = job.spec.preprocess
        try:
            plan = JobPlan.from_spec(job.job_id, job.spec, dataset.num_samples)
            # The shape the batches carry: the preprocessors decode and size images to it.
            shape = output_shape(
                dataset, image_size=preprocess.image_size, channels=preprocess.channels
            )
            num_classes = dataset.num_classes  # a token file's vocabulary may be unknown
        except (ValueError, DatasetError) as exc:
            raise _PlanFailed(f"cannot plan dataset {uri}: {exc}") from exc
        # Loaded by the warm-up at start (_load_model_builder); imported here in case it failed.
        from conveyor.training.slicing import build_job_model

        try:
            # Shapes only (meta device): an unknown option or a model whose state the gradient
            # plane cannot carry fails the job now rather than at training time.
            build_job_model(job.spec, num_classes=num_classes, sample_shape=shape, device="meta")
        except (ValueError, RuntimeError) as exc:
            raise _PlanFailed(f"cannot train model {job.spec.model.name!r}: {exc}") from exc
        return plan, shape, dataset

    def _planned(
        self, job: JobRecord, plan: JobPlan, shape: tuple[int, int, int], dataset: AnyDataset
    ) -> JobPlanned:
        assert job.spec is not None
        return JobPlanned(
            job_id=job.job_id,
            num_train=plan.num_train,
            num_eval=plan.num_eval,
            num_classes=dataset.num_classes,
            sample_shape=list(shape),
            train_batches_per_epoch=plan.train_batches_per_epoch,
            eval_batches_per_epoch=plan.eval_batches_per_epoch,
            # Versions: local mode closes one per window of sync_every_steps steps.
            steps_per_epoch=plan.steps_per_epoch(
                job.spec.micro_batches_per_step * (job.spec.distribution.sync_every_steps or 1)
            ),
            shards_per_epoch=plan.tasks_per_epoch,
            batches_topic=self.topics.batches(job.job_id, incarnation=job.incarnation),
            control_topic=self.topics.control(job.job_id, incarnation=job.incarnation),
            batches_partitions=self._batches_partitions(job),
        )

    def _batches_partitions(self, job: JobRecord) -> int:
        assert job.spec is not None
        # Sized for the most trainers the job may grow to: each needs partitions to read.
        return self.topology.batches_partitions(job.spec.distribution.trainer_bounds[2])

    async def _create_job_topics(self, job: JobRecord) -> None:
        assert self._admin is not None
        assert job.spec is not None
        await self._admin.create_topics(
            self.topics.job_topic_specs(
                job.job_id,
                batches_partitions=self._batches_partitions(job),
                slices=job.spec.distribution.aggregator_shards,
                incarnation=job.incarnation,
            )
        )

    # -- releasing -------------------------------------------------------------------------

    async def _release(self, job: JobRecord) -> None:
        plan, flow, spec, producer = job.plan, job.flow, job.spec, self._producer
        assert plan is not None and flow is not None and spec is not None and producer is not None
        tasks = flow.releasable(job.flow_consumed)
        if not tasks:
            return
        preprocess = spec.preprocess.model_dump(mode="json")
        # A routing for another partition count (a coordinator with another plan of the
        # job, a bug) would make preprocessors send to partitions that do not exist.
        partitions = self._batches_partitions(job)
        routing = job.routing if len(job.routing) == partitions else None
        if job.routing and not routing:
            logger.warning("job %s: ignoring a routing of %d partitions (topic has %d)",
                           job.job_id, len(job.routing), partitions)  # fmt: skip
        links = [Link(job.plan_span)] if job.plan_span is not None else []
        acks = []
        for task_index in tasks:
            shard = plan.task(job.plan_task(task_index))
            message = ShardTask(
                job_id=job.job_id,
                shard_id=shard.shard_id,
                epoch=shard.epoch,
                index=shard.index,
                split=shard.split,
                dataset_uri=spec.dataset.uri,
                sample_ids=shard.sample_ids,
                micro_batch_size=plan.micro_batch_size,
                seed=plan.seed,
                preprocess=preprocess,
                released_at=time.time(),
                partitions=shard_partitions(
                    shard.index * plan.max_shard_batches, shard.num_batches, routing, partitions
                ),
                incarnation=job.incarnation,
            )
            # Each shard starts its own trace (the one its batches follow), linked to the plan.
            with self._tracer.start_as_current_span(
                "release shard",
                context=otel_context.Context(),
                links=links,
                attributes={"conveyor.job_id": job.job_id, "conveyor.shard_id": shard.shard_id},
            ):
                acks.append(await producer.send(self.topics.shards, message, key=shard.shard_id))
        await asyncio.gather(*acks)
        flow.mark_released(tasks)
        self._released.inc(len(tasks))
        logger.debug("job %s: released tasks %d..%d", job.job_id, tasks.start, tasks.stop - 1)

    # -- outcomes --------------------------------------------------------------------------

    async def _finish(self, consumer: Consumer, jobs: list[JobRecord]) -> None:
        """Delete the topics of terminal jobs, forget them, ack their submitted records."""
        await self._delete_job_topics(jobs)
        for job in jobs:
            self.table.forget(job.job_id)
            self._dataset_attempts.pop(job.job_id, None)
            self._ended_at.pop(job.job_id, None)
            consumer.ack(job.submitted)
            logger.info("job %s: finished; topics deleted", job.job_id)

    async def _delete_job_topics(self, jobs: list[JobRecord]) -> None:
        assert self._admin is not None
        names: list[str] = []
        for job in jobs:
            # A job id no topic name can carry never had topics.
            with contextlib.suppress(ValueError):
                names.extend(self.topics.job_topics(job.job_id, incarnation=job.incarnation))
        await self._admin.delete_topics(names)

    async def _publish_outcome(self, job: JobRecord, event: JobFailed | JobCancelled) -> None:
        logger.warning("job %s: %s: %s", job.job_id, event.EVENT, event.reason)
        await self._publish(event)
        job.outcome_published = True

    async def _publish(self, event: JobEvent) -> None:
        assert self._producer is not None
        await self._producer.publish(self.topics.jobs, event, key=event.job_id)

    async def _publish_control(self, job: JobRecord, point: ResumePoint) -> None:
        assert self._producer is not None
        topic = self.topics.control(job.job_id, incarnation=job.incarnation)
        await self._producer.publish(topic, point)


def _lead(job: JobRecord) -> int:
    return 0 if job.flow is None else job.flow.lead_batches(job.flow_consumed)
