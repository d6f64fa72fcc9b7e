"""Entry point of ``conveyor service gateway``: read the settings, run the service."""

from __future__ import annotations

import sys

from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.service import run_service
from conveyor.services.gateway.config import GatewaySettings
from conveyor.services.gateway.service import GatewayService


def main(argv: list[str]) -> int:
    """Run the gateway until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_GATEWAY_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_STORAGE_*`` (the roots jobs may
    use), ``CONVEYOR_TELEMETRY_*``, ``CONVEYOR_CONFIG``).
    Takes no arguments; returns the process exit code."""
    if argv:
        print(f"conveyor service gateway takes no arguments, got {argv}", file=sys.stderr)
        return 2
    service = GatewayService(
        settings=GatewaySettings(),
        kafka=KafkaSettings(),
        storage=StorageSettings(),
        telemetry=TelemetrySettings(),
    )
    return run_service(service)
