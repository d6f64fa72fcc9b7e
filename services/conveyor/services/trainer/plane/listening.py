"""When the trainer reads the gradient plane's logs: only while it waits on them (sync mode).

A reader at the plane's short fetch wait (``plane_fetch_max_wait_ms``, 10 ms) sends about a
hundred fetches a second, nearly all of them empty, and each costs CPU in the broker and in
aiokafka (measured on the embedded broker: about 30 ms and 25 ms of CPU per second per reader).
On a machine shared with preprocessors that is CPU the training does not get. In sync mode
nothing on the control or params log can change what the trainer does while it gathers and
computes its contribution (the step it belongs to waits for it), so the trainer pauses both
readers for that time (and while a fresh job's batches group joins, before its first step) and
resumes them whenever the loop waits on them (a step decision, new parameters, an epoch's
snapshot). What was written meanwhile is fetched at once on the resume.
Bounded staleness keeps following the logs: whether a step may start depends on how far the
others got.

Whatever waits on the logs waits on a :class:`Signal`, which the runner fires after folding
new records of either log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from conveyor.platform.bus import TopicTail


class Signal:
    """Wakes every waiter when something changed (the control log, the params topic)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        previous, self._event = self._event, asyncio.Event()
        previous.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while True:
            event = self._event  # taken before the check, so no change is missed
            if predicate():
                return
            await event.wait()


class PlaneListener:
    """Pauses the attached readers inside :meth:`quiet` unless something waits on them
    (:meth:`wait_for`, :meth:`listening`).

    ``enabled=False`` (bounded staleness) keeps them fetching all the time. The context
    managers nest and never await, so they can wrap any await point.
    """

    def __init__(self, signal: Signal, *, enabled: bool) -> None:
        self._signal = signal
        self._tails: tuple[TopicTail, ...] = ()
        self._enabled = enabled
        self._quiet = 0
        self._listening = 0
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def attach(self, *tails: TopicTail) -> None:
        """The readers to pause and resume (started ones, fetching)."""
        self._tails = tails
        self._paused = False
        self._update()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds (checked again whenever the signal fires); the readers
        fetch meanwhile."""
        if predicate():
            return
        with self.listening():
            await self._signal.wait_for(predicate)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """The step's gathering and computing: the readers may rest."""
        self._quiet += 1
        self._update()
        try:
            yield
        finally:
            self._quiet -= 1
            self._update()

    @contextmanager
    def listening(self) -> Iterator[None]:
        """A wait on what the readers bring: they fetch for its whole duration."""
        self._listening += 1
        self._update()
        try:
            yield
        finally:
            self._listening -= 1
            self._update()

    def _update(self) -> None:
        pause = self._enabled and self._quiet > 0 and self._listening == 0
        if pause == self._paused:
            return
        self._paused = pause
        for tail in self._tails:
            if pause:
                tail.pause()
            else:
                tail.resume()
