"""The trainer service: host the job the schedule places it on, one at a time, and train it.

The job host (:class:`~conveyor.training.jobhost.JobHostService`) waits for the jobs topic (the
sharder creates it), replays it (``/readyz`` turns 200 once caught up), takes the job that the
schedule (:mod:`conveyor.training.scheduling`, computed alike by every trainer from the jobs
topic) places this trainer on, lets it go when the schedule moves the trainer elsewhere, and
decides what the end of the work means: a job that cannot be built or
trained is ``failed``; a cancel request makes the trainer leave the job (its acknowledged
batches committed, the rest redelivered) and publish ``cancelled``; a retriable broker failure
rejoins the job after a backoff (nothing is lost: the trainer holds no training state); any
other error crashes the process so that its supervisor restarts it. A stop (SIGTERM) leaves the
job (a ``leaving`` heartbeat tells the coordinator).

The trainer's :class:`TrainerPresence` on the jobs topic puts it in the pool: one at start,
one whenever the job it hosts changes, one every third of ``presence_ttl_s``, and a
``leaving`` one when it stops (before it lets its job go, so that another takes its place).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from typing import Any, ClassVar

from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.messages import TrainerPresence
from conveyor.services.trainer.compute.session import JobSession, prepare_job
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.reporting.metrics import TrainerMetrics
from conveyor.services.trainer.runner import JobRunner
from conveyor.training.jobhost import JobHostService
from conveyor.training.jobview import JobView

_PRESENCE_CHECK_S = 0.2
"""How often the presence loop looks for a change of the hosted job."""


class TrainerService(JobHostService[JobSession]):
    """One trainer process. Ready once the jobs topic has been replayed."""

    name = "trainer"
    max_jobs: ClassVar[int | None] = 1
    publishes_cancelled: ClassVar[bool] = True

    def __init__(
        self,
        *,
        settings: TrainerSettings,
        kafka: KafkaSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        super().__init__(
            kafka=kafka,
            telemetry=telemetry,
            worker_id=settings.worker_id,
            retry_backoff_s=settings.retry_backoff_s,
            drain_timeout_s=settings.drain_timeout_s,
        )
        self.settings = settings
        self.metrics = TrainerMetrics()
        self._compute: ThreadPoolExecutor | None = None
        self._copy: ThreadPoolExecutor | None = None
        self._leaving = False

    @property
    def current_job(self) -> str | None:
        """Id of the job this trainer trains now; None while idle."""
        hosted = self.hosted_jobs
        return hosted[0] if hosted else None

    async def setup(self, resources: AsyncExitStack) -> None:
        # One compute thread (model compute stays off the event loop) and one copy thread
        # (host-to-device), shared by the jobs this process trains one after another.
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="trainer-h2d")
        for executor in (self._compute, self._copy):
            resources.callback(executor.shutdown, wait=False, cancel_futures=True)

    def wants(self, job: JobView) -> bool:
        return self.view.schedule().placement.get(self.worker_id) == job.job_id

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._announce_presence()]

    async def drain(self) -> None:
        if not self._leaving and self._producer is not None:  # out of the pool first
            self._leaving = True
            await self._say_presence(leaving=True)
        await super().drain()

    async def _announce_presence(self) -> None:
        """Publish the trainer's presence at start, on a change of job and every ttl / 3."""
        said: tuple[str | None, float] | None = None
        while not self._leaving:
            job_id, now = self.current_job, time.monotonic()
            if (
                said is None
                or said[0] != job_id
                or now - said[1] >= self.settings.presence_ttl_s / 3
            ):
                await self._say_presence(leaving=False)
                said = (job_id, now)
            await asyncio.sleep(_PRESENCE_CHECK_S)

    async def _say_presence(self, *, leaving: bool) -> None:
        presence = TrainerPresence(
            worker_id=self.worker_id,
            job_id=self.current_job,
            ttl_s=self.settings.presence_ttl_s,
            leaving=leaving,
        )
        await self.producer.publish(self.topics.jobs, presence, key=self.worker_id)

    async def prepare_job(self, job: JobView) -> JobSession:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._compute, prepare_job, job, self.settings, self.topics
        )

    async def run_job(self, job: JobView, prepared: JobSession) -> None:
        assert self._compute is not None and self._copy is not None
        runner = JobRunner(
            prepared,
            settings=self.settings,
            kafka=self.kafka,
            producer=self.producer,
            metrics=self.metrics,
            compute_executor=self._compute,
            copy_executor=self._copy,
            placed_trainers=lambda: self.view.schedule().trainers_of(job.job_id),
        )
        await runner.run()
