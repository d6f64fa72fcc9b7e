"""The ``docker`` driver: the containers of one compose service, over the Docker Engine API.

Docker has no "scale" call (``docker compose up --scale`` is the compose client creating and
removing containers), so this driver does what compose does, through the documented Engine
API (v1.41, Docker 20.10 and later):

* count: ``GET /containers/json?filters={"label": [project, service]}`` (running ones);
* up: inspect the newest container of the service (``GET /containers/{id}/json``) and create
  copies of it (``POST /containers/create?name=<project>-<service>-<n>``, its config, host
  config, networks with their aliases, and the compose labels with the next
  ``container-number``), then ``POST /containers/{id}/start``;
* down: the highest-numbered containers first, ``POST /containers/{id}/stop?t=<grace>``
  (SIGTERM: a preprocessor drains) and ``DELETE /containers/{id}``.

``docker compose up`` later sees the containers as its own (same labels), so ``--scale`` and
this driver can take turns.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from conveyor.services.autoscaler.drivers.base import DriverError, ScaleDriver

API = "/v1.41"
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"


def engine_client(url: str, *, timeout_s: float = 30.0) -> httpx.AsyncClient:
    """An HTTP client for the Engine at ``url`` (``unix:///var/run/docker.sock`` or
    ``http(s)://host:port``)."""
    if url.startswith("unix://"):
        transport = httpx.AsyncHTTPTransport(uds=url.removeprefix("unix://"))
        return httpx.AsyncClient(transport=transport, base_url="http://docker", timeout=timeout_s)
    return httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s)


class DockerDriver(ScaleDriver):
    """Scales compose service ``service`` of compose project ``project``."""

    name = "docker"

    def __init__(
        self, *, client: httpx.AsyncClient, project: str, service: str, stop_grace_s: int = 30
    ) -> None:
        self._client = client
        self._project = project
        self._service = service
        self._stop_grace_s = stop_grace_s

    async def replicas(self) -> int:
        return len(await self._containers(running_only=True))

    async def scale(self, replicas: int) -> None:
        containers = await self._containers(running_only=False)
        running = [c for c in containers if c["State"] == "running"]
        if replicas > len(running):
            if not containers:
                raise DriverError(
                    f"no container of compose service {self._service!r} in project "
                    f"{self._project!r} to copy: start the stack with docker compose first"
                )
            template = await self._call("GET", f"/containers/{containers[0]['Id']}/json")
            numbers = [_number(c) for c in containers]
            for offset in range(1, replicas - len(running) + 1):
                await self._create_and_start(template, max(numbers) + offset)
        for container in running[: max(0, len(running) - replicas)]:
            await self._call("POST", f"/containers/{container['Id']}/stop",
                             params={"t": self._stop_grace_s})  # fmt: skip
            await self._call("DELETE", f"/containers/{container['Id']}")

    async def close(self) -> None:
        await self._client.aclose()

    async def _containers(self, *, running_only: bool) -> list[dict[str, Any]]:
        """The service's containers, highest container number first."""
        filters = {"label": [f"{PROJECT_LABEL}={self._project}",
                             f"{SERVICE_LABEL}={self._service}"]}  # fmt: skip
        params = {"all": "false" if running_only else "true", "filters": json.dumps(filters)}
        found = await self._call("GET", "/containers/json", params=params)
        if not isinstance(found, list):
            raise DriverError(f"GET /containers/json answered {type(found).__name__}, not a list")
        return sorted(found, key=_number, reverse=True)

    async def _create_and_start(self, template: dict[str, Any], number: int) -> None:
        config = dict(template["Config"])
        labels = dict(config.get("Labels") or {})
        labels[NUMBER_LABEL] = str(number)
        config["Labels"] = labels
        config.pop("Hostname", None)  # the copy gets its own (the container id)
        networks = (template.get("NetworkSettings") or {}).get("Networks") or {}
        body = {
            **config,
            "HostConfig": template.get("HostConfig") or {},
            "NetworkingConfig": {"EndpointsConfig": {
                name: {"Aliases": network.get("Aliases") or [self._service]}
                for name, network in networks.items()
            }},
        }  # fmt: skip
        name = f"{self._project}-{self._service}-{number}"
        created = await self._call("POST", "/containers/create", params={"name": name}, body=body)
        await self._call("POST", f"/containers/{created['Id']}/start")

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Any:
        try:
            response = await self._client.request(method, API + path, params=params, json=body)
        except httpx.HTTPError as exc:
            raise DriverError(f"Docker Engine {method} {path}: {exc}") from exc
        if response.status_code == 304:  # start/stop of a container already in that state
            return None
        if response.status_code >= 400:
            raise DriverError(f"Docker Engine {method} {path}: {response.status_code} "
                              f"{response.text[:300]}")  # fmt: skip
        return response.json() if response.content else None


def _number(container: dict[str, Any]) -> int:
    labels = container.get("Labels") or {}
    try:
        return int(labels.get(NUMBER_LABEL, "0"))
    except ValueError:
        return 0
