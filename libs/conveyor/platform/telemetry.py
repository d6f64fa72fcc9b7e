"""Logging, tracing and metric helpers shared by every Conveyor process.

Call :func:`setup_logging` and :func:`setup_tracing` once at the edge (``run_service`` does);
library code then uses plain ``logging.getLogger(__name__)``, ``opentelemetry.trace`` and the
metric constructors below. Metrics live in prometheus_client's default ``REGISTRY`` and are named
``conveyor_<service>_<name>`` in base units (``_seconds``, ``_bytes``, ``_total``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import socket
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter, Gauge, Histogram

from conveyor.platform.config import TelemetrySettings

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Histogram buckets (seconds) for latencies from a message hop (ms) to a checkpoint (minutes)."""

OTLP_TRACES_PATH = "/v1/traces"

_HUMAN_FORMAT = "%(asctime)s %(levelname)-7s {service} %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is logged.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured duplicate of the message
}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, service, message, exc_info.

    ``trace_id``/``span_id`` (hex, as Jaeger shows them) are added when a span is current in the
    logging thread or task; values passed with ``extra=`` are added under their own keys.
    """

    def __init__(self, service_name: str) -> None:
        super().__init__()
        self._service_name = service_name

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "service": self._service_name,
            "message": record.getMessage(),
            "exc_info": self.formatException(record.exc_info) if record.exc_info else None,
        }
        if record.stack_info:
            payload["stack_info"] = self.formatStack(record.stack_info)
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            payload["trace_id"] = trace.format_trace_id(span_context.trace_id)
            payload["span_id"] = trace.format_span_id(span_context.span_id)
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_") and key not in payload:
                payload[key] = value
        return json.dumps(payload, default=str, ensure_ascii=False)


class _ConveyorLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the root handler installed by :func:`setup_logging` so a second call replaces it."""


def setup_logging(settings: TelemetrySettings, service_name: str) -> None:
    """Send every logger's records to stderr, human-readable or JSON (``settings.log_json``).

    Idempotent: a second call replaces the handler installed by the first one (so the latest
    settings win) and never duplicates lines. Raises ``ValueError`` for an unknown log level.
    """
    level_name = settings.log_level.upper()
    levels = logging.getLevelNamesMapping()
    if level_name not in levels:
        raise ValueError(f"unknown log level {settings.log_level!r}; use one of {sorted(levels)}")
    handler = _ConveyorLogHandler(sys.stderr)
    if settings.log_json:
        handler.setFormatter(JsonLogFormatter(service_name))
    else:
        handler.setFormatter(logging.Formatter(_HUMAN_FORMAT.format(service=service_name)))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _ConveyorLogHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(levels[level_name])
    logging.captureWarnings(True)


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for a collector base URL (``http://jaeger:4318``)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(OTLP_TRACES_PATH) else endpoint + OTLP_TRACES_PATH


def setup_tracing(service_name: str, settings: TelemetrySettings) -> TracerProvider:
    """Install the global tracer provider of this process and the W3C propagators.

    Sampling is :func:`sampler` of ``settings.trace_sample_ratio`` when
    ``settings.otlp_endpoint`` is set, and sampled spans are exported in batches over OTLP/HTTP
    there. Without an endpoint nothing would receive a span, so this process starts no sampled
    trace (ratio 0): its spans are not recorded, which spared the trainer ~47 us a span (62
    against 16), and a trace sampled upstream is still followed. Trace ids reach logs and
    Kafka headers whether a trace is sampled or not. The caller owns the
    returned provider and calls ``shutdown()`` on stop to flush what is still queued.
    OpenTelemetry allows one global provider per process: if one is already set, a warning is
    logged and the returned provider is not the one ``trace.get_tracer()`` uses.
    """
    resource = Resource.create(
        {
            "service.name": service_name,
            "service.namespace": "conveyor",
            "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
        }
    )
    ratio = settings.trace_sample_ratio if settings.otlp_endpoint else 0.0
    provider = TracerProvider(resource=resource, sampler=sampler(ratio))
    if settings.otlp_endpoint:
        # Imported only here: the exporter and protobuf cost every process ~0.1 s of start-up
        # CPU, on a stack that mostly runs without a collector.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_traces_url(settings.otlp_endpoint))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        logger.info("exporting traces to %s", otlp_traces_url(settings.otlp_endpoint))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        logger.warning("a global tracer provider was already set; keeping the earlier one")
    # Kafka headers carry traceparent/tracestate whatever OTEL_PROPAGATORS says.
    propagate.set_global_textmap(
        CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    )
    return provider


def sampler(ratio: float) -> Sampler:
    """Parent-based: a span with a parent (local, or remote from Kafka or HTTP headers) follows
    its parent's decision; a root keeps ``ratio`` of trace ids (0..1, else ValueError), so a
    sampled trace stays whole across processes."""
    return ParentBased(root=TraceIdRatioBased(ratio))


_NAME_PART = re.compile(r"[a-z][a-z0-9_]*")
_collectors: dict[str, Counter | Gauge | Histogram] = {}
_collectors_lock = threading.Lock()
_C = TypeVar("_C", Counter, Gauge, Histogram)


def metric_name(service: str, name: str) -> str:
    """``conveyor_<service>_<name>``; both parts are lower-case identifiers (else ValueError)."""
    for part in (service, name):
        if not _NAME_PART.fullmatch(part):
            raise ValueError(f"metric name part {part!r} must match {_NAME_PART.pattern}")
    return f"conveyor_{service}_{name}"


def counter(service: str, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
    """The counter ``conveyor_<service>_<name>`` (name ends in ``_total``), created once.

    Asking again with the same name returns the same collector, so services may build their
    metrics per instance (tests build many). Different type or labels: ValueError.
    """
    if not name.endswith("_total"):
        raise ValueError(f"counter name {name!r} must end in _total")
    return _get_or_create(Counter, metric_name(service, name), documentation, labelnames)


def gauge(service: str, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
    """The gauge ``conveyor_<service>_<name>``, created once (see :func:`counter`)."""
    return _get_or_create(Gauge, metric_name(service, name), documentation, labelnames)


def histogram(
    service: str,
    name: str,
    documentation: str,
    labelnames: Sequence[str] = (),
    buckets: Sequence[float] = LATENCY_BUCKETS_S,
) -> Histogram:
    """The histogram ``conveyor_<service>_<name>`` (default buckets: :data:`LATENCY_BUCKETS_S`)."""
    return _get_or_create(
        Histogram, metric_name(service, name), documentation, labelnames, buckets=tuple(buckets)
    )


def _get_or_create(
    kind: type[_C], full_name: str, documentation: str, labelnames: Sequence[str], **kw: Any
) -> _C:
    with _collectors_lock:
        existing = _collectors.get(full_name)
        if existing is None:
            created = kind(full_name, documentation, labelnames=tuple(labelnames), **kw)
            _collectors[full_name] = created
            return created
    if not isinstance(existing, kind) or tuple(existing._labelnames) != tuple(labelnames):
        raise ValueError(f"metric {full_name} already exists with another type or labels")
    return existing


def build_info(service: str) -> Gauge:
    """Set ``conveyor_<service>_build_info{version,python} 1``: which release and Python each
    process runs (``version`` is ``unknown`` when the package is not installed)."""
    try:
        release = version("conveyor")
    except PackageNotFoundError:
        release = "unknown"
    info = gauge(
        service, "build_info", "Always 1; the labels say what runs.", ["version", "python"]
    )
    info.labels(version=release, python=platform.python_version()).set(1)
    return info
