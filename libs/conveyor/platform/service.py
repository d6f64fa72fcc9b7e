"""The lifecycle every Conveyor service shares: HTTP probes, graceful stop.

A service subclasses :class:`Service`, sets ``name`` and implements ``run()``;
``conveyor service NAME`` builds it from its settings and calls :func:`run_service`, which
returns the process exit code. The stop sequence, whatever triggers it (SIGTERM/SIGINT,
``run()`` returning or crashing), is always:

1. ``/readyz`` turns 503 (load balancers and Kubernetes stop sending work);
2. ``drain()`` runs while ``run()`` still runs, at most ``drain_timeout_s`` (a second signal
   cuts it short);
3. ``run()`` is cancelled and awaited (with it the background tasks it owns: a service runs
   them in an ``asyncio.TaskGroup`` inside ``run()``, so a crashed task ends ``run()`` and the
   process exits 1 for its supervisor to restart it);
4. the HTTP server stops; ``run_service`` then flushes and shuts down tracing.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Generator, MutableMapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

from conveyor.platform.awaiting import await_chain
from conveyor.platform.config import TelemetrySettings
from conveyor.platform.errors import ConveyorError
from conveyor.platform.lifecycle import AsyncLifecycle
from conveyor.platform.telemetry import build_info, metric_name, setup_logging, setup_tracing

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1


class ServiceError(ConveyorError):
    """The service could not start or was used out of order (start twice, port taken)."""


class _SignalFreeServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the service.

    uvicorn (>= 0.29, checked on 0.54) wraps ``serve()`` in ``capture_signals()``, which
    replaces the SIGINT/SIGTERM handlers with ``signal.signal`` and re-raises the captured
    signal on exit; that would bypass the drain. The service stops it with ``should_exit``.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Service(AsyncLifecycle):
    """Base of every service process; single use: start once, stop once.

    Subclasses set the class attribute ``name`` (a lower-case identifier, it prefixes the
    metrics: ``conveyor_<name>_...``), implement :meth:`run` and may override :meth:`drain`,
    :meth:`readiness` and :meth:`http_app` (call ``super().http_app()`` and add routes).
    Background work runs in a TaskGroup inside :meth:`run`, so it stops and fails with it.
    """

    name: str

    def __init__(
        self,
        *,
        telemetry: TelemetrySettings,
        drain_timeout_s: float = 20.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        """``drain_timeout_s`` bounds :meth:`drain`; ``stop_timeout_s`` bounds waiting for
        cancelled tasks and the HTTP server (keep the sum under the orchestrator's grace
        period: 30 s by default in Kubernetes)."""
        if not isinstance(getattr(self, "name", None), str):
            raise TypeError(f"{type(self).__name__} must set the class attribute `name`")
        metric_name(self.name, "x")  # ValueError unless usable in metric names
        build_info(self.name)
        if drain_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("drain_timeout_s and stop_timeout_s must be > 0")
        self.telemetry = telemetry
        self.drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._stop_requested = asyncio.Event()
        self._force_stop = asyncio.Event()
        self._exit_code = EXIT_OK
        self._started = False
        self._stopping = False
        self._stopped = False
        self._http_server: _SignalFreeServer | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._http_port: int | None = None

    # -- what subclasses provide ---------------------------------------------------------

    @abc.abstractmethod
    async def run(self) -> None:
        """The main loop. Returning ends the service (exit 0); raising ends it with exit 1.

        Still running while :meth:`drain` runs; cancelled afterwards (CancelledError is the
        normal way out).
        """

    async def drain(self) -> None:
        """Finish in-flight work, commit offsets, leave consumer groups. Default: nothing.

        Called once on every stop, before ``run()`` and the tasks are cancelled; cancelled if
        it takes longer than ``drain_timeout_s``. Raising makes the exit code 1.
        """

    def readiness(self) -> bool:
        """Whether this process should receive work now (``/readyz``). Default: once started,
        until stopping. Overrides should ``and`` their condition with ``super().readiness()``."""
        return self._started and not self._stopping

    def http_app(self) -> FastAPI:
        """The HTTP app: ``/healthz`` (liveness), ``/readyz`` (200 or 503 with a reason) and
        ``/metrics`` (Prometheus, content type negotiated). Called once by :meth:`start`."""
        # Probes and scrapes come every few seconds: a trace each would bury the real requests.
        # FastAPI's per-request dependency/endpoint/serialization spans are left out too.
        app = FastAPI(
            title=f"conveyor {self.name}",
            telemetry={"exclude": _is_probe, "operation_spans": False},
        )

        @app.get("/healthz", include_in_schema=False)
        async def healthz() -> dict[str, str | int]:
            # The pid lets a supervisor tell its own child from another process on the port.
            return {"status": "alive", "service": self.name, "pid": os.getpid()}

        @app.get("/readyz", include_in_schema=False)
        async def readyz() -> JSONResponse:
            reason = self._not_ready_reason()
            if reason is None:
                return JSONResponse({"ready": True})
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)

        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Response:
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            return Response(encoder(REGISTRY), headers={"Content-Type": content_type})

        return app

    # -- state -----------------------------------------------------------------------------

    @property
    def http_port(self) -> int:
        """The port the HTTP server is bound to (the real one when configured as 0)."""
        if self._http_port is None:
            raise ServiceError(f"service {self.name} is not started")
        return self._http_port

    @property
    def stopping(self) -> bool:
        """True from the moment the stop sequence begins."""
        return self._stopping

    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        """Begin the stop sequence of :meth:`serve`; the exit code is the worst one requested."""
        self._exit_code = max(self._exit_code, exit_code)
        self._stop_requested.set()

    def _not_ready_reason(self) -> str | None:
        if not self._started:
            return "starting"
        if self._stopping:
            return "stopping"
        return None if self.readiness() else "not ready"

    def _handle_signal(self, sig: signal.Signals) -> None:
        if not self._stop_requested.is_set():
            logger.info("%s: received %s, stopping gracefully", self.name, sig.name)
            self.request_stop(EXIT_OK)
        else:
            logger.warning("%s: received %s again, not waiting for drain", self.name, sig.name)
            self._force_stop.set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve HTTP on ``telemetry.http_host:http_port``. ServiceError if the port is taken."""
        if self._started or self._stopped:
            raise ServiceError(f"service {self.name} can be started only once")
        host, port = self.telemetry.http_host, self.telemetry.http_port
        app = self.http_app()
        sock = _listen(host, port)
        self._http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,  # keep setup_logging's handlers; uvicorn's loggers propagate
            access_log=False,  # probes every few seconds would drown the log
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(self.stop_timeout_s / 2)),
        )
        self._http_server = _SignalFreeServer(config)
        self._http_task = asyncio.get_running_loop().create_task(
            self._http_server.serve(sockets=[sock]), name=f"{self.name}.http"
        )
        self._http_task.add_done_callback(self._on_http_done)
        self._started = True
        logger.info(
            "%s: serving /healthz /readyz /metrics on http://%s:%d",
            self.name,
            host,
            self._http_port,
            extra={"http_port": self._http_port},
        )

    def _on_http_done(self, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if self._stopping and exc is None:
            return
        logger.error("%s: HTTP server stopped unexpectedly", self.name, exc_info=exc)
        self.request_stop(EXIT_FAILURE)

    async def stop(self) -> None:
        """Stop HTTP. Idempotent; no drain (see :meth:`serve`)."""
        self._stopping = True
        if self._stopped:
            return
        self._stopped = True
        if self._http_server is not None and self._http_task is not None:
            self._http_server.should_exit = True
            done, _ = await asyncio.wait({self._http_task}, timeout=self.stop_timeout_s)
            if not done:
                logger.error("%s: HTTP server did not stop in time; cancelling it", self.name)
                self._http_server.force_exit = True
                self._http_task.cancel()
                await asyncio.wait({self._http_task})

    async def serve(self) -> int:
        """Start, run until stopped (see the module docstring), stop; return the exit code.

        Installs no signal handlers (:func:`run_service` does): call :meth:`request_stop`.
        """
        async with self:
            run_task = asyncio.create_task(self._run_main(), name=f"{self.name}.run")
            stop_wait = asyncio.create_task(self._stop_requested.wait())
            try:
                await asyncio.wait({run_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
                self._stopping = True
                await self._drain()
                run_task.cancel()
                done, _ = await asyncio.wait({run_task}, timeout=self.stop_timeout_s)
                if not done:
                    logger.error(
                        "%s: run() ignored cancellation for %.0fs; it awaits:\n  %s",
                        self.name, self.stop_timeout_s, "\n  ".join(await_chain(run_task)),
                    )  # fmt: skip
                    self._exit_code = max(self._exit_code, EXIT_FAILURE)
        logger.info("%s: stopped with exit code %d", self.name, self._exit_code)
        return self._exit_code

    async def _run_main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise  # the stop sequence cancels run(); not a failure
        except Exception:
            logger.exception("%s: run() crashed", self.name)
            self.request_stop(EXIT_FAILURE)
        else:
            logger.info("%s: run() finished", self.name)
            self.request_stop(EXIT_OK)

    async def _drain(self) -> None:
        logger.info("%s: draining (at most %.1fs)", self.name, self.drain_timeout_s)
        drain_task = asyncio.create_task(self.drain(), name=f"{self.name}.drain")
        force_wait = asyncio.create_task(self._force_stop.wait())
        await asyncio.wait(
            {drain_task, force_wait},
            timeout=self.drain_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        force_wait.cancel()
        if not drain_task.done():
            logger.warning("%s: drain cut short; in-flight work will be redone", self.name)
            drain_task.cancel()
            await asyncio.wait({drain_task})
        elif not drain_task.cancelled() and (exc := drain_task.exception()) is not None:
            logger.error("%s: drain failed", self.name, exc_info=exc)
            self._exit_code = max(self._exit_code, EXIT_FAILURE)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket; binding here (not in uvicorn) gives the real port at once."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        return socket.create_server(address, family=family)
    except OSError as exc:
        raise ServiceError(f"cannot listen on {host}:{port}: {exc}") from exc


async def _serve_with_signals(service: Service) -> int:
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, service._handle_signal, sig)
    try:
        return await service.serve()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""Paths of the probes and the scrape, served by every service and never traced."""


def _is_probe(scope: MutableMapping[str, Any]) -> bool:
    return scope.get("path") in PROBE_PATHS


def run_service(service: Service) -> int:
    """Run ``service`` in this process until it stops; return the process exit code.

    Sets up logging and tracing from ``service.telemetry``, runs the event loop with
    SIGTERM/SIGINT starting the graceful stop (a second signal skips the drain wait), and
    flushes traces at the end. 0 on a clean stop; 1 if ``run()`` or ``drain()`` crashed, or the
    service could not start.
    """
    setup_logging(service.telemetry, service.name)
    provider = setup_tracing(service.name, service.telemetry)
    try:
        return asyncio.run(_serve_with_signals(service))
    except Exception:
        logger.exception("%s: failed", service.name)
        return EXIT_FAILURE
    finally:
        provider.shutdown()
