"""Entry point of ``conveyor service checkpointer``: read the settings, run the service."""

from __future__ import annotations

import sys

from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.service import run_service
from conveyor.services.checkpointer.config import CheckpointerSettings
from conveyor.services.checkpointer.service import CheckpointerService


def main(argv: list[str]) -> int:
    """Run the checkpointer until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_CHECKPOINTER_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_STORAGE_*``,
    ``CONVEYOR_TELEMETRY_*``, ``CONVEYOR_CONFIG``). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service checkpointer takes no arguments, got {argv}", file=sys.stderr)
        return 2
    service = CheckpointerService(
        settings=CheckpointerSettings(),
        kafka=KafkaSettings(),
        storage=StorageSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
