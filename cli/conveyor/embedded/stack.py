"""Start, inspect and stop the single-machine stack: broker, object store, services.

Every process is started detached (own session, output to
``<state-dir>/logs/<name>.log``) so the stack outlives the ``conveyor up``
that started it; ``<state-dir>/stack.json`` records what runs (see
:mod:`conveyor.embedded.state`). All three operations hold the state
directory's lock, so concurrent invocations never interleave.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from conveyor.embedded import registry
from conveyor.embedded.broker import EmbeddedBroker, free_port
from conveyor.embedded.health import broker_probe, wait_until_healthy
from conveyor.embedded.procs import ProcessInfo, StopResult, is_alive, stop_processes
from conveyor.embedded.report import probe_stack
from conveyor.embedded.state import (
    ServiceInfo,
    StackState,
    load_state,
    remove_state,
    save_state,
    state_lock,
)
from conveyor.embedded.store import prepare_store
from conveyor.platform.config import StorageSettings
from conveyor.platform.errors import ConveyorError

Notify = Callable[[str], None]
ServiceArgv = Callable[[str], list[str]]


class StackError(ConveyorError):
    """The stack could not be started as asked."""


def service_argv(name: str) -> list[str]:
    """Command line of one service process: the same command a container runs."""
    return [sys.executable, "-m", "conveyor", "service", name]


def _quiet(_: str) -> None:
    pass


@dataclass(kw_only=True, slots=True, frozen=True)
class StackConfig:
    """What ``conveyor up`` should start."""

    state_dir: Path
    """Holds ``stack.json``, ``logs/`` and, by default, the object store's directory."""
    storage: StorageSettings
    """Object store of the stack and the roots jobs may use; its ``file://`` path and local
    roots must already be absolute (:func:`~conveyor.embedded.store.resolve_storage`)."""
    kafka_bootstrap: str | None = None
    """Use this Kafka cluster instead of starting the embedded broker."""
    host: str = "127.0.0.1"
    """Address the embedded broker and the services' HTTP endpoints bind to."""
    health_timeout_s: float = 60.0
    """How long all services together may take to answer /healthz."""
    stop_timeout_s: float = 15.0
    """Grace period between SIGTERM and SIGKILL when tearing down after a failed start."""
    scale: Mapping[str, int] = field(default_factory=dict)
    """Processes per service (``conveyor up --scale NAME=N``); services not named run once,
    0 leaves a service out. Replicas are named by :func:`registry.instance_names`."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StartOutcome:
    state: StackState
    already_running: bool
    """A healthy stack was recorded; nothing was started."""
    replaced_stale: bool = False
    """A recorded stack was partly down; it was stopped and a fresh one started."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StopOutcome:
    state: StackState
    result: StopResult


def _service_env(config: StackConfig, bootstrap: str, port: int) -> dict[str, str]:
    env = dict(os.environ)
    storage = config.storage
    env.update(
        CONVEYOR_KAFKA_BOOTSTRAP=bootstrap,
        CONVEYOR_STORAGE_URI=storage.uri,
        CONVEYOR_STORAGE_OUTPUT_ROOTS=json.dumps(list(storage.output_roots)),
        CONVEYOR_STORAGE_DATASET_ROOTS=json.dumps(list(storage.dataset_roots)),
        CONVEYOR_TELEMETRY_HTTP_HOST=config.host,
        CONVEYOR_TELEMETRY_HTTP_PORT=str(port),
        PYTHONUNBUFFERED="1",  # log lines reach the log file as they happen
    )
    # The autoscaler's local driver supervises this stack (its processes, stack.json); a user's
    # own settings win. Its floor is the preprocessors asked for (none asked: none added).
    preprocessors = config.scale.get("preprocessor", 1)
    env.setdefault("CONVEYOR_AUTOSCALER_DRIVER", "local")
    env.setdefault("CONVEYOR_AUTOSCALER_STACK_DIR", str(config.state_dir.resolve()))
    env.setdefault("CONVEYOR_AUTOSCALER_MIN_REPLICAS", str(preprocessors))
    if preprocessors == 0:
        env.setdefault("CONVEYOR_AUTOSCALER_MAX_REPLICAS", "0")
    optional = {
        "CONVEYOR_STORAGE_S3_ENDPOINT": storage.s3_endpoint,
        "CONVEYOR_STORAGE_S3_ACCESS_KEY": storage.s3_access_key,
        "CONVEYOR_STORAGE_S3_SECRET_KEY": storage.s3_secret_key,
        "CONVEYOR_STORAGE_S3_REGION": storage.s3_region,
    }
    env.update({key: value for key, value in optional.items() if value is not None})
    env["CONVEYOR_STORAGE_S3_SECURE"] = "true" if storage.s3_secure else "false"
    return env


def spawn(argv: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a stack process detached (its own session), appending its output to
    ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # outlives `conveyor up`; no terminal signals
        )


def _start_broker(
    config: StackConfig, logs: Path, notify: Notify
) -> tuple[str, ProcessInfo | None]:
    if config.kafka_bootstrap:
        notify(f"Checking Kafka at {config.kafka_bootstrap}")
        probe = broker_probe(config.kafka_bootstrap)
        if not probe.healthy:
            raise StackError(f"Kafka at {config.kafka_bootstrap} is not usable: {probe.detail}")
        return config.kafka_bootstrap, None
    notify("Starting the embedded broker (Tansu)")
    log_path = logs / "broker.log"
    broker = EmbeddedBroker(host=config.host, log_path=log_path, detach=True)
    try:
        bootstrap = broker.start()
    except BaseException:
        broker.stop()  # e.g. Ctrl-C while waiting for the port: leave no unrecorded broker
        raise
    assert broker.pid is not None
    return bootstrap, ProcessInfo.of(broker.pid, log_path)


def _distinct_free_ports(host: str, count: int) -> list[int]:
    """``count`` different ports that were free a moment ago. The OS may hand the same free port
    out twice while no one has bound it yet (two services were once given one port)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def _start_fresh(
    config: StackConfig,
    services: Mapping[str, registry.ServiceSpec],
    argv_for: ServiceArgv,
    notify: Notify,
) -> StackState:
    state_dir = config.state_dir.resolve()
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    notify(f"Preparing the object store {config.storage.uri}")
    prepare_store(config.storage)
    bootstrap, broker = _start_broker(config, logs, notify)
    s3 = config.storage.uri.startswith("s3://")
    state = StackState(
        state_dir=str(state_dir),
        started_at=time.time(),
        bootstrap=bootstrap,
        broker=broker,
        storage_uri=config.storage.uri,
        storage_endpoint=config.storage.s3_endpoint if s3 else None,
        output_roots=config.storage.output_roots,
        dataset_roots=config.storage.dataset_roots,
    )
    # Recorded before anything else starts, so `conveyor down` can clean up whatever a failed or
    # interrupted start leaves behind.
    save_state(state)
    try:
        started: list[tuple[ServiceInfo, subprocess.Popen[bytes]]] = []
        instances = [
            (instance, name, spec)
            for name, spec in services.items()
            for instance in registry.instance_names(name, config.scale.get(name, 1))
        ]
        ports = _distinct_free_ports(config.host, len(instances))
        for (instance, name, spec), port in zip(instances, ports, strict=True):
            notify(f"Starting service {instance}")
            log_path = logs / f"{instance}.log"
            process = spawn(argv_for(name), _service_env(config, bootstrap, port), log_path)
            info = ServiceInfo(
                name=instance,
                process=ProcessInfo.of(process.pid, log_path),
                host=config.host,
                port=port,
                serves_api=spec.serves_api,
            )
            started.append((info, process))
            state = replace(state, services=(*state.services, info))
            save_state(state)
        # Services start concurrently (each imports torch: seconds); one deadline covers all.
        deadline = time.monotonic() + config.health_timeout_s
        for info, process in started:
            notify(f"Waiting for {info.name} to be healthy")
            wait_until_healthy(
                info.name,
                info.health_url,
                process,
                log_path=info.process.log_path,
                deadline=deadline,
            )
    except BaseException:
        _stop_recorded(state, config.stop_timeout_s)
        remove_state(state_dir)
        raise
    return state


def start_stack(
    config: StackConfig,
    *,
    services: Mapping[str, registry.ServiceSpec] | None = None,
    argv_for: ServiceArgv = service_argv,
    notify: Notify = _quiet,
) -> StartOutcome:
    """Start the stack unless a healthy one is already recorded in ``config.state_dir``.

    A recorded stack with any component down is stopped and replaced. On any failure
    everything this call started is stopped again and the error propagates:
    :class:`~conveyor.embedded.broker.BrokerError`, :class:`StackError`,
    :class:`~conveyor.embedded.store.StoreSetupError` or
    :class:`~conveyor.embedded.health.HealthError` (naming the service and its log).
    ``services`` defaults to :data:`conveyor.embedded.registry.SERVICES`; ``argv_for``
    builds each service's command line (tests substitute stand-ins). ``config.scale`` may only
    name registered services (else :class:`StackError`, before anything starts).
    """
    registered = registry.SERVICES if services is None else services
    unknown = sorted(set(config.scale) - set(registered))
    if unknown:
        raise StackError(
            f"cannot scale unregistered service(s) {', '.join(unknown)}; "
            f"known: {', '.join(registered)}"
        )
    if any(count < 0 for count in config.scale.values()):
        raise StackError(f"replica counts must be >= 0, got {dict(config.scale)}")
    with state_lock(config.state_dir):
        existing = load_state(config.state_dir)
        replaced = False
        if existing is not None:
            if probe_stack(existing).healthy:
                return StartOutcome(state=existing, already_running=True)
            notify("A recorded stack is partly down: stopping what is left of it")
            _stop_recorded(existing, _stale_stop_timeout_s(existing, config.stop_timeout_s))
            remove_state(config.state_dir)
            replaced = True
        state = _start_fresh(config, registered, argv_for, notify)
        return StartOutcome(state=state, already_running=False, replaced_stale=replaced)


def _stop_recorded(state: StackState, timeout_s: float) -> StopResult:
    """Services first (they may still be flushing to the broker), then the broker."""
    services = stop_processes([s.process for s in reversed(state.services)], timeout_s=timeout_s)
    broker = stop_processes([state.broker] if state.broker else [], timeout_s=timeout_s)
    return StopResult(
        terminated=services.terminated + broker.terminated,
        killed=services.killed + broker.killed,
        already_gone=services.already_gone + broker.already_gone,
    )


ORPHAN_STOP_TIMEOUT_S = 2.0
"""How long services of a stack whose embedded broker is gone get to stop before SIGKILL."""


def _stale_stop_timeout_s(state: StackState, stop_timeout_s: float) -> float:
    """Services whose embedded broker died have nothing left to flush or commit to, and their
    drain would only wait on it: they get a short grace instead of the full stop timeout."""
    if state.broker is not None and not is_alive(state.broker):
        return min(stop_timeout_s, ORPHAN_STOP_TIMEOUT_S)
    return stop_timeout_s


def stop_stack(state_dir: Path, *, timeout_s: float = 15.0) -> StopOutcome | None:
    """Stop the recorded stack: services first (SIGTERM, SIGKILL after ``timeout_s``), then the
    broker; remove ``stack.json``. Returns None when no stack is recorded."""
    with state_lock(state_dir):
        state = load_state(state_dir)
        if state is None:
            return None
        result = _stop_recorded(state, timeout_s)
        remove_state(state_dir)
    return StopOutcome(state=state, result=result)


def first_dead(state: StackState) -> str | None:
    """Name of the first recorded process that is no longer running, None if all run."""
    if state.broker is not None and not is_alive(state.broker):
        return "broker"
    return next((s.name for s in state.services if not is_alive(s.process)), None)
