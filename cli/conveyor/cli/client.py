"""A small synchronous client of the gateway's ``/v1`` API, used by the command line.

Every call raises :class:`GatewayError` with the gateway's own message on an error status, and
:class:`GatewayUnavailable` (retriable) when the gateway cannot be reached or is not ready.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx

from conveyor.platform.errors import ConveyorError

TERMINAL_STATES = frozenset({"completed", "failed", "cancelled"})


class GatewayError(ConveyorError):
    """The gateway answered with an error; ``status_code`` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, *, status_code: int = 0) -> None:
        super().__init__(message)
        self.status_code = status_code


class GatewayUnavailable(GatewayError):
    """The gateway is unreachable or not ready yet."""

    retriable: ClassVar[bool] = True


class GatewayClient:
    """Talks to one gateway at ``base_url``; ``token`` is sent as a bearer token when set."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until ``/readyz`` answers 200 (the gateway has replayed the job log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._http.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise GatewayUnavailable(f"gateway {self._http.base_url} not ready in {timeout_s}s")
            time.sleep(0.2)

    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        """POST the spec; returns the job. Retries while the gateway answers 503."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        for attempt in range(20):
            response = self._request("POST", "/v1/jobs", json=spec, headers=headers)
            if response.status_code != 503:
                return self._json(response)
            time.sleep(min(0.25 * (attempt + 1), 2.0))
        raise GatewayUnavailable("gateway kept answering 503 to the submission", status_code=503)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._json(self._request("GET", f"/v1/jobs/{job_id}"))

    def jobs(self, *, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        params: dict[str, str | int] = {"limit": limit}
        if state:
            params["state"] = state
        jobs: list[dict[str, Any]] = self._json(self._request("GET", "/v1/jobs", params=params))[
            "jobs"
        ]
        return jobs

    def queue(self) -> dict[str, Any]:
        """The trainer pool, the jobs placed on it and the queue (``GET /v1/queue``)."""
        return self._json(self._request("GET", "/v1/queue"))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json(self._request("POST", f"/v1/jobs/{job_id}/cancel"))

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        """The job's checkpoints, newest first (``GET /v1/jobs/{id}/checkpoints``)."""
        return self._json(self._request("GET", f"/v1/jobs/{job_id}/checkpoints"))

    def request_checkpoint(self, job_id: str) -> dict[str, Any]:
        """Ask for a checkpoint at the job's next step; returns the job."""
        return self._json(self._request("POST", f"/v1/jobs/{job_id}/checkpoints"))

    def resume(self, job_id: str) -> dict[str, Any]:
        """Restart a failed or cancelled job from its newest usable checkpoint; returns the
        job (``resumed_from``: the checkpoint's version)."""
        return self._json(self._request("POST", f"/v1/jobs/{job_id}/resume"))

    def model_file(self, job_id: str, name: str) -> bytes:
        """One file of the job's exported model (``model.safetensors``, ``config.json``,
        ``losses.json``)."""
        response = self._request("GET", f"/v1/jobs/{job_id}/model/{name}")
        if response.status_code >= 400:
            self._json(response)  # raises with the gateway's reason
        return response.content

    def stages(self, job_id: str) -> dict[str, Any]:
        return self._json(self._request("GET", f"/v1/jobs/{job_id}/stages"))

    def follow(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Yield the job as it changes, from the gateway's event stream (no polling), until it
        is terminal (the complete job, summary included, is yielded last). A dropped stream is
        opened again (the gateway starts each with a snapshot), after a short pause."""
        while True:
            job: dict[str, Any] | None = None
            try:
                with self._http.stream(
                    "GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(10.0, read=None)
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        self._json(response)  # raises with the gateway's reason
                    for event, data in _sse_frames(response.iter_lines()):
                        if event == "snapshot":
                            job = data
                        elif job is not None:
                            job = _apply_event(job, event, data)
                        if job is None:
                            continue
                        if job["state"] in TERMINAL_STATES:
                            yield self.job(job_id)  # with its summary
                            return
                        yield job
            except httpx.TransportError:
                pass  # the gateway restarted or the connection dropped: open it again
            if job is not None and job["state"] in TERMINAL_STATES:
                return
            time.sleep(0.5)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise GatewayUnavailable(
                f"cannot reach the gateway at {self._http.base_url}: {exc}"
            ) from exc

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            if isinstance(detail, list):  # 422: field-level errors
                detail = "; ".join(
                    f"{'.'.join(str(p) for p in item.get('loc', [])[1:])}: {item.get('msg')}"
                    for item in detail
                )
            raise GatewayError(
                f"HTTP {response.status_code}: {detail}", status_code=response.status_code
            )
        body: dict[str, Any] = response.json()
        return body


def _sse_frames(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, JSON data) of each server-sent event; comment lines (keepalives) are skipped."""
    event, data = "message", ""
    for line in lines:
        if line.startswith("event:"):
            event = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data += line.removeprefix("data:").strip()
        elif not line and data:
            yield event, json.loads(data)
            event, data = "message", ""


def _apply_event(job: dict[str, Any], event: str, data: dict[str, Any]) -> dict[str, Any]:
    """The job after one stream event (its state and progress; an epoch's results)."""
    job = {
        **job,
        "state": data.get("state", job["state"]),
        "queue_position": data.get("queue_position", job.get("queue_position")),
        "progress": data.get("progress", job["progress"]),
    }
    if event == "epoch_completed":
        details = data.get("data") or {}
        epochs = [e for e in job.get("epochs") or [] if e.get("epoch") != details.get("epoch")]
        job["epochs"] = sorted([*epochs, details], key=lambda e: e.get("epoch", 0))
    return job
