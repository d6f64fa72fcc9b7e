"""The reader that builds a :class:`~conveyor.training.jobview.JobsView` from ``conveyor.jobs``.

:class:`JobLogReader` reads every partition of the jobs topic from the beginning with a
group-less consumer (manual assignment, nothing committed, so every reader and every restart
sees the whole log), folds each event into a view, and is *ready* once it has reached the end
offsets captured at start; it then keeps tailing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from conveyor.platform.bus.errors import BusError
from conveyor.platform.bus.tail import TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import JobEvent, Message, TrainerPresence
from conveyor.platform.telemetry import counter, gauge
from conveyor.training.jobview import JOB_STATES, JobsView, JobView

logger = logging.getLogger(__name__)

_POLL_TIMEOUT_MS = 1000

OnApplied = Callable[[JobView, JobEvent], None]
"""Called (on the event loop) with the job and the event after each event that changed it."""


class JobLogReader:
    """Folds the jobs topic into ``view`` and calls ``on_applied``; single use.

    ``start()`` reads every partition from the earliest offset (a :class:`TopicTail`, so holes
    in the offsets are read again) and captures the end offsets; ``run()`` consumes until
    cancelled. Broker failures raise :class:`BusError`; a record that does not decode, or is
    not a JobEvent, is logged, counted and skipped (a view must not stop on one bad record;
    readers do not write the DLQ, which would get a copy per restart): undecodable ones by the
    tail's skipped-records metric, other messages by ``conveyor_<service>_skipped_events_total``.
    A :class:`TrainerPresence` goes to the view's pool, then ``on_presence()`` is called.
    ``service`` also names the gauge ``conveyor_<service>_jobs``.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        view: JobsView,
        *,
        service: str,
        on_applied: OnApplied | None = None,
        on_presence: Callable[[], None] | None = None,
    ) -> None:
        self._settings = settings
        self._topic = topic
        self._view = view
        self._on_applied = on_applied
        self._on_presence = on_presence
        self._tail: TopicTail | None = None
        self._targets: dict[int, int] = {}
        self._caught_up = asyncio.Event()
        self._progress = asyncio.Condition()
        self._skipped = counter(
            service, "skipped_events_total", "Jobs-topic records that were not JobEvents."
        )
        self._jobs_gauge = gauge(service, "jobs", "Jobs in the view by state.", ["state"])

    @property
    def view(self) -> JobsView:
        return self._view

    @property
    def ready(self) -> bool:
        """True once every partition was read up to its end offset at start."""
        return self._caught_up.is_set()

    async def start(self) -> None:
        """Read every partition of the topic from the beginning. BusError if it has none."""
        tail = TopicTail(self._settings, self._topic)
        await tail.start()
        try:
            self._targets = await tail.end_offsets()
        except BaseException:
            await tail.stop()
            raise
        self._tail = tail
        logger.info("replaying %s up to offsets %s", self._topic, self._targets)
        self._check_caught_up()

    async def stop(self) -> None:
        """Close the reader. Safe to call twice."""
        tail, self._tail = self._tail, None
        if tail is not None:
            await tail.stop()

    async def run(self) -> None:
        """Consume and apply until cancelled."""
        tail = self._tail
        if tail is None:
            raise BusError("JobLogReader.run() before start()")
        while True:
            records = await tail.get_many(_POLL_TIMEOUT_MS / 1000)
            for record in records:
                self._apply(record.message)
            if records:
                self._update_gauge()
                async with self._progress:
                    self._progress.notify_all()
            self._check_caught_up()

    async def wait_ready(self) -> None:
        await self._caught_up.wait()

    async def wait_applied(self, partition: int, offset: int, timeout_s: float) -> None:
        """Wait until the record at ``offset`` of ``partition`` is in the view.

        Raises ``TimeoutError`` after ``timeout_s`` seconds.
        """
        async with asyncio.timeout(timeout_s), self._progress:
            await self._progress.wait_for(lambda: self._position(partition) > offset)

    def _position(self, partition: int) -> int:
        position = self._tail.position(partition) if self._tail is not None else None
        return position or 0

    def _apply(self, message: Message) -> None:
        if isinstance(message, TrainerPresence):
            self._view.apply_presence(message)
            if self._on_presence is not None:
                self._on_presence()
            return
        if not isinstance(message, JobEvent):
            self._skipped.inc()
            logger.warning("skipping %s on %s: not a JobEvent", type(message).__name__, self._topic)
            return
        job = self._view.apply(message)
        if job is not None and self._on_applied is not None:
            self._on_applied(job, message)

    def _check_caught_up(self) -> None:
        if self._caught_up.is_set():
            return
        if all(
            self._position(p) >= self._replay_target(p, end) for p, end in self._targets.items()
        ):
            self._update_gauge()
            self._caught_up.set()
            logger.info("jobs view caught up: %d jobs", len(self._view))

    def _replay_target(self, partition: int, end_offset: int) -> int:
        """The offset replay must reach before the view counts as caught up.

        The embedded broker (Tansu 0.6) answers ListOffsets with the base offset of the last
        record batch + 1, which undercounts when that batch holds several records; the
        high-water mark in fetch responses is right, so the larger of the two is used once a
        fetch has reported it."""
        highwater = self._tail.highwater(partition) if self._tail is not None else None
        return max(end_offset, highwater or 0)

    def _update_gauge(self) -> None:
        counts = self._view.counts_by_state()
        for state in JOB_STATES:
            self._jobs_gauge.labels(state=state).set(counts[state])
