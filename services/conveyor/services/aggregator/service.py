"""The aggregator service: serves the gradient plane of every running job.

Lifecycle (``run``): wait for the jobs topic (the sharder creates it), replay it into a
:class:`JobsView` (``/readyz`` turns 200 once caught up), then keep one :class:`JobAggregator` task
per planned, non-terminal job that was not asked to cancel: it joins the job's aggregator group on
the grads topic, so the processes share the job's K slices and a rebalance moves a slice to a
survivor. A job that turns terminal or is asked to cancel is let go (its consumer leaves the group).
A job that cannot be served (invalid plan, a model with buffers, a corrupt gradient slice) is
``failed`` with the reason; a retriable broker or storage failure serves the job again after a
backoff; any other error ends the process so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from conveyor.platform.bus import Producer, wait_for_topics
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.messages import JobEvent, Topics
from conveyor.platform.service import Service
from conveyor.platform.storage import open_store
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.job import JobFailed, prepare_job, warm_up
from conveyor.services.aggregator.job_loop import JobAggregator
from conveyor.services.aggregator.metrics import AggregatorMetrics
from conveyor.training.jobview import JobLogReader, JobsView, JobView

logger = logging.getLogger(__name__)

_RECONCILE_S = 1.0
_SERVABLE = frozenset({"planned", "running"})


class AggregatorService(Service):
    """One aggregator process. Ready once the jobs topic has been replayed."""

    name = "aggregator"

    def __init__(
        self,
        *,
        settings: AggregatorSettings,
        kafka: KafkaSettings,
        storage: StorageSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        super().__init__(telemetry=telemetry)
        self.settings = settings
        self.kafka = kafka
        self.storage = storage
        self.topics = Topics(kafka.topic_prefix)
        self.metrics = AggregatorMetrics()
        self.view = JobsView()
        self.job_aggregators: dict[str, JobAggregator] = {}
        """The JobAggregator serving each job now, by job id (tests look inside)."""
        self._reader: JobLogReader | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._finished: set[str] = set()
        self._changed = asyncio.Event()
        self._warmed = False

    def readiness(self) -> bool:
        ready = super().readiness() and self._reader is not None and self._reader.ready
        return ready and self._warmed

    async def run(self) -> None:
        reader = JobLogReader(
            self.kafka,
            self.topics.jobs,
            self.view,
            service="aggregator",
            on_applied=lambda job, event: self._changed.set(),
        )
        await wait_for_topics(self.kafka, [self.topics.jobs])
        await reader.start()
        try:
            async with Producer(self.kafka) as producer, asyncio.TaskGroup() as group:
                group.create_task(reader.run(), name="aggregator.jobs")
                group.create_task(self._warm_up(), name="aggregator.warm_up")
                self._reader = reader
                await reader.wait_ready()
                while True:
                    self._changed.clear()
                    self._reconcile(producer)
                    self.metrics.served_jobs.set(len(self._tasks))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), _RECONCILE_S)
        finally:
            await self._stop_jobs()
            await reader.stop()

    async def _warm_up(self) -> None:
        await asyncio.to_thread(warm_up)
        self._warmed = True

    async def drain(self) -> None:
        # Leave every job's group now, so the slices move to the other aggregators at once.
        await self._stop_jobs()

    def _reconcile(self, producer: Producer) -> None:
        for job_id, task in list(self._tasks.items()):
            job = self.view.get(job_id)
            if task.done():
                del self._tasks[job_id]
                self.job_aggregators.pop(job_id, None)
                failure = None if task.cancelled() else task.exception()
                if failure is not None:
                    raise failure
            elif (job is None or not self._servable(job)) and not task.cancelling():
                # Once: a second cancel would cut its consumer's stop short (left unclosed).
                logger.info("job %s: %s; letting it go", job_id, job.state if job else "gone")
                task.cancel()
        for job in self.view.list(limit=len(self.view) or 1):
            serving = job.job_id in self._tasks or job.job_id in self._finished
            if not serving and self._servable(job):
                self._tasks[job.job_id] = asyncio.create_task(
                    self._serve(job, producer), name=f"aggregator.job.{job.job_id}"
                )

    @staticmethod
    def _servable(job: JobView) -> bool:
        return job.state in _SERVABLE and job.plan is not None and not job.cancel_requested

    async def _serve(self, job: JobView, producer: Producer) -> None:
        job_id = job.job_id
        try:
            ctx = await asyncio.to_thread(prepare_job, job_id, job.spec, dict(job.plan or {}))
            store = open_store(ctx.spec.checkpoint.uri or self.storage.uri, self.storage)
        except (JobFailed, ValueError) as exc:
            await self._fail(producer, job_id, str(exc))
            return
        while True:
            job_aggregator = JobAggregator(
                ctx,
                settings=self.settings,
                kafka=self.kafka,
                producer=producer,
                metrics=self.metrics,
                store=store,
                reported=lambda epoch: epoch in self._reported_epochs(job_id),
            )
            self.job_aggregators[job_id] = job_aggregator
            logger.info("job %s: serving its gradient plane", job_id)
            try:
                await job_aggregator.run()
                return
            except JobFailed as exc:
                await self._fail(producer, job_id, str(exc))
                return
            except Exception as exc:
                logger.warning("job %s: %s: %s", job_id, type(exc).__name__, exc)
                # A job that just ended has its topics deleted under its JobAggregator: wait for
                # the jobs topic to say so before calling the error a failure.
                await asyncio.sleep(self.settings.retry_backoff_s)
                current = self.view.get(job_id)
                if current is None or not self._servable(current):
                    logger.info("job %s: ended meanwhile", job_id)
                    return
                if not getattr(exc, "retriable", False):
                    raise
                logger.info("job %s: serving it again", job_id)
            finally:
                self.job_aggregators.pop(job_id, None)

    def _reported_epochs(self, job_id: str) -> dict[int, Any]:
        job = self.view.get(job_id)
        return job.epochs if job is not None else {}

    async def _fail(self, producer: Producer, job_id: str, reason: str) -> None:
        logger.warning("job %s failed: %s", job_id, reason)
        self._finished.add(job_id)
        message = JobEvent(
            job_id=job_id,
            event="failed",
            at=time.time(),
            data={"reason": reason, "worker_id": self.settings.worker_id},
        )
        await producer.publish(self.topics.jobs, message, key=job_id)

    async def _stop_jobs(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            if not task.cancelling():  # a job let go is leaving already: let it finish
                task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                logger.error("%s failed while stopping", task.get_name(), exc_info=failure)
        self._tasks.clear()
