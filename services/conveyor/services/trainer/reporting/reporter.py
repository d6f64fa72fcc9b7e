"""A job's outbound reports: lifecycle events on the jobs topic, heartbeats on its control topic.

Heartbeats (every ``heartbeat_interval_s``) are the trainer's membership in the job and carry
the throughput the coordinator allocates micro-batches by. Progress events are this trainer's
own figures, sent only when something changed (or at once when asked, e.g. at an epoch end) and
rate-limited by an interval that grows with the time the trainer has been on the job
(:mod:`conveyor.training.cadence`: at a fixed 0.5 s a trainer wrote 7,200 progress events,
~4.5 MB, to the jobs topic per hour of training). Flow control is not the trainers' business
any more: the coordinator reports the job's consumed batches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka.structs import RecordMetadata

from conveyor.platform.bus import Producer
from conveyor.platform.messages import Heartbeat, JobEvent, TrainerProgress, TrainerState
from conveyor.training.cadence import progress_interval_s

logger = logging.getLogger(__name__)

_TICK_S = 0.1
"""Granularity of the periodic sends."""

Snapshot = Callable[[], dict[str, Any]]
"""The fields of this trainer's next progress event."""


class Reporter:
    """Publishes for one job; ``run()`` is the periodic part (until cancelled)."""

    def __init__(
        self,
        producer: Producer,
        *,
        jobs_topic: str,
        control_topic: str,
        job_id: str,
        worker_id: str,
        progress_interval_s: float,
        progress_max_interval_s: float,
        heartbeat_interval_s: float,
        progress: Snapshot,
        heartbeat: Callable[[], TrainerState],
        started_at: float | None = None,
    ) -> None:
        """``started_at``: when the trainer took the job (monotonic s; default now), from
        which the progress interval stretches."""
        self._producer = producer
        self._jobs_topic = jobs_topic
        self._control_topic = control_topic
        self.job_id = job_id
        self.worker_id = worker_id
        self._progress_interval_s = progress_interval_s
        self._progress_max_interval_s = progress_max_interval_s
        self._started_at = time.monotonic() if started_at is None else started_at
        self._heartbeat_interval_s = heartbeat_interval_s
        self._progress = progress
        self._heartbeat = heartbeat
        self._last_progress_at = float("-inf")
        self._last_heartbeat_at = float("-inf")
        self._last_key: tuple[Any, ...] | None = None
        self._urgent = False

    def request_progress(self) -> None:
        """Send a progress event at the next tick (epoch end, ...)."""
        self._urgent = True

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            if now - self._last_heartbeat_at >= self._heartbeat_interval_s:
                self._last_heartbeat_at = now
                await self.send_heartbeat()
            await self.maybe_send_progress(now)
            await asyncio.sleep(_TICK_S)

    async def maybe_send_progress(self, now: float) -> None:
        """Send a progress event if the numbers changed and one is due (or one was asked)."""
        if not self._urgent and now - self._last_progress_at < self.progress_interval_at(now):
            return  # before building the figures: this runs every tick, an event is rarer
        data = self._progress()
        key = (data.get("step"), data.get("epoch"), data.get("samples_trained"))
        if key == self._last_key and not self._urgent:
            return
        self._urgent = False
        self._last_key = key
        self._last_progress_at = now
        await self.send_event(TrainerProgress(job_id=self.job_id, worker_id=self.worker_id, **data))

    def progress_interval_at(self, now: float) -> float:
        """Least seconds between two progress events at ``now`` (monotonic s)."""
        return progress_interval_s(
            now - self._started_at,
            least_s=self._progress_interval_s,
            most_s=self._progress_max_interval_s,
        )

    async def send_heartbeat(self, *, leaving: bool = False) -> None:
        """Enqueue a heartbeat with the trainer's state now (``leaving``: its last one)."""
        message = Heartbeat(
            job_id=self.job_id,
            worker_id=self.worker_id,
            at=time.time(),
            state=self._heartbeat(),
            leaving=leaving,
        )
        ack = await self._producer.send(self._control_topic, message, key=self.worker_id)
        ack.add_done_callback(_log_failure)

    async def send_event(self, event: JobEvent) -> None:
        """Enqueue a job event (not waiting for the broker's ack; failures are logged)."""
        ack = await self._producer.send(self._jobs_topic, event, key=self.job_id)
        ack.add_done_callback(_log_failure)

    async def publish_event(self, event: JobEvent) -> None:
        """Publish a job event and wait until the broker has it."""
        await self._producer.publish(self._jobs_topic, event, key=self.job_id)


def _log_failure(ack: asyncio.Future[RecordMetadata]) -> None:
    if not ack.cancelled() and (exc := ack.exception()) is not None:
        logger.warning("a report was not delivered: %s", exc)
