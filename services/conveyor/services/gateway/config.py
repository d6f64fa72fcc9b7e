"""Settings of the gateway (``CONVEYOR_GATEWAY_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import MiB, TelemetrySettings, _FileAwareSettings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


class GatewaySettings(_FileAwareSettings):
    """How the gateway serves its API and reads the jobs topic."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_GATEWAY_", frozen=True, extra="forbid", populate_by_name=True
    )

    api_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "api_token", "CONVEYOR_GATEWAY_API_TOKEN", "CONVEYOR_API_TOKEN"
        ),
        description=(
            "Bearer token required on /v1/* when set (also read from CONVEYOR_API_TOKEN, the "
            "variable the CLI uses); probes and /metrics stay open."
        ),
    )
    host: str | None = Field(
        default=None,
        description=(
            "Bind address of the API. Unset: CONVEYOR_TELEMETRY_HTTP_HOST when set "
            f"(the embedded stack sets it), else {DEFAULT_HOST}."
        ),
    )
    port: Annotated[int, Field(ge=0, le=65535)] | None = Field(
        default=None,
        description=(
            "Port of the API (also /healthz, /readyz, /metrics); 0 picks a free one. Unset: "
            f"CONVEYOR_TELEMETRY_HTTP_PORT when set, else {DEFAULT_PORT}."
        ),
    )
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * MiB)] = Field(
        default=MiB, description="Largest accepted request body; larger ones get 413."
    )
    sse_keepalive_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=15.0, description="Idle time after which a progress stream sends a comment line."
    )
    sse_queue_events: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=1024,
        description=(
            "Events buffered per progress stream; a slower client is sent a fresh snapshot "
            "instead of the events it missed."
        ),
    )
    stage_window: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=256, description="Progress reports per stage kept for latency percentiles."
    )
    jaeger_url: Annotated[str, Field(pattern=r"^https?://\S+$")] | None = Field(
        default=None,
        description="Base URL of the Jaeger UI; the job page links to the job's traces there.",
    )
    grafana_url: Annotated[str, Field(pattern=r"^https?://\S+$")] | None = Field(
        default=None,
        description="Base URL of Grafana; the job page links to the Conveyor dashboard there.",
    )
    page_refresh_s: Annotated[int, Field(ge=1, le=3600)] = Field(
        default=5, description="The job pages of live jobs reload this often (seconds)."
    )
    write_timeout_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=15.0,
        description=(
            "How long POST /v1/jobs and cancel wait for the broker's ack and for the view "
            "to show the event; past it they answer 503."
        ),
    )

    def http_address(self, telemetry: TelemetrySettings) -> tuple[str, int]:
        """(host, port) to serve on: this gateway's settings, then telemetry's, then defaults."""
        explicit = telemetry.model_fields_set
        host = self.host or (telemetry.http_host if "http_host" in explicit else DEFAULT_HOST)
        if self.port is not None:
            port = self.port
        else:
            port = telemetry.http_port if "http_port" in explicit else DEFAULT_PORT
        return host, port
