"""Service lifecycle: HTTP probes, graceful stop, exit codes; in-process and as a real process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from otlp_receiver import OtlpReceiver

from conveyor.platform.config import TelemetrySettings
from conveyor.platform.service import Service, ServiceError, _serve_with_signals

EXAMPLE = Path(__file__).with_name("example_service.py")


def telemetry(**kw: Any) -> TelemetrySettings:
    kw.setdefault("otlp_endpoint", None)
    return TelemetrySettings(**kw)


class Recorder(Service):
    """Records the order of lifecycle events; behaviour chosen per test."""

    name = "recorder"

    def __init__(self, *, run_mode: str = "forever", drain_s: float = 0.0, **kw: Any) -> None:
        super().__init__(telemetry=telemetry(), **kw)
        self.run_mode = run_mode
        self.drain_s = drain_s
        self.events: list[str] = []
        self.ready = True
        self.run_started = asyncio.Event()

    async def run(self) -> None:
        self.events.append("run")
        self.run_started.set()
        if self.run_mode == "return":
            return
        if self.run_mode == "crash":
            raise RuntimeError("run crashed")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.events.append("run cancelled")
            raise

    async def drain(self) -> None:
        self.events.append(f"drain ready={self.readiness()}")
        await asyncio.sleep(self.drain_s)
        self.events.append("drained")

    def readiness(self) -> bool:
        return self.ready and super().readiness()

    def http_app(self) -> FastAPI:
        app = super().http_app()

        @app.get("/hello")
        async def hello() -> dict[str, str]:
            return {"hello": self.name}

        return app


async def test_probes_and_custom_route() -> None:
    service = Recorder()
    async with service, httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http:
        assert service.http_port > 0
        health = await http.get("/healthz")
        assert (health.status_code, health.json()["status"]) == (200, "alive")
        assert (await http.get("/readyz")).status_code == 200
        assert (await http.get("/hello")).json() == {"hello": "recorder"}

        service.ready = False
        not_ready = await http.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json() == {"ready": False, "reason": "not ready"}

        metrics = await http.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "# TYPE python_gc_objects_collected_total counter" in metrics.text
        openmetrics = await http.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.rstrip().endswith("# EOF")
    with pytest.raises(ServiceError):
        await service.start()  # single use


async def test_serve_drains_before_cancelling_run_on_stop_request() -> None:
    service = Recorder()
    serving = asyncio.create_task(service.serve())
    await asyncio.wait_for(service.run_started.wait(), timeout=5)
    service.request_stop()
    assert await asyncio.wait_for(serving, timeout=5) == 0
    assert service.events == ["run", "drain ready=False", "drained", "run cancelled"]


async def test_run_returning_ends_service_cleanly() -> None:
    service = Recorder(run_mode="return")
    assert await asyncio.wait_for(service.serve(), timeout=5) == 0
    assert service.events == ["run", "drain ready=False", "drained"]


async def test_run_crash_exits_non_zero(caplog: pytest.LogCaptureFixture) -> None:
    service = Recorder(run_mode="crash")
    with caplog.at_level(logging.ERROR, logger="conveyor.platform.service"):
        assert await asyncio.wait_for(service.serve(), timeout=5) == 1
    (record,) = [r for r in caplog.records if "run() crashed" in r.getMessage()]
    assert record.exc_info is not None
    assert "drained" in service.events


async def test_slow_drain_is_cut_at_drain_timeout() -> None:
    service = Recorder(drain_s=60.0, drain_timeout_s=0.3)
    serving = asyncio.create_task(service.serve())
    await asyncio.wait_for(service.run_started.wait(), timeout=5)
    began = time.monotonic()
    service.request_stop()
    assert await asyncio.wait_for(serving, timeout=5) == 0
    assert time.monotonic() - began < 3.0
    assert "drained" not in service.events
    assert service.events[-1] == "run cancelled"


async def test_second_signal_skips_the_drain_wait() -> None:
    service = Recorder(drain_s=60.0, drain_timeout_s=30.0)
    serving = asyncio.create_task(_serve_with_signals(service))
    await asyncio.wait_for(service.run_started.wait(), timeout=5)
    began = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5  # the handler, the stop request, then the drain begins
    while service.events[-1] != "drain ready=False":
        assert time.monotonic() < deadline, service.events
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    assert await asyncio.wait_for(serving, timeout=5) == 0
    assert time.monotonic() - began < 3.0
    assert service.events[-1] == "run cancelled"


async def test_port_in_use_and_unstarted_port() -> None:
    service = Recorder()
    with pytest.raises(ServiceError):
        _ = service.http_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        clash = Recorder()
        clash.telemetry = telemetry(http_port=taken.getsockname()[1])
        with pytest.raises(ServiceError, match="cannot listen"):
            await clash.start()


def test_service_needs_a_metric_safe_name() -> None:
    class Nameless(Service):
        async def run(self) -> None:
            pass

    class BadName(Nameless):
        name = "Bad-Name"

    with pytest.raises(TypeError, match="name"):
        Nameless(telemetry=telemetry())
    with pytest.raises(ValueError):
        BadName(telemetry=telemetry())


# -- the example service as a real process -----------------------------------------------------


class Process:
    """A child process whose stderr (JSON log lines) is read by a thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.put(line)

    def wait_for_log(self, key: str, timeout_s: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith("{") and key in (record := json.loads(line)):
                return dict(record)
        raise AssertionError(f"no log line with {key!r}; got:\n{''.join(self.seen)}")

    def output(self) -> str:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def child_env(receiver: OtlpReceiver) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "OTEL_"))}
    env.update(
        CONVEYOR_TELEMETRY_LOG_JSON="true",
        CONVEYOR_TELEMETRY_HTTP_PORT="0",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
    )
    return env


def ticks(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("conveyor_example_ticks_total "):
            return float(line.split()[1])
    raise AssertionError("conveyor_example_ticks_total missing from /metrics")


def test_real_process_serves_probes_and_stops_cleanly_on_sigterm(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    proc = Process([str(tmp_path)], child_env(receiver))
    try:
        port = proc.wait_for_log("http_port")["http_port"]
        started = proc.wait_for_log("trace_id")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            assert http.get("/healthz").status_code == 200
            ready = http.get("/readyz")
            assert (ready.status_code, ready.json()) == (200, {"ready": True})
            first = ticks(http.get("/metrics").text)
            time.sleep(0.1)
            assert ticks(http.get("/metrics").text) > first > 0

        began = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=10) == 0, proc.output()
        assert time.monotonic() - began < 5.0
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
    drained = json.loads((tmp_path / "drained.json").read_text())
    assert drained == {"ready": False, "run_cancelled": False}  # drain ran before the cancel

    # The span was exported (flushed at stop) and its trace id is the one in the log line.
    assert started["message"] == "example started"
    assert started["service"] == "example"
    span = receiver.wait_for_span("example.startup", timeout_s=5)
    assert span.service_name == "example"
    assert span.trace_id == started["trace_id"]
    assert span.span_id == started["span_id"]


def test_real_process_exits_non_zero_when_a_background_task_crashes(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    proc = Process([str(tmp_path), "--crash"], child_env(receiver))
    try:
        code = proc.popen.wait(timeout=20)
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
    output = proc.output()
    assert code == 1, output
    crash_lines = [
        json.loads(line) for line in output.splitlines() if "doomed" in line and line[:1] == "{"
    ]
    assert any("RuntimeError: doomed task crashed" in (r["exc_info"] or "") for r in crash_lines)
    assert (tmp_path / "drained.json").exists()
