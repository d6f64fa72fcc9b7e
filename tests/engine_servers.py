"""Local HTTP servers that answer the calls the autoscaler's drivers make, as the engines
document them: the Docker Engine API (v1.41: containers list/inspect/create/start/stop/delete)
and the Kubernetes API (``apps/v1`` deployments' ``scale`` subresource, get and patch).

Each keeps its state in memory and records every request (method, path, query, body), so a
test asserts both what the driver asked and what the engine ended up with.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    content_type: str | None


@dataclass
class Engine:
    """Base: state under a lock, the requests seen, and a JSON handler."""

    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, request: Request) -> tuple[int, Any]:
        raise NotImplementedError


@dataclass
class DockerEngine(Engine):
    """Containers by id; ``State`` "running" or "exited"."""

    containers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, *, project: str, service: str, number: int, state: str = "running") -> str:
        container_id = uuid.uuid4().hex
        labels = {"com.docker.compose.project": project, "com.docker.compose.service": service,
                  "com.docker.compose.container-number": str(number)}  # fmt: skip
        self.containers[container_id] = {
            "Id": container_id, "Name": f"/{project}-{service}-{number}", "State": state,
            "Config": {"Image": "conveyor:0.1.0", "Cmd": ["service", service],
                       "Env": ["CONVEYOR_KAFKA_BOOTSTRAP=kafka:19092"], "Labels": labels,
                       "Hostname": container_id[:12]},
            "HostConfig": {"RestartPolicy": {"Name": "unless-stopped"}},
            "NetworkSettings": {"Networks": {f"{project}_conveyor": {"Aliases": [service]}}},
        }  # fmt: skip
        return container_id

    def running(self, service: str) -> list[str]:
        return sorted(
            c["Name"] for c in self.containers.values()
            if c["State"] == "running" and c["Config"]["Labels"]["com.docker.compose.service"]
            == service
        )  # fmt: skip

    def handle(self, request: Request) -> tuple[int, Any]:
        path = request.path.removeprefix("/v1.41")
        match = re.fullmatch(r"/containers/([0-9a-f]+)(/json|/start|/stop)?", path)
        if request.method == "GET" and path == "/containers/json":
            return 200, self._list(request.query)
        if request.method == "POST" and path == "/containers/create":
            return self._create(request)
        if match is None or match[1] not in self.containers:
            return 404, {"message": f"no such container: {path}"}
        container = self.containers[match[1]]
        if request.method == "GET" and match[2] == "/json":
            return 200, {**container, "State": {"Status": container["State"]}}
        if request.method == "POST" and match[2] in ("/start", "/stop"):
            wanted = "running" if match[2] == "/start" else "exited"
            if container["State"] == wanted:
                return 304, None
            container["State"] = wanted
            return 204, None
        if request.method == "DELETE" and match[2] is None:
            if container["State"] == "running":
                return 409, {"message": "cannot remove a running container"}
            del self.containers[match[1]]
            return 204, None
        return 405, {"message": f"{request.method} {path}"}

    def _list(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        labels = json.loads(query.get("filters", ["{}"])[0]).get("label", [])
        wanted = dict(label.split("=", 1) for label in labels)
        every = query.get("all", ["false"])[0] in ("1", "true")
        return [
            {"Id": c["Id"], "Names": [c["Name"]], "State": c["State"],
             "Labels": c["Config"]["Labels"]}
            for c in self.containers.values()
            if wanted.items() <= c["Config"]["Labels"].items()
            and (every or c["State"] == "running")
        ]  # fmt: skip

    def _create(self, request: Request) -> tuple[int, Any]:
        name = request.query["name"][0]
        body = request.body
        if any(c["Name"] == f"/{name}" for c in self.containers.values()):
            return 409, {"message": f"name {name} in use"}
        if "Image" not in body or "HostConfig" not in body:
            return 400, {"message": "Image and HostConfig are required"}
        container_id = uuid.uuid4().hex
        config = {k: v for k, v in body.items() if k not in ("HostConfig", "NetworkingConfig")}
        networks = body.get("NetworkingConfig", {}).get("EndpointsConfig", {})
        self.containers[container_id] = {
            "Id": container_id, "Name": f"/{name}", "State": "created", "Config": config,
            "HostConfig": body["HostConfig"], "NetworkSettings": {"Networks": networks},
        }  # fmt: skip
        return 201, {"Id": container_id, "Warnings": []}


@dataclass
class KubernetesApi(Engine):
    """Deployments' desired replicas by (namespace, name)."""

    replicas: dict[tuple[str, str], int] = field(default_factory=dict)

    def handle(self, request: Request) -> tuple[int, Any]:
        match = re.fullmatch(
            r"/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale", request.path
        )
        if match is None or (match[1], match[2]) not in self.replicas:
            return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "reason": "NotFound", "code": 404}  # fmt: skip
        key = (match[1], match[2])
        if request.method == "PATCH":
            patch_types = ("application/merge-patch+json", "application/strategic-merge-patch+json")
            if request.content_type not in patch_types:
                return 415, {"kind": "Status", "code": 415, "reason": "UnsupportedMediaType"}
            self.replicas[key] = int(request.body["spec"]["replicas"])
        elif request.method != "GET":
            return 405, {"kind": "Status", "code": 405}
        return 200, {
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": key[1], "namespace": key[0]},
            "spec": {"replicas": self.replicas[key]},
            "status": {"replicas": self.replicas[key], "selector": f"app={key[1]}"},
        }  # fmt: skip


def _handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            request = Request(method=self.command, path=url.path, query=parse_qs(url.query),
                              body=json.loads(raw) if raw else None,
                              content_type=self.headers.get("Content-Type"))  # fmt: skip
            with engine.lock:
                engine.requests.append(request)
                status, body = engine.handle(request)
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def serving(engine: Engine) -> Iterator[str]:
    """Serve ``engine`` on a free local port; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(engine))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
