"""docker-compose.yml, infra/worker-node.compose.yml and the infra/ configs as the static compose
checks read them (test_compose_*.py): the files parsed, the services' environment, ports, mounts
and Kafka listeners (the ``compose`` and ``services`` fixtures are in conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from compose_model import environment, published_ports

ROOT = Path(__file__).resolve().parents[2]


TELEMETRY_PORT = 9100


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    return data


_env = environment


def _port_pairs(service: dict[str, Any]) -> list[tuple[int, int]]:
    """(host port, container port) of every published port."""
    pairs = []
    for port in published_ports(service):
        assert port.host_port is not None, f"publish ports as HOST:CONTAINER, got {port}"
        pairs.append((port.host_port, port.container_port))
    return pairs


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of every volume entry (short syntax)."""
    return [tuple(str(v).split(":")[:2]) for v in service.get("volumes", [])]  # type: ignore[misc]


def _host_path(service: dict[str, Any], container_path: str) -> Path:
    """The file on this machine that a bind mount puts at ``container_path``."""
    for source, target in _mounts(service):
        if source.startswith("./") and (
            container_path == target or container_path.startswith(target.rstrip("/") + "/")
        ):
            return ROOT / source / container_path[len(target) :].lstrip("/")
    raise AssertionError(f"{container_path} is not inside any bind mount")


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(address if "://" in address else f"//{address}")
    assert parts.hostname and parts.port, f"no host:port in {address!r}"
    return parts.hostname, parts.port


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> {NAME: (host, port)}."""
    result = {}
    for item in value.split(","):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        result[name] = (host, int(port))
    return result
