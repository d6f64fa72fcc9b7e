"""The job host: what the services that work on jobs (trainer, aggregator) share.

A :class:`JobHostService` waits for ``conveyor.jobs`` (the sharder creates it), replays it into
a :class:`JobsView` (``/readyz`` turns 200 once caught up), then keeps one task per job it
hosts: the oldest servable jobs first (planned or running, not terminal, not asked to cancel)
that it :meth:`~JobHostService.wants` (the trainer: those the schedule places it on), at most
``max_jobs`` at once. A task prepares the job in a thread
(:meth:`~JobHostService.prepare_job`, again for every attempt) and runs it
(:meth:`~JobHostService.run_job`) until the job turns terminal, a cancel is requested or the
host stops wanting it; then the host lets it go (cancels the task once; the subclass's work
leaves its consumer groups).

What a task's end means, the same for every host:

- ``run_job`` returned: the work is done; the job is not taken again.
- :class:`JobFailure` (from either hook): the host publishes :class:`JobFailed` with the
  reason and does not take the job again.
- Any other error: the host waits up to ``retry_backoff_s`` for the jobs topic to say the job
  ended (its topics are deleted under the work when it does; then the job is simply done).
  Otherwise a retriable error (``retriable = True`` on the class: broker, storage) runs the
  job again; anything else ends the process (``run()`` raises) so that its supervisor
  restarts it.
- Let go because a cancel was requested: hosts with ``publishes_cancelled`` publish
  :class:`JobCancelled` (the trainer: it is what the user waits for).

A stop (SIGTERM) cancels every job task during the drain and waits for them.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Any, ClassVar, Generic, TypeVar

from conveyor.platform.awaiting import await_chain
from conveyor.platform.bus import Producer, wait_for_topics
from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.errors import ConveyorError
from conveyor.platform.messages import JobCancelled, JobFailed, Topics
from conveyor.platform.service import Service
from conveyor.training.joblog import JobLogReader
from conveyor.training.jobview import JobsView, JobView

logger = logging.getLogger(__name__)

Prepared = TypeVar("Prepared")

_RECONCILE_S = 1.0
"""Longest pause between two passes over the jobs (a change wakes the host at once)."""
_SLOW_STOP_S = 10.0
"""A job task still leaving after this long is logged with what it awaits."""


class JobFailure(ConveyorError):
    """The job cannot go on (invalid spec or plan, a model that cannot be built, a corrupt
    gradient, ...); ``str(exc)`` is the reason published with :class:`JobFailed`."""

    retriable: ClassVar[bool] = False


class JobHostService(Service, Generic[Prepared]):
    """A service that hosts jobs; subclasses provide :meth:`prepare_job` and :meth:`run_job`.

    ``worker_id`` names this process in the events it publishes; ``retry_backoff_s`` is the
    pause before a job is run again after a retriable failure (and the longest wait for the
    jobs topic to say that a failing job ended).
    """

    max_jobs: ClassVar[int | None] = None
    """Jobs hosted at once (None: every servable job)."""
    publishes_cancelled: ClassVar[bool] = False
    """Publish :class:`JobCancelled` when a job is let go because of a cancel request."""
    needs_ended_specs: ClassVar[bool] = False
    """Keep an ended job's spec in :attr:`view` (work done after a job ends needs it)."""

    def __init__(
        self,
        *,
        kafka: KafkaSettings,
        telemetry: TelemetrySettings,
        worker_id: str,
        retry_backoff_s: float,
        drain_timeout_s: float = 20.0,
    ) -> None:
        super().__init__(telemetry=telemetry, drain_timeout_s=drain_timeout_s)
        self.kafka = kafka
        self.topics = Topics(kafka.topic_prefix)
        self.worker_id = worker_id
        self.retry_backoff_s = retry_backoff_s
        self.view = JobsView(serving=False, ended_specs=self.needs_ended_specs)
        """Every job, folded from the jobs topic."""
        self._reader: JobLogReader | None = None
        self._producer: Producer | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._finished: set[tuple[str, int]] = set()
        """(job id, incarnation) of the work done: a resumed job is taken again."""
        self._changed = asyncio.Event()
        """Set on every applied event and finished task: wakes the reconcile loop."""
        self._waiters: set[asyncio.Event] = set()
        self._view_ready = asyncio.Event()

    # -- what subclasses provide ---------------------------------------------------------

    @abc.abstractmethod
    async def prepare_job(self, job: JobView) -> Prepared:
        """Build what the job needs (off the event loop: a thread). Raises JobFailure."""

    @abc.abstractmethod
    async def run_job(self, job: JobView, prepared: Prepared) -> None:
        """Work on the job until it is done (return) or cancelled (let go, or stopping).

        Raises JobFailure when the job cannot go on; other errors follow the module's rules.
        """

    async def setup(self, resources: AsyncExitStack) -> None:
        """Acquire what every job shares (executors, ...); released by ``resources`` when
        ``run()`` ends. Default: nothing."""

    def wants(self, job: JobView) -> bool:
        """Whether this process should work on a servable job now (re-asked on every change of
        the view; a hosted job it stops wanting is let go and may be taken again later).
        Default: every job, oldest first, up to ``max_jobs``."""
        return True

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """Coroutines that run beside the jobs for the life of ``run()`` (a warm-up, ...);
        one that raises ends the service. Default: none."""
        return []

    # -- state -----------------------------------------------------------------------------

    @property
    def producer(self) -> Producer:
        """The process's producer (available while ``run()`` runs)."""
        if self._producer is None:
            raise RuntimeError(f"{self.name}: the producer exists only while run() runs")
        return self._producer

    @property
    def hosted_jobs(self) -> list[str]:
        """Ids of the jobs with a task now, oldest first."""
        return list(self._tasks)

    def readiness(self) -> bool:
        return super().readiness() and self._reader is not None and self._reader.ready

    async def view_ready(self) -> None:
        """Wait until the view holds the jobs topic as it was at start (background work)."""
        await self._view_ready.wait()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        reader = JobLogReader(
            self.kafka,
            self.topics.jobs,
            self.view,
            service=self.name,
            on_applied=lambda job, event: self._wake(),
            on_presence=self._wake,
        )
        await self._open(reader)
        try:
            async with AsyncExitStack() as resources, asyncio.TaskGroup() as group:
                self._producer = await resources.enter_async_context(Producer(self.kafka))
                await self.setup(resources)
                group.create_task(reader.run(), name=f"{self.name}.jobs")
                for work in self.background():
                    group.create_task(work)
                self._reader = reader
                await reader.wait_ready()
                self._view_ready.set()
                while True:
                    self._changed.clear()
                    await self._reconcile()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_RECONCILE_S):
                            await self._changed.wait()
        finally:
            await self._stop_jobs()
            await reader.stop()
            self._producer = None

    async def drain(self) -> None:
        # Let every job go now: the work leaves its groups, so the other processes take over.
        await self._stop_jobs()

    async def _open(self, reader: JobLogReader) -> None:
        # The sharder owns the topology: wait for it to create the jobs topic.
        await wait_for_topics(self.kafka, [self.topics.jobs])
        await reader.start()

    # -- hosting ---------------------------------------------------------------------------

    def _servable(self, job: JobView | None) -> bool:
        return job is not None and job.servable

    async def _reconcile(self) -> None:
        for job_id, task in list(self._tasks.items()):
            job = self.view.get(job_id)
            if task.done():
                del self._tasks[job_id]
                await self._settle(job_id, task)
            elif not task.cancelling() and not (job is not None and self._keeps(job)):
                # Once: a second cancel would cut the work's own stop short.
                why = "not placed here" if self._servable(job) else job.state if job else "gone"
                logger.info("job %s: %s; letting it go", job_id, why)
                task.cancel()
        for job in reversed(self.view.unfinished()):  # oldest first; an ended job is not kept
            if self.max_jobs is not None and len(self._tasks) >= self.max_jobs:
                break
            taken = job.job_id in self._tasks or (job.job_id, job.incarnation) in self._finished
            if not taken and self._keeps(job) and not self.stopping:
                task = asyncio.create_task(self._host(job), name=f"{self.name}.job.{job.job_id}")
                task.add_done_callback(lambda _: self._wake())
                self._tasks[job.job_id] = task

    def _keeps(self, job: JobView) -> bool:
        return self._servable(job) and self.wants(job)

    async def _settle(self, job_id: str, task: asyncio.Task[None]) -> None:
        """What a finished job task means (see the module docstring)."""
        if not task.cancelled():
            task.result()  # an error _host did not handle ends run(): the process restarts
            return
        job = self.view.get(job_id)
        if job is None or self.stopping:
            return
        if job.cancel_requested and not job.terminal and self.publishes_cancelled:
            await self._publish(JobCancelled(
                job_id=job_id, reason="cancel requested", worker_id=self.worker_id
            ))  # fmt: skip
        if job.cancel_requested or job.terminal:
            self._finished.add((job_id, job.incarnation))
            logger.info("left job %s: %s", job_id, job.state)

    async def _host(self, job: JobView) -> None:
        """Prepare and run one job, retrying what may be retried (see the module docstring)."""
        logger.info("job %s (%s): taking it", job.job_id, job.name)
        try:
            while True:
                # Prepared again for every attempt: a retry starts from a clean state.
                prepared = await self.prepare_job(job)
                try:
                    await self.run_job(job, prepared)
                    break
                except JobFailure:
                    raise
                except Exception as exc:
                    logger.warning("job %s: %s: %s", job.job_id, type(exc).__name__, exc)
                    if await self._ended_meanwhile(job.job_id):
                        logger.info("job %s: ended meanwhile", job.job_id)
                        break
                    if not getattr(exc, "retriable", False):
                        raise
                    logger.info("job %s: running it again", job.job_id)
        except JobFailure as exc:
            await self._publish(
                JobFailed(job_id=job.job_id, reason=str(exc), worker_id=self.worker_id)
            )
        self._finished.add((job.job_id, job.incarnation))

    def _wake(self) -> None:
        self._changed.set()
        for waiter in self._waiters:
            waiter.set()

    async def _ended_meanwhile(self, job_id: str) -> bool:
        """Wait up to ``retry_backoff_s`` for the job to stop being servable; True if it did."""
        changed = asyncio.Event()
        self._waiters.add(changed)
        try:
            async with asyncio.timeout(self.retry_backoff_s):
                while self._servable(self.view.get(job_id)):
                    changed.clear()
                    await changed.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(changed)

    async def _publish(self, event: JobFailed | JobCancelled) -> None:
        logger.warning("job %s %s: %s", event.job_id, event.EVENT, event.reason)
        await self.producer.publish(self.topics.jobs, event, key=event.job_id)
        job = self.view.get(event.job_id)
        self._finished.add((event.job_id, job.incarnation if job is not None else 0))

    async def _stop_jobs(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            if not task.cancelling():  # a job let go is leaving already: let it finish
                task.cancel()
        if tasks:
            _, slow = await asyncio.wait(tasks, timeout=_SLOW_STOP_S)
            for task in slow:
                logger.warning(
                    "%s: still leaving after %.0fs; it awaits:\n  %s",
                    task.get_name(), _SLOW_STOP_S, "\n  ".join(await_chain(task)),
                )  # fmt: skip
            if slow:
                await asyncio.wait(slow)
        for task in tasks:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                logger.error("%s failed while stopping", task.get_name(), exc_info=failure)
        self._tasks.clear()
