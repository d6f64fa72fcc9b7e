"""Run a real service in the test's event loop: serve, wait until ready, stop at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol


class Servable(Protocol):
    async def serve(self) -> int: ...
    def readiness(self) -> bool: ...
    def request_stop(self, exit_code: int = 0) -> None: ...


@asynccontextmanager
async def running(
    service: Servable, ready_timeout_s: float = 30.0
) -> AsyncIterator[asyncio.Task[int]]:
    """Serve ``service`` until the block ends; yields its serve task once ``/readyz`` would
    say ready. The stop at the end must give exit code 0."""
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
