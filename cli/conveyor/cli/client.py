"""A small synchronous client of the gateway's ``/v1`` API, used by the command line.

Every call raises :class:`GatewayError` with the gateway's own message on an error status, and
:class:`GatewayUnavailable` (retriable) when the gateway cannot be reached or is not ready.
"""

from __future__ import annotations

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

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json(self._request("POST", f"/v1/jobs/{job_id}/cancel"))

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        """The job's checkpoints, newest first (``GET /v1/jobs/{id}/checkpoints``)."""
        return self._json(self._request("GET", f"/v1/jobs/{job_id}/checkpoints"))

    def request_checkpoint(self, job_id: str) -> dict[str, Any]:
        """Ask for a checkpoint at the job's next step; returns the job."""
        return self._json(self._request("POST", f"/v1/jobs/{job_id}/checkpoints"))

    def model_file(self, job_id: str, name: str) -> bytes:
        """One file of the job's exported model (``model.safetensors``, ``config.json``)."""
        response = self._request("GET", f"/v1/jobs/{job_id}/model/{name}")
        if response.status_code >= 400:
            self._json(response)  # raises with the gateway's reason
        return response.content

    def stages(self, job_id: str) -> dict[str, Any]:
        return self._json(self._request("GET", f"/v1/jobs/{job_id}/stages"))

    def follow(self, job_id: str, *, interval_s: float = 0.5) -> Iterator[dict[str, Any]]:
        """Yield the job every ``interval_s`` until it reaches a terminal state (yielded last)."""
        while True:
            job = self.job(job_id)
            yield job
            if job["state"] in TERMINAL_STATES:
                return
            time.sleep(interval_s)

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
