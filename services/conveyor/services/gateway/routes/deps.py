"""Typed dependencies of the routes: the backend they call and the bearer-token check."""

from __future__ import annotations

import hmac
from typing import Annotated, Protocol

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from conveyor.services.gateway.artifacts import JobArtifacts
from conveyor.services.gateway.autoscaling import AutoscalerLog
from conveyor.services.gateway.config import GatewaySettings
from conveyor.services.gateway.events import EventHub
from conveyor.services.gateway.schemas import ShownState
from conveyor.training.jobspec import JobSpec
from conveyor.training.jobview import JobView
from conveyor.training.scheduling import Schedule


class JobsBackend(Protocol):
    """What the routes need from the gateway service (GatewayService implements it)."""

    settings: GatewaySettings
    hub: EventHub
    artifacts: JobArtifacts
    autoscaler: AutoscalerLog

    def get_job(self, job_id: str) -> JobView: ...

    def list_jobs(self, *, state: ShownState | None, limit: int) -> list[JobView]: ...

    def schedule(self) -> Schedule: ...

    async def submit(self, spec: JobSpec, idempotency_key: str | None) -> tuple[JobView, bool]: ...

    async def cancel(self, job_id: str) -> JobView: ...

    async def request_checkpoint(self, job_id: str) -> JobView: ...

    async def resume(self, job_id: str) -> JobView: ...


def get_backend(request: Request) -> JobsBackend:
    backend: JobsBackend = request.app.state.jobs_backend
    return backend


BackendDep = Annotated[JobsBackend, Depends(get_backend)]

_bearer = HTTPBearer(auto_error=False, description="Required when the gateway has an api_token.")


async def require_token(
    backend: BackendDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 (with a WWW-Authenticate challenge) without a bearer token, 403 with a wrong one."""
    expected = backend.settings.api_token
    if expected is None:
        return
    if credentials is None:
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing bearer token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": 'Bearer realm="conveyor"'},
        )
    # Constant-time comparison: response timing must not reveal a token prefix.
    if not hmac.compare_digest(
        credentials.credentials.encode(), expected.get_secret_value().encode()
    ):
        raise HTTPException(status_code=status.HTTP_403_FORBIDDEN, detail="invalid bearer token")
