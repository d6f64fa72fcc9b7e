"""Waking the step loop when something it waits for may have changed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


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
