"""The trainer service: host one job at a time (the oldest servable one) and train it.

The job host (:class:`~conveyor.training.jobhost.JobHostService`) waits for the jobs topic (the
sharder creates it), replays it (``/readyz`` turns 200 once caught up), takes the oldest planned
or running job, and decides what the end of the work means: a job that cannot be built or
trained is ``failed``; a cancel request makes the trainer leave the job (its acknowledged
batches committed, the rest redelivered) and publish ``cancelled``; a retriable broker failure
rejoins the job after a backoff (nothing is lost: the trainer holds no training state); any
other error crashes the process so that its supervisor restarts it. A stop (SIGTERM) leaves the
job (a ``leaving`` heartbeat tells the coordinator).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from typing import ClassVar

from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.services.trainer.compute.session import JobSession, prepare_job
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.reporting.metrics import TrainerMetrics
from conveyor.services.trainer.runner import JobRunner
from conveyor.training.jobhost import JobHostService
from conveyor.training.jobview import JobView


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
        )
        await runner.run()
