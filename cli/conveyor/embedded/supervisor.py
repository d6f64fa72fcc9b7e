"""The autoscaler's ``local`` driver: the embedded stack's supervisor.

It runs inside the autoscaler process that ``conveyor up`` starts (last, so ``conveyor down``
stops it first and nothing is restarted while the stack goes down) and works on what
``stack.json`` records:

* **restart**: a recorded service process that is dead (SIGKILLed, crashed, OOM-killed) is
  started again with the same command, environment, port (a fresh one if that port is taken)
  and log file, after a backoff that doubles with each restart of the same instance
  (``restart_backoff_s`` .. ``restart_backoff_max_s``; an instance alive for
  ``restart_reset_s`` starts over). The broker is not restarted: its memory storage died
  with it, so the stack must be started again (``conveyor up`` replaces a partly-down stack).
  The autoscaler itself is restarted by the stack's ``watchdog`` (:mod:`.watchdog`), a
  driver restricted to it, which the autoscaler restarts in turn.
* **scale**: a pool (the preprocessors; the trainers too when ``trainer_max_replicas`` > 0)
  grows by new instances ``<service>-<n>`` (the next free number; ``preprocessor`` alone
  counts as 1) and shrinks from the highest number down, each removed instance stopped with
  SIGTERM (it drains: a preprocessor commits what it finished, a trainer leaves its job and
  its unapplied batches go to the job's other trainers).

Every change of ``stack.json`` holds the state directory's lock, which ``conveyor up`` and
``conveyor down`` hold for their whole run; the supervisor never waits for it (it tries again
at its next interval), so it neither restarts a stack that is being stopped nor blocks one.

Also the entry point of ``conveyor service autoscaler``: it builds the driver the settings name
(``local`` here, ``docker``/``kubernetes`` in the service package) and runs the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from conveyor.embedded import registry
from conveyor.embedded.broker import free_port
from conveyor.embedded.procs import ProcessInfo, is_alive, stop_processes
from conveyor.embedded.stack import service_argv, spawn
from conveyor.embedded.state import ServiceInfo, StackState, load_state, save_state, state_lock
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.drivers import POOL, TRAINERS, DriverError, Restart, ScaleDriver

logger = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(?P<service>.+)-(?P<number>[1-9][0-9]*)$")


@dataclass(kw_only=True, slots=True)
class _Watch:
    """What the supervisor remembers of one instance."""

    restarts: int = 0
    dead_since: float | None = None
    restarted_at: float | None = None


class LocalDriver(ScaleDriver):
    """Scales ``service`` of the stack recorded in ``state_dir`` and restarts its dead
    processes. ``env`` is the environment of the stack's services (the autoscaler's own: ``conveyor
    up`` gives them all the same one but the port); ``own_pid`` is never restarted."""

    name = "local"

    def __init__(
        self,
        *,
        state_dir: Path,
        env: Mapping[str, str],
        service: str = POOL,
        own_pid: int,
        backoff_s: float,
        backoff_max_s: float,
        reset_s: float,
        stop_timeout_s: float = 30.0,
        argv_for: Callable[[str], list[str]] = service_argv,
        only: frozenset[str] | None = None,
    ) -> None:
        """``argv_for`` builds a service's command line (tests substitute stand-ins);
        ``only``: the services (registry names) it restarts, None: every one."""
        self._argv_for = argv_for
        self._only = only
        self._state_dir = state_dir
        self._env = dict(env)
        self._service = service
        self._own_pid = own_pid
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._reset_s = reset_s
        self._stop_timeout_s = stop_timeout_s
        self._watch: dict[str, _Watch] = {}

    async def replicas(self) -> int:
        state = await asyncio.to_thread(load_state, self._state_dir)
        return len(self._instances(state)) if state is not None else 0

    async def scale(self, replicas: int) -> None:
        victims = await asyncio.to_thread(self._rescale, replicas)
        # Stopped outside the lock: a draining preprocessor may take a while.
        await asyncio.to_thread(stop_processes, victims, timeout_s=self._stop_timeout_s)

    async def supervise(self) -> list[Restart]:
        return await asyncio.to_thread(self._restart_dead)

    # -- in a thread ------------------------------------------------------------------------

    def _instances(self, state: StackState) -> list[ServiceInfo]:
        """The pool's instances, highest number first."""
        found = [s for s in state.services if registry.service_of(s.name) == self._service]
        return sorted(found, key=lambda s: _number(s.name), reverse=True)

    def _rescale(self, replicas: int) -> list[ProcessInfo]:
        with state_lock(self._state_dir, wait=False) as held:
            state = load_state(self._state_dir) if held else None
            if state is None:
                raise DriverError("the stack is being started or stopped; not scaling now")
            current = self._instances(state)
            victims = current[: max(0, len(current) - replicas)]
            kept = [s for s in state.services if s not in victims]
            state = replace(state, services=tuple(kept))
            next_number = max((_number(s.name) for s in current), default=0) + 1
            for number in range(next_number, next_number + replicas - len(current)):
                info = self._start(state, f"{self._service}-{number}", port=None)
                state = replace(state, services=(*state.services, info))
            save_state(state)
        return [victim.process for victim in victims]

    def _restart_dead(self) -> list[Restart]:
        with state_lock(self._state_dir, wait=False) as held:
            state = load_state(self._state_dir) if held else None
            if state is None:
                return []
            now = time.monotonic()
            restarts: list[Restart] = []
            services = list(state.services)
            for index, info in enumerate(services):
                if info.process.pid == self._own_pid or (
                    self._only is not None and registry.service_of(info.name) not in self._only
                ):
                    continue
                watch = self._watch.setdefault(info.name, _Watch())
                if is_alive(info.process):
                    if watch.restarted_at is not None and now - watch.restarted_at > self._reset_s:
                        watch.restarts, watch.restarted_at = 0, None
                    continue
                if watch.dead_since is None:
                    watch.dead_since = now
                    logger.warning("%s (pid %d) is dead", info.name, info.process.pid)
                backoff = min(self._backoff_max_s, self._backoff_s * 2**watch.restarts)
                if now - watch.dead_since < backoff:
                    continue
                services[index] = restarted = self._start(state, info.name, port=info.port,
                                                          serves_api=info.serves_api)  # fmt: skip
                waited = now - watch.dead_since
                watch.restarts, watch.dead_since, watch.restarted_at = watch.restarts + 1, None, now
                restarts.append(Restart(
                    service=registry.service_of(info.name), instance=info.name,
                    old_pid=info.process.pid, new_pid=restarted.process.pid,
                    restarts=watch.restarts, backoff_s=waited,
                ))  # fmt: skip
            if restarts:
                save_state(replace(state, services=tuple(services)))
            if state.broker is not None and not is_alive(state.broker):
                logger.error("the embedded broker (pid %d) is dead and cannot be restarted (its "
                             "memory storage died with it): run conveyor down and conveyor up",
                             state.broker.pid)  # fmt: skip
        return restarts

    def _start(
        self, state: StackState, instance: str, *, port: int | None, serves_api: bool = False
    ) -> ServiceInfo:
        host = self._env.get("CONVEYOR_TELEMETRY_HTTP_HOST", "127.0.0.1")
        if port is None or not _port_free(host, port):
            port = free_port(host)
        env = {**self._env, "CONVEYOR_TELEMETRY_HTTP_PORT": str(port)}
        log_path = Path(state.state_dir) / "logs" / f"{instance}.log"
        process = spawn(self._argv_for(registry.service_of(instance)), env, log_path)
        return ServiceInfo(name=instance, process=ProcessInfo.of(process.pid, log_path),
                           host=host, port=port, serves_api=serves_api)  # fmt: skip


def _number(instance: str) -> int:
    """``preprocessor-3`` -> 3; a bare ``preprocessor`` is 1."""
    match = _NUMBERED.match(instance)
    return int(match["number"]) if match else 1


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def main(argv: list[str]) -> int:
    """Run the autoscaler until SIGTERM/SIGINT; settings come from the environment
    (``CONVEYOR_AUTOSCALER_*``, ``CONVEYOR_KAFKA_*``, ``CONVEYOR_TELEMETRY_*``,
    ``CONVEYOR_CONFIG``). Takes no arguments; returns the exit code."""
    if argv:
        print(f"conveyor service autoscaler takes no arguments, got {argv}", file=sys.stderr)
        return 2
    # Imported here, not at the top: the watchdog imports this module for LocalDriver alone, and
    # the service brings torch (through the message registry), seconds of CPU at every start.
    from conveyor.services.autoscaler.main import remote_driver, run

    settings = AutoscalerSettings()
    scales_trainers = settings.trainer_pool() is not None
    if settings.driver != "local":
        trainers = remote_driver(settings, TRAINERS) if scales_trainers else None
        return run(settings, remote_driver(settings), trainers)
    assert settings.stack_dir is not None  # the settings check it

    def local(pool: str) -> LocalDriver:
        return LocalDriver(
            state_dir=Path(settings.stack_dir or ""), env=dict(os.environ), service=pool,
            own_pid=os.getpid(), backoff_s=settings.restart_backoff_s,
            backoff_max_s=settings.restart_backoff_max_s, reset_s=settings.restart_reset_s,
        )  # fmt: skip

    # Only the first driver's supervise() is called: one restarts the dead, for every pool.
    return run(settings, local(POOL), local(TRAINERS) if scales_trainers else None)
