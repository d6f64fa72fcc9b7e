"""Entry point of ``conveyor service trainer``: read the settings, run the service."""

from __future__ import annotations

import os
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
    # torch's deterministic algorithms (a deterministic job on CUDA) need a fixed cuBLAS
    # workspace, which cuBLAS reads once per process: set before any job runs, unless the
    # operator chose one. 8 x 4 MiB per stream.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    service = TrainerService(
        settings=TrainerSettings(),
        kafka=KafkaSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
