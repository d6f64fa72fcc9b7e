"""The trainer service: watch the jobs, join one at a time, train it, go idle, repeat.

Lifecycle (``run``): wait for the jobs topic (the sharder creates it), replay it (``/readyz`` turns
200 once caught up), then loop: take the oldest joinable job, build its model (a job that cannot be
built is ``failed``), train it with a :class:`JobRunner` until the job turns terminal (the
coordinator publishes ``completed``) or a cancel is requested (then stop, leave the group, publish
``cancelled``), and go back to waiting. A retriable broker failure rejoins the job after a backoff
(nothing is lost: the trainer holds no training state, and unacknowledged batches are redelivered);
any other unexpected error crashes the process so that its supervisor restarts it. A stop (SIGTERM)
leaves the job (a ``leaving`` heartbeat tells the coordinator).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from conveyor.platform.bus import Producer, wait_for_topics
from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.messages import JobEvent, Topics
from conveyor.platform.service import Service
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.jobwatch import JobWatcher
from conveyor.services.trainer.metrics import TrainerMetrics
from conveyor.services.trainer.runner import JobRunner
from conveyor.services.trainer.session import JobFailed, prepare_job
from conveyor.training.jobview import JobView

logger = logging.getLogger(__name__)


class TrainerService(Service):
    """One trainer process. Ready once the jobs topic has been replayed."""

    name = "trainer"

    def __init__(
        self,
        *,
        settings: TrainerSettings,
        kafka: KafkaSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        super().__init__(telemetry=telemetry, drain_timeout_s=settings.drain_timeout_s)
        self.settings = settings
        self.kafka = kafka
        self.topics = Topics(kafka.topic_prefix)
        self.metrics = TrainerMetrics()
        self._watcher: JobWatcher | None = None
        self._finished: set[str] = set()
        self._job_task: asyncio.Task[None] | None = None
        self._current_job: str | None = None

    @property
    def current_job(self) -> str | None:
        """Id of the job this trainer trains now; None while idle."""
        return self._current_job

    def readiness(self) -> bool:
        return super().readiness() and self._watcher is not None and self._watcher.ready

    async def run(self) -> None:
        watcher = JobWatcher(self.kafka, self.topics)
        await wait_for_topics(self.kafka, [self.topics.jobs])
        await watcher.start()
        compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        copy = ThreadPoolExecutor(1, thread_name_prefix="trainer-h2d")
        try:
            self._watcher = watcher
            async with Producer(self.kafka) as producer, asyncio.TaskGroup() as group:
                # A failure of the watcher cancels this body and ends run() with its error.
                watching = group.create_task(watcher.run(), name="trainer.jobwatch")
                while not self.stopping:
                    job = await watcher.next_job(skip=self._finished)
                    await self._run_job(job, watcher, producer, compute, copy)
                watching.cancel()
        finally:
            await watcher.stop()
            compute.shutdown(wait=False, cancel_futures=True)
            copy.shutdown(wait=False, cancel_futures=True)

    async def drain(self) -> None:
        # Cancelling the job makes its runner leave it (acked batches committed, the rest are
        # redelivered to the other trainers).
        task = self._job_task
        if task is not None and not task.done():
            # A job that just ended is already being cancelled (its runner is leaving: a
            # second cancel would cut that short and leave its batches consumer unclosed).
            if not task.cancelling():
                task.cancel()
            await asyncio.wait({task})

    async def _run_job(
        self,
        job: JobView,
        watcher: JobWatcher,
        producer: Producer,
        compute: ThreadPoolExecutor,
        copy: ThreadPoolExecutor,
    ) -> None:
        job_id = job.job_id
        logger.info("joining job %s (%s)", job_id, job.name)
        loop = asyncio.get_running_loop()
        try:
            session = await loop.run_in_executor(
                compute, prepare_job, job, self.settings, self.topics
            )
        except JobFailed as exc:
            await self._finish(producer, job_id, "failed", str(exc))
            return
        runner = JobRunner(
            session,
            settings=self.settings,
            kafka=self.kafka,
            producer=producer,
            metrics=self.metrics,
            compute_executor=compute,
            copy_executor=copy,
        )
        task = self._job_task = asyncio.create_task(runner.run(), name=f"trainer.job.{job_id}")
        self._current_job = job_id
        stop = asyncio.create_task(watcher.wait_stop(job_id))
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                if not task.cancelling():  # a stop may have cancelled it already (drain)
                    task.cancel()
                await asyncio.wait({task})
            self._job_task = self._current_job = None
        await self._settle(task, watcher, producer, job_id)

    async def _settle(
        self,
        task: asyncio.Task[None],
        watcher: JobWatcher,
        producer: Producer,
        job_id: str,
    ) -> None:
        """Decide what a finished job task means for the job."""
        if task.cancelled():
            reason = watcher.stop_reason(job_id)
            if reason == "cancel requested":
                await self._finish(producer, job_id, "cancelled", reason)
            elif reason is not None:
                self._finished.add(job_id)
                logger.info("left job %s: %s", job_id, reason)
            return  # else: this process is stopping
        exc = task.exception()
        if exc is None:  # a runner only returns when cancelled; defensive: never rejoin
            self._finished.add(job_id)
        elif isinstance(exc, JobFailed):
            await self._finish(producer, job_id, "failed", str(exc))
        elif getattr(exc, "retriable", False):
            logger.warning(
                "job %s interrupted by a retriable failure; rejoining in %.1fs",
                job_id, self.settings.retry_backoff_s, exc_info=exc,
            )  # fmt: skip
            await asyncio.sleep(self.settings.retry_backoff_s)
        elif (reason := await self._ended_meanwhile(watcher, job_id)) is not None:
            # A job that ended as this trainer joined has its topics deleted under it.
            self._finished.add(job_id)
            logger.info("left job %s: %s (%s: %s)", job_id, reason, type(exc).__name__, exc)
        else:
            raise exc

    async def _ended_meanwhile(self, watcher: JobWatcher, job_id: str) -> str | None:
        """Why ``job_id`` should be left, waiting up to ``retry_backoff_s`` for the jobs topic
        to say so; None when it goes on."""
        try:
            async with asyncio.timeout(self.settings.retry_backoff_s):
                return await watcher.wait_stop(job_id)
        except TimeoutError:
            return None

    async def _finish(self, producer: Producer, job_id: str, event: str, reason: str) -> None:
        """Publish a terminal event for ``job_id`` and never join it again."""
        logger.warning("job %s %s: %s", job_id, event, reason)
        message = JobEvent(
            job_id=job_id,
            event=event,
            at=time.time(),
            data={"reason": reason, "worker_id": self.settings.worker_id},
        )
        await producer.publish(self.topics.jobs, message, key=job_id)
        self._finished.add(job_id)
