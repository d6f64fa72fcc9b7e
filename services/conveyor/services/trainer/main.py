"""Entry point of ``conveyor service trainer``: read the settings, run the service."""

from __future__ import annotations

import sys

from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.service import run_service
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.service import TrainerService


def main(argv: list[str]) -> int:
    """Run a trainer until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_TRAINER_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_TELEMETRY_*``,
    ``CONVEYOR_CONFIG``). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service trainer takes no arguments, got {argv}", file=sys.stderr)
        return 2
    service = TrainerService(
        settings=TrainerSettings(),
        kafka=KafkaSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
