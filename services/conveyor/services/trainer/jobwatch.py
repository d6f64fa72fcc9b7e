"""Which job to join: the fold of ``conveyor.jobs``.

A trainer joins a job that is planned (or already running: a restarted trainer resumes it),
not terminal and not asked to cancel; the oldest submission first. It leaves when the job turns
terminal or a cancel is requested (:meth:`JobWatcher.wait_stop`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container

from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import JobEvent, Topics
from conveyor.training.jobview import JobLogReader, JobsView, JobView

logger = logging.getLogger(__name__)

_JOINABLE = frozenset({"planned", "running"})


class JobWatcher:
    """Tails the jobs topic into a :class:`JobsView` and answers the trainer's questions.

    ``start()`` then ``run()`` (until cancelled; broker failures raise ``BusError``), ``stop()``.
    """

    def __init__(self, settings: KafkaSettings, topics: Topics) -> None:
        self.view = JobsView()
        self._reader = JobLogReader(
            settings, topics.jobs, self.view, service="trainer", on_applied=self._on_applied
        )
        self._changed = asyncio.Event()

    @property
    def ready(self) -> bool:
        """True once the log was replayed up to its end at start."""
        return self._reader.ready

    async def start(self) -> None:
        await self._reader.start()

    async def run(self) -> None:
        await self._reader.run()

    async def stop(self) -> None:
        await self._reader.stop()

    async def next_job(self, skip: Container[str] = ()) -> JobView:
        """The oldest joinable job whose id is not in ``skip``; waits for one."""
        await self._reader.wait_ready()
        while True:
            changed = self._changed  # a change replaces it, so no wake-up is missed
            for job in reversed(self.view.list(limit=len(self.view) or 1)):
                if job.job_id not in skip and self._joinable(job):
                    return job
            await changed.wait()

    def stop_reason(self, job_id: str) -> str | None:
        """Why a trainer of ``job_id`` should leave it now, or None to keep going."""
        job = self.view.get(job_id)
        if job is None:
            return None
        if job.terminal:
            return f"job is {job.state}"
        if job.cancel_requested:
            return "cancel requested"
        return None

    async def wait_stop(self, job_id: str) -> str:
        """Wait until :meth:`stop_reason` gives a reason, and return it."""
        while True:
            changed = self._changed  # a change replaces it, so no wake-up is missed
            reason = self.stop_reason(job_id)
            if reason is not None:
                return reason
            await changed.wait()

    @staticmethod
    def _joinable(job: JobView) -> bool:
        return job.state in _JOINABLE and job.plan is not None and not job.cancel_requested

    def _on_applied(self, job: JobView, event: JobEvent) -> None:
        # One event per generation: every waiter sees a change, whoever wakes first.
        previous, self._changed = self._changed, asyncio.Event()
        previous.set()
