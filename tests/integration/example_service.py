"""A tiny Service run as a real process by test_service.py.

    python example_service.py MARKER_DIR [--crash]

Settings come from the environment (CONVEYOR_TELEMETRY_..., OTEL_EXPORTER_OTLP_ENDPOINT), as in
a container. ``drain()`` writes MARKER_DIR/drained.json; ``--crash`` adds a background task that
crashes: like every service, ``run()`` owns its tasks in a TaskGroup, so the crash ends ``run()``
and the process must exit 1 on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

from opentelemetry import trace

from conveyor.platform.config import TelemetrySettings
from conveyor.platform.service import Service, run_service
from conveyor.platform.telemetry import counter

logger = logging.getLogger("example")


class ExampleService(Service):
    name = "example"

    def __init__(self, *, telemetry: TelemetrySettings, marker_dir: Path, crash: bool) -> None:
        super().__init__(telemetry=telemetry, drain_timeout_s=5.0)
        self.marker_dir = marker_dir
        self.crash = crash
        self.ticks = counter("example", "ticks_total", "Iterations of the example ticker.")
        self.run_cancelled = False

    async def run(self) -> None:
        with trace.get_tracer(__name__).start_as_current_span("example.startup"):
            logger.info("example started")
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._tick(), name="ticker")
                if self.crash:
                    group.create_task(self._doomed(), name="doomed")
        except asyncio.CancelledError:
            self.run_cancelled = True
            raise

    async def _tick(self) -> None:
        while True:
            self.ticks.inc()
            await asyncio.sleep(0.02)

    async def _doomed(self) -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("doomed task crashed")

    async def drain(self) -> None:
        state = {"ready": self.readiness(), "run_cancelled": self.run_cancelled}
        (self.marker_dir / "drained.json").write_text(json.dumps(state))


def main() -> int:
    marker_dir = Path(sys.argv[1])
    service = ExampleService(
        telemetry=TelemetrySettings(), marker_dir=marker_dir, crash="--crash" in sys.argv
    )
    return run_service(service)


if __name__ == "__main__":
    sys.exit(main())
