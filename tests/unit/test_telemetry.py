"""Logging format, tracing setup and metric helpers of conveyor.platform.telemetry."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.util._once import Once
from otlp_receiver import OtlpReceiver
from prometheus_client import REGISTRY, Counter, Histogram

from conveyor.platform.config import TelemetrySettings
from conveyor.platform.telemetry import (
    LATENCY_BUCKETS_S,
    counter,
    gauge,
    histogram,
    metric_name,
    otlp_traces_url,
    setup_logging,
    setup_tracing,
)


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def fresh_tracing() -> Iterator[None]:
    """OpenTelemetry allows one global provider per process; give each test its own."""
    saved = (
        trace._TRACER_PROVIDER,
        trace._TRACER_PROVIDER_SET_ONCE,
        propagate.get_global_textmap(),
    )
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    yield
    provider = trace._TRACER_PROVIDER
    if isinstance(provider, TracerProvider):
        provider.shutdown()
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved[0], saved[1]
    propagate.set_global_textmap(saved[2])


def settings(**kw: object) -> TelemetrySettings:
    kw.setdefault("otlp_endpoint", None)  # ignore OTEL_EXPORTER_OTLP_ENDPOINT of the shell
    return TelemetrySettings(**kw)  # type: ignore[arg-type]


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_line_has_fields_and_no_trace_outside_span(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(settings(log_json=True, log_level="debug"), "sharder")
    logging.getLogger("conveyor.x").debug("hello %s", "world", extra={"job_id": "j1"})

    (line,) = json_lines(capsys.readouterr().err)
    assert line["message"] == "hello world"
    assert line["level"] == "DEBUG"
    assert line["logger"] == "conveyor.x"
    assert line["service"] == "sharder"
    assert line["exc_info"] is None
    assert line["job_id"] == "j1"
    assert str(line["ts"]).endswith("Z") and "T" in str(line["ts"])
    assert "trace_id" not in line and "span_id" not in line


def test_json_line_carries_ids_of_current_span(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(settings(log_json=True), "trainer")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("step") as span:
        logging.getLogger("conveyor.y").info("inside")
    context = span.get_span_context()

    (line,) = json_lines(capsys.readouterr().err)
    assert line["trace_id"] == f"{context.trace_id:032x}"
    assert line["span_id"] == f"{context.span_id:016x}"


def test_json_line_has_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(settings(log_json=True), "svc")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("conveyor.z").exception("failed")

    (line,) = json_lines(capsys.readouterr().err)
    assert line["level"] == "ERROR"
    assert "Traceback" in str(line["exc_info"])
    assert "ValueError: boom" in str(line["exc_info"])


def test_setup_logging_twice_keeps_one_handler(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(settings(log_json=True), "svc")
    setup_logging(settings(log_json=False), "svc")
    logging.getLogger("conveyor.w").warning("once")

    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "once" in line]
    assert len(lines) == 1
    assert "WARNING" in lines[0] and "svc" in lines[0] and "conveyor.w" in lines[0]
    assert not lines[0].startswith("{")  # the second (human) setting won


def test_setup_logging_level_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(settings(log_level="warning"), "svc")
    logging.getLogger("conveyor.v").info("hidden")
    assert "hidden" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging(settings(log_level="loud"), "svc")


def test_latency_buckets_span_milliseconds_to_minutes() -> None:
    assert list(LATENCY_BUCKETS_S) == sorted(set(LATENCY_BUCKETS_S))
    assert LATENCY_BUCKETS_S[0] <= 0.001
    assert LATENCY_BUCKETS_S[-1] >= 300.0


def test_metric_helpers_name_and_reuse() -> None:
    assert metric_name("trainer", "step_seconds") == "conveyor_trainer_step_seconds"
    first = counter("telemetrytest", "events_total", "Events.", ["kind"])
    again = counter("telemetrytest", "events_total", "Events.", ["kind"])
    assert first is again
    assert isinstance(first, Counter)
    first.labels(kind="a").inc(3)
    assert REGISTRY.get_sample_value("conveyor_telemetrytest_events_total", {"kind": "a"}) == 3

    hist = histogram("telemetrytest", "wait_seconds", "Wait.")
    assert isinstance(hist, Histogram)
    hist.observe(0.002)
    assert (
        REGISTRY.get_sample_value("conveyor_telemetrytest_wait_seconds_bucket", {"le": "600.0"})
        == 1
    )
    assert gauge("telemetrytest", "depth", "Depth.") is gauge("telemetrytest", "depth", "Depth.")


@pytest.mark.parametrize(
    ("service", "name"), [("Trainer", "x_total"), ("trainer", "x-total"), ("", "x_total")]
)
def test_metric_name_rejects_bad_parts(service: str, name: str) -> None:
    with pytest.raises(ValueError):
        counter(service, name, "bad")


def test_metric_helpers_reject_conflicts() -> None:
    with pytest.raises(ValueError, match="_total"):
        counter("telemetrytest", "events", "no suffix")
    counter("telemetrytest", "things_total", "Things.", ["a"])
    with pytest.raises(ValueError, match="another type or labels"):
        counter("telemetrytest", "things_total", "Things.", ["b"])
    with pytest.raises(ValueError, match="another type or labels"):
        gauge("telemetrytest", "things_total", "Things.", ["a"])


def test_otlp_traces_url() -> None:
    assert otlp_traces_url("http://jaeger:4318") == "http://jaeger:4318/v1/traces"
    assert otlp_traces_url("http://jaeger:4318/") == "http://jaeger:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


@pytest.mark.usefixtures("fresh_tracing")
def test_without_an_endpoint_no_trace_starts_sampled_but_ids_propagate_and_upstream_rules() -> None:
    setup_tracing("sharder", settings(trace_sample_ratio=1.0))
    tracer = trace.get_tracer("t")
    with tracer.start_as_current_span("release shard") as root:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    # Nothing would receive it: not recorded, yet its ids reach the headers (and the logs).
    assert not root.is_recording()
    _, trace_id, _, flags = carrier["traceparent"].split("-")
    assert trace_id == f"{root.get_span_context().trace_id:032x}" != "0" * 32
    assert int(flags, 16) & 0x01 == 0
    # A trace sampled where it started (a process that exports) is followed here.
    upstream = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    with tracer.start_as_current_span("process", context=propagate.extract(upstream)) as child:
        assert child.is_recording() and child.get_span_context().trace_flags.sampled


@pytest.mark.usefixtures("fresh_tracing")
def test_setup_tracing_sets_global_provider_and_w3c_propagator() -> None:
    with OtlpReceiver() as receiver:
        provider = setup_tracing("gateway", settings(otlp_endpoint=receiver.endpoint))
        assert trace.get_tracer_provider() is provider
        assert provider.resource.attributes["service.name"] == "gateway"

        with trace.get_tracer("t").start_as_current_span("request") as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
        assert provider.force_flush(timeout_millis=5000)
    context = span.get_span_context()
    version, trace_id, span_id, flags = carrier["traceparent"].split("-")
    assert (version, trace_id, span_id) == (
        "00",
        f"{context.trace_id:032x}",
        f"{context.span_id:016x}",
    )
    assert int(flags, 16) & 0x01  # sampled


@pytest.mark.usefixtures("fresh_tracing")
def test_spans_reach_an_otlp_http_receiver() -> None:
    with OtlpReceiver() as receiver:
        provider = setup_tracing("preprocessor", settings(otlp_endpoint=receiver.endpoint))
        tracer = trace.get_tracer("t")
        with (
            tracer.start_as_current_span("preprocess") as span,
            tracer.start_as_current_span("decode"),
        ):
            pass
        assert provider.force_flush(timeout_millis=5000)

        parent = receiver.wait_for_span("preprocess", timeout_s=5)
        child = receiver.wait_for_span("decode", timeout_s=5)
    assert parent.service_name == "preprocessor"
    assert parent.trace_id == f"{span.get_span_context().trace_id:032x}"
    assert child.trace_id == parent.trace_id
    assert child.parent_span_id == parent.span_id
