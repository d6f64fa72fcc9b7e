"""Reading ``conveyor.jobs`` into the view, and fanning applied events out to progress streams.

The gateway keeps no database: :class:`JobsTail` (a
:class:`~conveyor.training.joblog.JobLogReader`)
replays the jobs topic from the beginning into the :class:`JobsView` and keeps tailing;
:meth:`JobsTail.wait_applied` gives read-your-writes to the API.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import JobEvent
from conveyor.services.gateway.schemas import shown_state
from conveyor.training.joblog import JobLogReader
from conveyor.training.jobview import JobsView, JobView
from conveyor.training.scheduling import Schedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One applied event as a progress stream sends it; ``missed`` asks for a snapshot."""

    event: str
    seq: int
    payload: dict[str, Any]
    terminal: bool
    missed: bool = False


class Subscription:
    """A bounded queue of one client's events for one job. Overflow -> one ``missed`` item."""

    def __init__(self, job_id: str, max_events: int) -> None:
        self.job_id = job_id
        self._queue: asyncio.Queue[StreamItem | None] = asyncio.Queue(maxsize=max_events)

    def offer(self, item: StreamItem | None) -> None:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            # Drop the backlog rather than block the tail: the stream re-sends a snapshot.
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(StreamItem("snapshot", 0, {}, terminal=False, missed=True))

    async def get(self) -> StreamItem | None:
        """The next item; None when the gateway is shutting down."""
        return await self._queue.get()


class EventHub:
    """Delivers applied events to the progress streams subscribed to their job."""

    def __init__(self, *, max_events: int, schedule: Callable[[], Schedule]) -> None:
        """``schedule``: the trainer pool's schedule now, so that an event shows the job's
        state as the API does (``queued`` while the schedule leaves it waiting for trainers,
        even once the aggregators that host it report progress)."""
        self._max_events = max_events
        self._schedule = schedule
        self._subscriptions: dict[str, set[Subscription]] = {}

    def subscribe(self, job_id: str) -> Subscription:
        subscription = Subscription(job_id, self._max_events)
        self._subscriptions.setdefault(job_id, set()).add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscribers = self._subscriptions.get(subscription.job_id)
        if subscribers is not None:
            subscribers.discard(subscription)
            if not subscribers:
                del self._subscriptions[subscription.job_id]

    def publish(self, job: JobView, event: JobEvent) -> None:
        subscribers = self._subscriptions.get(job.job_id)
        if not subscribers:
            return
        state, position = shown_state(job, self._schedule())
        payload = {
            "job_id": job.job_id,
            "event": event.EVENT,
            "at": event.at,
            "seq": job.seq,
            "state": state,
            "queue_position": position,
            "data": event.details(),
            "progress": job.progress(),
        }
        item = StreamItem(event.EVENT, job.seq, payload, terminal=job.terminal)
        for subscription in subscribers:
            subscription.offer(item)

    def close(self) -> None:
        """End every stream (shutdown): each gets a None."""
        for subscribers in self._subscriptions.values():
            for subscription in subscribers:
                subscription.offer(None)


class JobsTail(JobLogReader):
    """The gateway's reader of the jobs topic: folds it into ``view``, fans out to ``hub``.

    See :class:`~conveyor.training.joblog.JobLogReader` for the replay and readiness contract.
    """

    def __init__(self, settings: KafkaSettings, topic: str, view: JobsView, hub: EventHub) -> None:
        super().__init__(settings, topic, view, service="gateway", on_applied=hub.publish)
