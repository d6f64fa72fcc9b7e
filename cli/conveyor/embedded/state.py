"""What a running stack looks like on disk: ``<state-dir>/stack.json``.

The file is the only link between ``conveyor up`` and later ``status`` /
``down`` invocations (and ``conveyor run``, which reads the gateway URL from
it). It is replaced atomically and holds no secrets: S3 keys reach the
services through their environment only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.embedded.procs import ProcessInfo
from conveyor.embedded.scrape import remove_scrape_targets, write_scrape_targets
from conveyor.platform.errors import ConveyorError

STATE_FILE = "stack.json"
STATE_VERSION = 1


class StateError(ConveyorError):
    """``stack.json`` exists but cannot be understood."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ServiceInfo:
    """One service process of the stack."""

    name: str
    process: ProcessInfo
    host: str
    port: int
    """Port of the service's HTTP endpoints (/healthz, /readyz, /metrics, and the API)."""
    serves_api: bool = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/healthz"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"


@dataclass(kw_only=True, slots=True, frozen=True)
class StackState:
    """Everything ``conveyor up`` started, as recorded in ``stack.json``."""

    state_dir: str
    """Absolute path of the state directory."""
    started_at: float
    """Unix time (s) at which ``conveyor up`` started the stack."""
    bootstrap: str
    """Kafka bootstrap address the services use."""
    broker: ProcessInfo | None
    """The embedded broker process; None when the stack uses an external Kafka cluster."""
    storage_uri: str
    """Root of the object store (``file://<abs dir>`` or ``s3://bucket[/prefix]``)."""
    storage_endpoint: str | None = None
    """host:port of the S3 endpoint for ``s3://`` stores."""
    output_roots: tuple[str, ...] = ()
    """Where jobs may write besides the object store (``conveyor up --allow-output``)."""
    dataset_roots: tuple[str, ...] = ()
    """Where jobs may read datasets besides the object store (``conveyor up --allow-data``)."""
    services: tuple[ServiceInfo, ...] = field(default=())

    @property
    def gateway_url(self) -> str | None:
        """Base URL of the service that serves the user-facing API, if one runs."""
        return next((s.base_url for s in self.services if s.serves_api), None)

    def processes(self) -> list[ProcessInfo]:
        """Every recorded process, services first (the order to stop them in), broker last."""
        found = [s.process for s in reversed(self.services)]
        return [*found, self.broker] if self.broker else found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["version"] = STATE_VERSION
        data["gateway_url"] = self.gateway_url
        for service, info in zip(data["services"], self.services, strict=True):
            service["health_url"] = info.health_url
            service["metrics_url"] = info.metrics_url
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackState:
        if data.get("version") != STATE_VERSION:
            raise StateError(f"unsupported stack.json version {data.get('version')!r}")
        try:
            broker = data["broker"]
            services = tuple(
                ServiceInfo(
                    name=s["name"],
                    process=ProcessInfo(**s["process"]),
                    host=s["host"],
                    port=int(s["port"]),
                    serves_api=bool(s.get("serves_api", False)),
                )
                for s in data["services"]
            )
            return cls(
                state_dir=data["state_dir"],
                started_at=float(data["started_at"]),
                bootstrap=data["bootstrap"],
                broker=ProcessInfo(**broker) if broker else None,
                storage_uri=data["storage_uri"],
                storage_endpoint=data.get("storage_endpoint"),
                output_roots=tuple(data.get("output_roots", ())),
                dataset_roots=tuple(data.get("dataset_roots", ())),
                services=services,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"malformed stack.json: {exc!r}") from exc


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def load_state(state_dir: Path) -> StackState | None:
    """The recorded stack, or None when none is recorded. Raises :class:`StateError` on a
    file that is not a stack record."""
    path = state_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise StateError("it does not hold a JSON object")
        return StackState.from_json(data)
    except (json.JSONDecodeError, StateError) as exc:
        raise StateError(
            f"{path} is not a usable stack record ({exc}); stop any processes it names by "
            "hand and delete it"
        ) from exc


def save_state(state: StackState) -> None:
    """Write ``stack.json`` atomically (temp file + fsync + rename), and the Prometheus scrape
    targets that follow it (:mod:`conveyor.embedded.scrape`)."""
    path = state_path(Path(state.state_dir))
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as out:
        json.dump(state.to_json(), out, indent=2)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    write_scrape_targets(state)


def remove_state(state_dir: Path) -> None:
    state_path(state_dir).unlink(missing_ok=True)
    remove_scrape_targets(state_dir)


@contextlib.contextmanager
def state_lock(state_dir: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the state directory, so two ``up``/``down`` (or the
    supervisor's changes) never interleave. Yields True once held; with ``wait=False`` yields
    False at once, holding nothing, when another process holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
