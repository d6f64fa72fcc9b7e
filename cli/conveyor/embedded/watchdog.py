"""The embedded stack's watchdog: restarts the autoscaler when it dies.

The autoscaler's local driver restarts every other service of the stack (:mod:`.supervisor`),
but a process cannot restart itself. The watchdog is a second, restart-only
:class:`~conveyor.embedded.supervisor.LocalDriver` limited to the ``autoscaler`` instances,
checking every ``interval_s`` with the same backoff settings; it is an ordinary service of the
stack, so the autoscaler restarts it in turn. Either one SIGKILLed is back within seconds; both
at once need ``conveyor up`` (which replaces a partly-down stack).

Registered after the autoscaler, it is the first that ``conveyor down`` stops. It neither reads
nor writes Kafka: its restarts are in its log (the autoscaler's own restarts go to the
autoscaler topic, as every restart it does). Embedded only: docker compose and Kubernetes
restart their containers themselves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from conveyor.embedded.supervisor import LocalDriver
from conveyor.platform.config import TelemetrySettings
from conveyor.platform.service import Service, run_service
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.drivers import DriverError

logger = logging.getLogger(__name__)

WATCHED = frozenset({"autoscaler"})


class WatchdogService(Service):
    """Restarts the stack's dead autoscaler every ``interval_s`` seconds."""

    name = "watchdog"

    def __init__(
        self, *, driver: LocalDriver, interval_s: float, telemetry: TelemetrySettings
    ) -> None:
        super().__init__(telemetry=telemetry, drain_timeout_s=1.0)
        self.driver = driver
        self.interval_s = interval_s

    async def run(self) -> None:
        while True:
            try:
                restarts = await self.driver.supervise()
            except DriverError as exc:
                logger.warning("watchdog: %s", exc)
                restarts = []
            for restart in restarts:
                logger.warning("restarted %s (pid %d died; now pid %d, restart %d, after %.1f s)",
                               restart.instance, restart.old_pid, restart.new_pid,
                               restart.restarts, restart.backoff_s)  # fmt: skip
            await asyncio.sleep(self.interval_s)


def main(argv: list[str]) -> int:
    """``conveyor service watchdog``: settings from the environment (the autoscaler's
    ``CONVEYOR_AUTOSCALER_STACK_DIR``, ``INTERVAL_S`` and ``RESTART_*``, which ``conveyor up``
    gives every service). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service watchdog takes no arguments, got {argv}", file=sys.stderr)
        return 2
    settings = AutoscalerSettings()
    if settings.driver != "local" or settings.stack_dir is None:
        print("the watchdog runs in the embedded stack only (driver local)", file=sys.stderr)
        return 2
    driver = LocalDriver(
        state_dir=Path(settings.stack_dir), env=dict(os.environ), own_pid=os.getpid(),
        backoff_s=settings.restart_backoff_s, backoff_max_s=settings.restart_backoff_max_s,
        reset_s=settings.restart_reset_s, only=WATCHED,
    )  # fmt: skip
    service = WatchdogService(driver=driver, interval_s=min(settings.interval_s, 1.0),
                              telemetry=TelemetrySettings())  # fmt: skip
    return run_service(service)
