"""The embedded stack for real, its services: real child processes standing in for services get
their settings, become healthy and stop; a failing one is named with its log, one ignoring
SIGTERM is killed, scaled ones run one process, port and log per replica, and the supervisor
restarts dead services and scales the pool."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from stack_harness import _pid_gone

from conveyor.embedded import stack as stack_module
from conveyor.embedded.health import HealthError, wait_until_healthy
from conveyor.embedded.procs import is_alive
from conveyor.embedded.registry import ServiceSpec
from conveyor.embedded.report import probe_stack
from conveyor.embedded.stack import StackConfig, StackError, start_stack, stop_stack
from conveyor.embedded.state import StackState, load_state, state_lock
from conveyor.embedded.supervisor import LocalDriver
from conveyor.platform.config import StorageSettings
from conveyor.services.autoscaler.drivers import DriverError

# A stand-in service: serves /healthz with the settings it was given, like a real one would.
FAKE_SERVICE = textwrap.dedent(
    """
    import json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    mode = sys.argv[1]
    if mode == "crash":
        print("boom: cannot connect to anything", flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen = {k: v for k, v in os.environ.items() if k.startswith("CONVEYOR_")}
            body = json.dumps({**seen, "pid": os.getpid()})
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    port = int(os.environ["CONVEYOR_TELEMETRY_HTTP_PORT"])
    HTTPServer((os.environ["CONVEYOR_TELEMETRY_HTTP_HOST"], port), Handler).serve_forever()
    """
)


def _stack(tmp_path: Path, modes: dict[str, str]) -> tuple[StackConfig, dict[str, Any]]:
    script = tmp_path / "fake_service.py"
    script.write_text(FAKE_SERVICE)
    config = StackConfig(
        state_dir=tmp_path / "state",
        storage=StorageSettings(
            uri=f"file://{tmp_path / 'objects'}",
            dataset_roots=(f"file://{tmp_path / 'data'}", "s3://bkt/sets"),
        ),
        health_timeout_s=20.0,
        stop_timeout_s=0.5,
    )
    services = {
        name: ServiceSpec(entry="unused.here:main", serves_api=name == "gateway") for name in modes
    }
    kwargs: dict[str, Any] = {
        "services": services,
        "argv_for": lambda name: [sys.executable, str(script), modes[name]],
    }
    return config, kwargs


def test_services_get_settings_become_healthy_and_stop(tmp_path: Path) -> None:
    config, kwargs = _stack(tmp_path, {"gateway": "ok", "sharder": "ok"})
    outcome = start_stack(config, **kwargs)
    state = outcome.state
    assert [s.name for s in state.services] == ["gateway", "sharder"]
    gateway, sharder = state.services
    assert state.gateway_url == gateway.base_url
    assert load_state(config.state_dir) == state

    seen = httpx.get(sharder.health_url, timeout=5).json()
    assert seen["CONVEYOR_KAFKA_BOOTSTRAP"] == state.bootstrap
    assert seen["CONVEYOR_STORAGE_URI"] == f"file://{tmp_path / 'objects'}"
    assert json.loads(seen["CONVEYOR_STORAGE_DATASET_ROOTS"]) == [
        f"file://{tmp_path / 'data'}", "s3://bkt/sets",
    ]  # fmt: skip
    assert json.loads(seen["CONVEYOR_STORAGE_OUTPUT_ROOTS"]) == []
    assert state.dataset_roots == (f"file://{tmp_path / 'data'}", "s3://bkt/sets")
    assert seen["CONVEYOR_TELEMETRY_HTTP_PORT"] == str(sharder.port)
    assert gateway.port != sharder.port
    assert probe_stack(state).healthy

    stopped = stop_stack(config.state_dir, timeout_s=5.0)
    assert stopped is not None
    assert sorted(stopped.result.terminated) == sorted(p.pid for p in state.processes())
    assert not any(is_alive(p) for p in state.processes())
    assert load_state(config.state_dir) is None


def test_failing_service_is_named_with_its_log_and_start_is_undone(tmp_path: Path) -> None:
    config, kwargs = _stack(tmp_path, {"sharder": "ok", "trainer": "crash"})
    recorded: list[StackState] = []

    def notify(_: str) -> None:
        # stack.json is written as each process starts: keep the fullest record seen.
        if (state := load_state(config.state_dir)) is not None:
            recorded.append(state)

    with pytest.raises(HealthError) as caught:
        start_stack(config, notify=notify, **kwargs)
    message = str(caught.value)
    assert "service 'trainer' exited with code 3" in message
    assert str(config.state_dir.resolve() / "logs" / "trainer.log") in message
    assert "boom: cannot connect to anything" in message
    assert load_state(config.state_dir) is None
    launched = recorded[-1].processes()
    assert len(launched) == 3  # trainer, sharder, broker
    assert not any(is_alive(p) for p in launched)


def test_service_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    config, kwargs = _stack(tmp_path, {"autoscaler": "stubborn"})
    state = start_stack(config, **kwargs).state
    stopped = stop_stack(config.state_dir, timeout_s=0.5)
    assert stopped is not None
    assert stopped.result.killed == (state.services[0].process.pid,)
    assert state.broker is not None and stopped.result.terminated == (state.broker.pid,)
    assert not any(is_alive(p) for p in state.processes())


def test_scaled_service_runs_one_process_port_and_log_per_replica(tmp_path: Path) -> None:
    config, kwargs = _stack(tmp_path, {"gateway": "ok", "preprocessor": "ok", "trainer": "ok"})
    config = replace(config, scale={"preprocessor": 2, "trainer": 0})
    state = start_stack(config, **kwargs).state
    try:
        assert [s.name for s in state.services] == ["gateway", "preprocessor-1", "preprocessor-2"]
        replicas = state.services[1:]
        assert len({s.port for s in state.services}) == 3
        assert len({s.process.pid for s in state.services}) == 3
        logs = config.state_dir.resolve() / "logs"
        assert [s.process.log_path for s in replicas] == [
            str(logs / "preprocessor-1.log"),
            str(logs / "preprocessor-2.log"),
        ]
        for replica in replicas:
            seen = httpx.get(replica.health_url, timeout=5).json()
            assert seen["CONVEYOR_TELEMETRY_HTTP_PORT"] == str(replica.port)
            assert seen["CONVEYOR_KAFKA_BOOTSTRAP"] == state.bootstrap
        assert probe_stack(state).healthy
    finally:
        stopped = stop_stack(config.state_dir, timeout_s=5.0)
    assert stopped is not None
    assert sorted(stopped.result.terminated) == sorted(p.pid for p in state.processes())


def test_a_port_answered_by_another_process_is_not_that_service(tmp_path: Path) -> None:
    """Two services were once given the same port: the second one could not bind it, and the
    first one's /healthz made the second look healthy (its job then hung without it)."""
    config, kwargs = _stack(tmp_path, {"sharder": "ok"})
    state = start_stack(config, **kwargs).state
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (sharder,) = state.services
        with pytest.raises(
            HealthError, match=f"answered by pid {sharder.process.pid}, not {other.pid}"
        ):
            wait_until_healthy("impostor", sharder.health_url, other, log_path=str(tmp_path / "x"),
                               deadline=time.monotonic() + 1.0)  # fmt: skip
    finally:
        other.kill()
        other.wait()
        stop_stack(config.state_dir, timeout_s=5.0)


def test_ports_handed_out_are_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = iter([40001, 40001, 40002, 40001, 40003])
    monkeypatch.setattr(stack_module, "free_port", lambda host: next(offered))
    assert stack_module._distinct_free_ports("127.0.0.1", 3) == [40001, 40002, 40003]


def test_scaling_an_unregistered_service_starts_nothing(tmp_path: Path) -> None:
    config, kwargs = _stack(tmp_path, {"gateway": "ok"})
    with pytest.raises(StackError, match="unregistered service"):
        start_stack(replace(config, scale={"nope": 2}), **kwargs)
    assert load_state(config.state_dir) is None


def _serving_pid(health_url: str, timeout_s: float = 20.0) -> int:
    """The pid that answers ``health_url``, once one does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return int(httpx.get(health_url, timeout=2).json()["pid"])
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_supervisor_restarts_dead_services_and_scales_the_pool(tmp_path: Path) -> None:
    config, kwargs = _stack(tmp_path, {"gateway": "ok", "preprocessor": "ok", "trainer": "ok"})
    state = start_stack(config, **kwargs).state
    try:
        gateway, preprocessor, trainer = state.services
        seen = httpx.get(trainer.health_url, timeout=5).json()  # its CONVEYOR_* settings
        env = {**os.environ, **{k: v for k, v in seen.items() if k.startswith("CONVEYOR_")}}
        driver = LocalDriver(
            state_dir=config.state_dir, env=env, own_pid=gateway.process.pid, backoff_s=0.3,
            backoff_max_s=1.0, reset_s=60.0, stop_timeout_s=2.0, argv_for=kwargs["argv_for"],
        )  # fmt: skip
        os.kill(trainer.process.pid, signal.SIGKILL)
        assert _pid_gone(trainer.process.pid)
        os.kill(gateway.process.pid, signal.SIGKILL)  # stands for the supervisor's own process
        assert _pid_gone(gateway.process.pid)
        restarts = asyncio.run(driver.supervise())
        assert restarts == []  # seen dead now: the backoff starts
        time.sleep(0.3)
        (restart,) = asyncio.run(driver.supervise())
        assert (restart.service, restart.instance, restart.old_pid, restart.restarts) == (
            "trainer", "trainer", trainer.process.pid, 1,
        )  # fmt: skip
        assert restart.backoff_s >= 0.3
        recorded = load_state(config.state_dir)
        assert recorded is not None
        again = next(s for s in recorded.services if s.name == "trainer")
        assert again.process.pid == restart.new_pid != trainer.process.pid
        assert (again.port, again.process.log_path) == (trainer.port, trainer.process.log_path)
        assert _serving_pid(again.health_url) == restart.new_pid
        assert asyncio.run(driver.supervise()) == []

        asyncio.run(driver.scale(3))
        grown = load_state(config.state_dir)
        assert grown is not None
        assert [s.name for s in grown.services] == [
            "gateway", "preprocessor", "trainer", "preprocessor-2", "preprocessor-3",
        ]  # fmt: skip
        added = grown.services[3:]
        assert len({s.port for s in grown.services}) == 5
        assert [_serving_pid(info.health_url) for info in added] == [
            info.process.pid for info in added
        ]
        assert asyncio.run(driver.replicas()) == 3

        asyncio.run(driver.scale(1))
        shrunk = load_state(config.state_dir)
        assert shrunk is not None
        assert [s.name for s in shrunk.services] == ["gateway", "preprocessor", "trainer"]
        assert all(_pid_gone(info.process.pid) for info in added)
        assert is_alive(preprocessor.process)

        # The trainer pool, when the autoscaler sizes it, the same way: trainer-2 added, removed.
        trainers = LocalDriver(
            state_dir=config.state_dir, env=env, service="trainer", own_pid=gateway.process.pid,
            backoff_s=0.3, backoff_max_s=1.0, reset_s=60.0, stop_timeout_s=2.0,
            argv_for=kwargs["argv_for"],
        )  # fmt: skip
        asyncio.run(trainers.scale(2))
        with_trainers = load_state(config.state_dir)
        assert with_trainers is not None
        assert [s.name for s in with_trainers.services][-1] == "trainer-2"
        assert asyncio.run(trainers.replicas()) == 2
        asyncio.run(trainers.scale(1))
        assert asyncio.run(trainers.replicas()) == 1
        assert _pid_gone(with_trainers.services[-1].process.pid)
        # A driver limited to other services (the watchdog's) leaves a dead trainer alone.
        watchdog = LocalDriver(
            state_dir=config.state_dir, env=env, own_pid=-1, backoff_s=0.0, backoff_max_s=1.0,
            reset_s=60.0, argv_for=kwargs["argv_for"], only=frozenset({"autoscaler"}),
        )  # fmt: skip
        os.kill(restart.new_pid, signal.SIGKILL)
        assert _pid_gone(restart.new_pid)
        assert asyncio.run(watchdog.supervise()) == asyncio.run(watchdog.supervise()) == []

        # While `conveyor up` or `down` holds the state lock, the supervisor changes nothing.
        with state_lock(config.state_dir):
            time.sleep(0.7)  # past the doubled backoff
            assert asyncio.run(driver.supervise()) == []
            with pytest.raises(DriverError, match="being started or stopped"):
                asyncio.run(driver.scale(2))
        seen_at = time.monotonic()  # the backoff (0.6 s: the second restart) starts now
        while not (found := asyncio.run(driver.supervise())):
            time.sleep(0.05)
        (second,) = found
        assert (second.instance, second.old_pid, second.restarts) == ("trainer", restart.new_pid, 2)
        assert time.monotonic() - seen_at >= 0.6
    finally:
        stop_stack(config.state_dir, timeout_s=2.0)
    recorded_pids = [second.new_pid, *(info.process.pid for info in added)]
    assert all(_pid_gone(pid) for pid in recorded_pids)
