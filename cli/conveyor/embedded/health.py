"""Probes that tell whether a part of the stack is up: broker, object store, services."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from conveyor.platform.errors import ConveyorError


class HealthError(ConveyorError):
    """A component did not become healthy in time."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Probe:
    """Outcome of one health probe."""

    healthy: bool
    detail: str
    """What was seen ("12 topics", "HTTP 200", the error)."""


def _split_host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(f"//{address}")
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"expected host:port, got {address!r}")
    return parts.hostname, parts.port


def tcp_probe(address: str, timeout_s: float = 1.0) -> Probe:
    """Can a TCP connection to ``host:port`` be opened?"""
    try:
        host, port = _split_host_port(address)
        with socket.create_connection((host, port), timeout=timeout_s):
            return Probe(healthy=True, detail="accepts connections")
    except (OSError, ValueError) as exc:
        return Probe(healthy=False, detail=f"{address}: {exc}")


async def _count_topics(bootstrap: str, timeout_s: float) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(timeout_s * 1000),
        client_id="conveyor-status",
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        topics = await asyncio.wait_for(admin.list_topics(), timeout_s)
    finally:
        await admin.close()
    return len(topics)


def broker_probe(bootstrap: str, timeout_s: float = 5.0) -> Probe:
    """TCP connect to the first bootstrap address, then a metadata request (topic count)."""
    first = bootstrap.split(",")[0].strip()
    reachable = tcp_probe(first, timeout_s=min(timeout_s, 2.0))
    if not reachable.healthy:
        return reachable
    try:
        count = asyncio.run(_count_topics(bootstrap, timeout_s))
    except Exception as exc:  # any client failure means "not serving metadata"
        return Probe(healthy=False, detail=f"metadata request failed: {exc!r}")
    return Probe(healthy=True, detail=f"{count} topics")


def http_probe(url: str, timeout_s: float = 2.0, *, pid: int | None = None) -> Probe:
    """GET ``url``; healthy on HTTP 200 and, when ``pid`` is given, only if the answer names
    that process (``{"pid": ...}`` of a service's /healthz): another process on the same port
    is not the service asked about."""
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return Probe(healthy=False, detail=f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return Probe(healthy=False, detail=f"HTTP {response.status_code}")
    if pid is not None:
        try:
            answered = response.json().get("pid")
        except (ValueError, AttributeError):
            answered = None
        if answered != pid:
            return Probe(healthy=False, detail=f"answered by pid {answered}, not {pid}")
    return Probe(healthy=True, detail="HTTP 200")


def log_tail(path: str | Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("" if it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_until_healthy(
    name: str,
    url: str,
    process: subprocess.Popen[bytes],
    *,
    log_path: str,
    deadline: float,
    poll_s: float = 0.1,
) -> None:
    """Poll ``url`` until ``process`` answers 200 there (checked by pid).

    Raises :class:`HealthError` naming the service, its log file and the log's last lines when
    the process exits first or ``deadline`` (``time.monotonic()`` value) passes.
    """
    last = Probe(healthy=False, detail="not probed yet")
    while True:
        code = process.poll()
        if code is not None:
            problem = f"service {name!r} exited with code {code} before becoming healthy"
            break
        last = http_probe(url, timeout_s=1.0, pid=process.pid)
        if last.healthy:
            return
        if time.monotonic() >= deadline:
            problem = f"service {name!r} was not healthy in time (last probe: {last.detail})"
            break
        time.sleep(poll_s)
    tail = log_tail(log_path)
    message = f"{problem}; log: {log_path}"
    raise HealthError(f"{message}\n{tail}" if tail else message)
