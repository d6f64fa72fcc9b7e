"""Entry point of ``conveyor service aggregator``: read the settings, run the service."""

from __future__ import annotations

import sys

from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.service import run_service
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.service import AggregatorService


def main(argv: list[str]) -> int:
    """Run the aggregator until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_AGGREGATOR_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_STORAGE_*``,
    ``CONVEYOR_TELEMETRY_*``, ``CONVEYOR_CONFIG``). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service aggregator takes no arguments, got {argv}", file=sys.stderr)
        return 2
    service = AggregatorService(
        settings=AggregatorSettings(),
        kafka=KafkaSettings(),
        storage=StorageSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
