"""Run a real service in the test's event loop: serve, wait until ready, stop at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

STOP_TIMEOUT_S = 30.0


class Servable(Protocol):
    stop_timeout_s: float

    async def serve(self) -> int: ...
    def readiness(self) -> bool: ...
    def request_stop(self, exit_code: int = 0) -> None: ...


@asynccontextmanager
async def running(
    service: Servable, ready_timeout_s: float = 30.0
) -> AsyncIterator[asyncio.Task[int]]:
    """Serve ``service`` until the block ends; yields its serve task once ``/readyz`` would
    say ready. The stop at the end must give exit code 0.

    The services run in the test's one event loop, beside each other and the broker clients,
    so a stop that leaves several consumer groups (each leave bounded: final commit 5 s, leave
    4 s) on a loaded machine gets more than the 10 s a lone process gets: 30 s here."""
    service.stop_timeout_s = STOP_TIMEOUT_S
    serving = asyncio.create_task(service.serve())
    deadline = time.monotonic() + ready_timeout_s
    while not service.readiness():
        assert time.monotonic() < deadline and not serving.done(), f"{service} never ready"
        await asyncio.sleep(0.05)
    try:
        yield serving
    finally:
        service.request_stop()
        assert await asyncio.wait_for(serving, 60) == 0
