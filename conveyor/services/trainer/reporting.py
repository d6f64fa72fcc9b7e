"""A job's outbound reports: lifecycle events on the jobs topic, heartbeats on its control topic.

Progress events are rate-limited to one per ``progress_interval_s`` while the step loop is
busy. Because the sharder releases new shards only when it sees ``consumed_batches`` rise, a
changed count goes out within a tick (0.1 s) when the step loop waits for data, when asked (an
epoch end), and whenever a quarter of the job's lead was consumed since the last report (so
new shards are on their way before the trainer runs dry).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka.structs import RecordMetadata

from conveyor.libs.bus import Producer
from conveyor.libs.messages import Heartbeat, JobEvent

logger = logging.getLogger(__name__)

_TICK_S = 0.1
"""Longest delay of a progress event while the step loop waits, or after an epoch end."""

Snapshot = Callable[[], dict[str, Any]]


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
        heartbeat_interval_s: float,
        lead_batches: int,
        progress: Snapshot,
        heartbeat: Snapshot,
        waiting: Callable[[], bool],
    ) -> None:
        self._producer = producer
        self._jobs_topic = jobs_topic
        self._control_topic = control_topic
        self.job_id = job_id
        self.worker_id = worker_id
        self._progress_interval_s = progress_interval_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._progress = progress
        self._heartbeat = heartbeat
        self._waiting = waiting
        self._last_progress_at = float("-inf")
        self._last_heartbeat_at = float("-inf")
        self._last_key: tuple[Any, ...] | None = None
        self._last_consumed = 0
        self._consumed_step = max(1, lead_batches // 4)
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
        """Send a progress event if the numbers changed and one is due."""
        data = self._progress()
        key = (data.get("consumed_batches"), data.get("step"), data.get("epoch"))
        if key == self._last_key and not self._urgent:
            return
        consumed = int(data.get("consumed_batches") or 0)
        due = now - self._last_progress_at >= self._progress_interval_s
        flow = consumed - self._last_consumed >= self._consumed_step
        if not (due or flow or self._urgent or self._waiting()):
            return
        self._urgent = False
        self._last_key = key
        self._last_consumed = consumed
        self._last_progress_at = now
        await self.send_event("progress", {"worker_id": self.worker_id, **data})

    async def send_heartbeat(self) -> None:
        message = Heartbeat(
            job_id=self.job_id,
            worker_id=self.worker_id,
            role="trainer",
            at=time.time(),
            info=self._heartbeat(),
        )
        ack = await self._producer.send(self._control_topic, message, key=self.worker_id)
        ack.add_done_callback(_log_failure)

    async def send_event(self, event: str, data: dict[str, Any]) -> None:
        """Enqueue a job event (not waiting for the broker's ack; failures are logged)."""
        ack = await self._producer.send(self._jobs_topic, self._event(event, data), key=self.job_id)
        ack.add_done_callback(_log_failure)

    async def publish_event(self, event: str, data: dict[str, Any]) -> None:
        """Publish a job event and wait until the broker has it (terminal events)."""
        await self._producer.publish(self._jobs_topic, self._event(event, data), key=self.job_id)

    def _event(self, event: str, data: dict[str, Any]) -> JobEvent:
        return JobEvent(job_id=self.job_id, event=event, at=time.time(), data=data)


def _log_failure(ack: asyncio.Future[RecordMetadata]) -> None:
    if not ack.cancelled() and (exc := ack.exception()) is not None:
        logger.warning("a report was not delivered: %s", exc)
