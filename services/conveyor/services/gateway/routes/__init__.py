"""The gateway's API routes (one router per resource) and the mapping of errors to statuses."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request, status
from fastapi.responses import JSONResponse

from conveyor.services.gateway.errors import (
    ArtifactNotFound,
    GatewayError,
    GatewayUnavailable,
    IdempotencyConflict,
    JobFinished,
    JobNotFound,
    JobNotResumable,
    JobNotRunning,
    LocationsRefused,
)
from conveyor.services.gateway.routes import artifacts, autoscaler, jobs, pages, queue
from conveyor.services.gateway.routes.deps import JobsBackend, require_token

_STATUS: dict[type[GatewayError], int] = {
    JobNotFound: status.HTTP_404_NOT_FOUND,
    ArtifactNotFound: status.HTTP_404_NOT_FOUND,
    JobNotRunning: status.HTTP_409_CONFLICT,
    JobNotResumable: status.HTTP_409_CONFLICT,
    JobFinished: status.HTTP_409_CONFLICT,
    IdempotencyConflict: status.HTTP_409_CONFLICT,
    GatewayUnavailable: status.HTTP_503_SERVICE_UNAVAILABLE,
}


async def _gateway_error(request: Request, exc: Exception) -> JSONResponse:
    code = next(
        (code for kind, code in _STATUS.items() if isinstance(exc, kind)),
        status.HTTP_500_INTERNAL_SERVER_ERROR,
    )
    headers = {"Retry-After": "1"} if code == status.HTTP_503_SERVICE_UNAVAILABLE else None
    return JSONResponse({"detail": str(exc)}, status_code=code, headers=headers)


async def _locations_refused(request: Request, exc: Exception) -> JSONResponse:
    # The shape of FastAPI's own 422 (one error per field, "loc" from "body"), so a client reads
    # every refused spec the same way.
    assert isinstance(exc, LocationsRefused)
    detail = [
        {
            "type": "location_not_allowed",
            "loc": ["body", *refusal.field.split(".")],
            "msg": refusal.reason,
        }
        for refusal in exc.refusals
    ]
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def install_routes(app: FastAPI, backend: JobsBackend) -> None:
    """Mount every ``/v1`` router and the job pages on ``app`` (bearer auth on all of them),
    serving ``backend``."""
    app.state.jobs_backend = backend
    app.include_router(jobs.router, dependencies=[Depends(require_token)])
    app.include_router(artifacts.router, dependencies=[Depends(require_token)])
    app.include_router(autoscaler.router, dependencies=[Depends(require_token)])
    app.include_router(queue.router, dependencies=[Depends(require_token)])
    app.include_router(pages.router, dependencies=[Depends(require_token)])
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(LocationsRefused, _locations_refused)  # the more specific wins
