"""ASGI middleware of the gateway: request body limit (413) and request metrics."""

from __future__ import annotations

import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.platform.telemetry import counter, histogram


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Rejects request bodies over ``max_body_bytes`` with 413 before the app sees them.

    A ``Content-Length`` over the limit is refused up front; otherwise the body (chunked or
    not) is read up to the limit and handed to the app from memory, so a client that sends
    more than it announced, or streams without a length, is cut off as well. Memory is bounded
    by the limit (1 MiB by default).

    Before answering 413 the rest of the body is read and dropped, up to
    ``max_discard_bytes``: a server that closes a socket with unread data makes the kernel
    reset the connection, and most clients then report a connection error instead of the 413.
    A client that sent ``Expect: 100-continue`` has sent nothing yet and is answered at once.
    """

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int, max_discard_bytes: int | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_discard_bytes = (
            8 * max_body_bytes if max_discard_bytes is None else max_discard_bytes
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        announced: int | None = None
        if b"content-length" in headers:
            try:
                announced = int(headers[b"content-length"])
            except ValueError:
                await _reply(send, 400, "invalid Content-Length header")
                return
        if announced is not None and announced > self.max_body_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await self._discard(receive, received_bytes=0)
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; nobody to answer
            chunk = message.get("body", b"")
            more_body = message.get("more_body", False)
            size += len(chunk)
            if size > self.max_body_bytes:
                if more_body:
                    await self._discard(receive, received_bytes=size)
                await self._too_large(send)
                return
            chunks.append(chunk)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _discard(self, receive: Receive, *, received_bytes: int) -> None:
        """Read and drop the rest of the body, at most up to ``max_discard_bytes`` in all."""
        while received_bytes <= self.max_discard_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            received_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _too_large(self, send: Send) -> None:
        await _reply(send, 413, f"request body exceeds the limit of {self.max_body_bytes} bytes")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the client's later messages."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect, watched by streaming responses

    return replay


class RequestMetricsMiddleware:
    """Counts responses in ``conveyor_gateway_requests_total{route,code}`` and times them in
    ``conveyor_gateway_request_seconds{route}`` (from the request's arrival to the end of its
    response; an event stream counts once it ends).

    ``route`` is the matched path template (``/v1/jobs/{job_id}``), never the raw path, so the
    label set stays bounded; unmatched paths count as ``unmatched``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._requests = counter(
            "gateway", "requests_total", "HTTP responses by route and status code.",
            ["route", "code"],
        )  # fmt: skip
        self._seconds = histogram(
            "gateway", "request_seconds", "HTTP request duration by route.", ["route"]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before responding
        started_s = time.perf_counter()

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self._requests.labels(route=template, code=str(status)).inc()
            self._seconds.labels(route=template).observe(time.perf_counter() - started_s)
