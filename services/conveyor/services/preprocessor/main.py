"""Entry point of ``conveyor service preprocessor``: read the settings, run the service."""

from __future__ import annotations

import sys

from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.service import run_service
from conveyor.services.preprocessor.config import PreprocessorSettings
from conveyor.services.preprocessor.service import PreprocessorService


def main(argv: list[str]) -> int:
    """Run one preprocessor until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_PREPROCESSOR_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_STORAGE_*``,
    ``CONVEYOR_TELEMETRY_*``, ``CONVEYOR_CONFIG``). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service preprocessor takes no arguments, got {argv}", file=sys.stderr)
        return 2
    service = PreprocessorService(
        settings=PreprocessorSettings(),
        kafka=KafkaSettings(),
        storage=StorageSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
