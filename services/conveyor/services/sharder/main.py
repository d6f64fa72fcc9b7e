"""Entry point of ``conveyor service sharder``: read the settings, run the service."""

from __future__ import annotations

import sys

from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.service import run_service
from conveyor.services.sharder.config import SharderSettings
from conveyor.services.sharder.service import SharderService


def main(argv: list[str]) -> int:
    """Run the sharder until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_SHARDER_*``, ``CONVEYOR_TOPOLOGY_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_STORAGE_*``,
    ``CONVEYOR_TELEMETRY_*``, ``CONVEYOR_CONFIG``). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service sharder takes no arguments, got {argv}", file=sys.stderr)
        return 2
    service = SharderService(
        settings=SharderSettings(),
        topology=TopologySettings(),
        kafka=KafkaSettings(),
        storage=StorageSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
