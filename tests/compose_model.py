"""docker-compose.yml as `docker compose` reads it, for tests on machines without Docker.

``load_compose`` parses the file (YAML merge keys included) and interpolates ``${VAR}``,
``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``$VAR`` and ``$$``
the way compose does, from a given environment (default: none, so the file's defaults apply).
The helpers below read what a service gets: its environment, its published ports, the Conveyor
services (those built from infra/Dockerfile). Importable from any test as
``from compose_model import ...`` (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
WORKER_FILE = ROOT / "infra" / "worker-node.compose.yml"
CONVEYOR_DOCKERFILE = "infra/Dockerfile"

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    """A ``${VAR:?message}`` whose variable is missing, or a ``$`` compose would reject."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with its variables replaced as compose replaces them."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        value = env.get(name)
        unset_or_empty = value is None or value == ""
        if op == ":-":
            return arg if unset_or_empty else str(value)
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?"):
            missing = unset_or_empty if op == ":?" else value is None
            if missing:
                raise InterpolationError(f"{name}: {arg or 'required variable is missing'}")
            return str(value)
        return value or ""

    result = _VARIABLE.sub(replace, text)
    # Whatever `$` is left over did not match any form compose knows (e.g. `${A:-${B}}`).
    if "$" in _VARIABLE.sub("", text.replace("$$", "")):
        raise InterpolationError(f"unsupported interpolation in {text!r}")
    return result


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def load_compose(path: Path = COMPOSE_FILE, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as a mapping, merge keys resolved and variables interpolated from
    ``env`` (default: an empty environment, so every ``${VAR:-default}`` takes its default)."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    interpolated: dict[str, Any] = _interpolate_tree(data, env or {})
    return interpolated


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """The variables compose sets in the service's container (``environment:``, either form),
    as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(key): "" if value is None else _scalar(value) for key, value in env.items()}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True, slots=True)
class PublishedPort:
    """One ``ports:`` entry in short syntax: ``[HOST_IP:][HOST_PORT:]CONTAINER_PORT[/PROTO]``."""

    host_ip: str | None
    host_port: int | None
    container_port: int
    protocol: str = "tcp"

    @classmethod
    def parse(cls, entry: str | int) -> PublishedPort:
        text, _, protocol = str(entry).partition("/")
        parts = text.split(":")
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"not a short-syntax port: {entry!r}")
        host_ip = parts[0] if len(parts) == 3 else None
        host_port = int(parts[-2]) if len(parts) >= 2 else None
        return cls(host_ip, host_port, int(parts[-1]), protocol or "tcp")


def published_ports(service: Mapping[str, Any]) -> list[PublishedPort]:
    return [PublishedPort.parse(entry) for entry in service.get("ports", [])]


def container_ports(service: Mapping[str, Any]) -> set[int]:
    """Ports the service listens on inside the network (``expose`` and published targets)."""
    exposed = {int(str(port)) for port in service.get("expose", [])}
    return exposed | {port.container_port for port in published_ports(service)}


def conveyor_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run Conveyor: built from infra/Dockerfile."""
    return {
        name: service
        for name, service in compose["services"].items()
        if isinstance(service.get("build"), dict)
        and service["build"].get("dockerfile") == CONVEYOR_DOCKERFILE
    }


def default_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What a plain `docker compose up` starts: the services outside every profile."""
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles")
    }


def start_order(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Service names in an order that starts every ``depends_on`` first; AssertionError on a
    cycle or on a dependency that is not among ``services``."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        assert name not in visiting, f"depends_on cycle through {name}"
        assert name in services, f"depends_on names {name!r}, which is not a service"
        visiting.add(name)
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order
