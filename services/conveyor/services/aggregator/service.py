"""The aggregator service: serves the gradient plane of every running job.

The job host (:class:`~conveyor.training.jobhost.JobHostService`) waits for the jobs topic (the
sharder creates it), replays it (``/readyz`` turns 200 once caught up and the optimizer warm-up
is done) and keeps one :class:`JobAggregator` per planned, non-terminal job that was not asked
to cancel: it joins the job's aggregator group on the grads topic, so the processes share the
job's K slices and a rebalance moves a slice to a survivor. A job that turns terminal or is
asked to cancel is let go (its consumer leaves the group). A job that cannot be served (invalid
plan, a model with state the gradient plane cannot carry, a corrupt gradient slice) is
``failed`` with the reason; a retriable broker or storage failure serves the job again after a
backoff; any other error ends the process so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.storage import ObjectStore, open_store
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.job import JobContext, prepare_job, warm_up
from conveyor.services.aggregator.job_loop import JobAggregator
from conveyor.services.aggregator.metrics import AggregatorMetrics
from conveyor.training.jobhost import JobFailure, JobHostService
from conveyor.training.jobview import JobView
from conveyor.training.locations import output_uri

logger = logging.getLogger(__name__)


class AggregatorService(JobHostService[tuple[JobContext, ObjectStore]]):
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
        super().__init__(
            kafka=kafka,
            telemetry=telemetry,
            worker_id=settings.worker_id,
            retry_backoff_s=settings.retry_backoff_s,
        )
        self.settings = settings
        self.storage = storage
        self.metrics = AggregatorMetrics()
        self.job_aggregators: dict[str, JobAggregator] = {}
        """The JobAggregator serving each job now, by job id (tests look inside)."""
        self._warmed = False

    def readiness(self) -> bool:
        return super().readiness() and self._warmed

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._warm_up()]

    async def _warm_up(self) -> None:
        # A daemon thread rather than the loop's executor: the loop's executor is joined when
        # the loop closes, so a stop during the warm-up would wait seconds for torch's imports.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def work() -> None:
            warm_up()
            with contextlib.suppress(RuntimeError):  # the loop closed: the service stopped
                loop.call_soon_threadsafe(_resolve, done)

        threading.Thread(target=work, name="aggregator-warm-up", daemon=True).start()
        await done
        self._warmed = True

    async def prepare_job(self, job: JobView) -> tuple[JobContext, ObjectStore]:
        if job.plan is None:
            raise JobFailure("invalid job: it has no plan yet")
        ctx = await asyncio.to_thread(
            prepare_job, job.job_id, job.spec, job.plan, incarnation=job.incarnation
        )
        try:
            store = open_store(output_uri(ctx.spec, self.storage), self.storage)  # in the roots
        except ValueError as exc:
            raise JobFailure(str(exc)) from exc
        return ctx, store

    async def run_job(self, job: JobView, prepared: tuple[JobContext, ObjectStore]) -> None:
        ctx, store = prepared
        job_aggregator = JobAggregator(
            ctx,
            settings=self.settings,
            kafka=self.kafka,
            producer=self.producer,
            metrics=self.metrics,
            store=store,
            reported=lambda epoch: epoch in self._reported_epochs(job.job_id),
        )
        self.job_aggregators[job.job_id] = job_aggregator
        self.metrics.served_jobs.set(len(self.job_aggregators))
        logger.info("job %s: serving its gradient plane", job.job_id)
        try:
            await job_aggregator.run()
        finally:
            self.job_aggregators.pop(job.job_id, None)
            self.metrics.served_jobs.set(len(self.job_aggregators))

    def _reported_epochs(self, job_id: str) -> dict[int, Any]:
        job = self.view.get(job_id)
        return job.epochs if job is not None else {}


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled when the service stopped first
        future.set_result(None)
