"""``/v1/jobs``: submit, list, get, cancel, resume, follow (server-sent events), stage
latencies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response, status
from fastapi.responses import StreamingResponse

from conveyor.services.gateway.routes.deps import BackendDep, JobsBackend
from conveyor.services.gateway.schemas import (
    API_PREFIX,
    IDEMPOTENCY_KEY_MAX_CHARS,
    ErrorBody,
    Job,
    JobList,
    JobStages,
    ListLimit,
    StateFilter,
)
from conveyor.training.jobspec import JobSpec

# The full prefix lives on the router (not in include_router) so that the route's own path,
# which the request metrics use as their label, is the public template "/v1/jobs/{job_id}".
router = APIRouter(prefix=f"{API_PREFIX}/jobs", tags=["jobs"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such job."}
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": Job, "description": "Idempotency-Key seen before with this spec."},
        409: {"model": ErrorBody, "description": "Idempotency-Key used with another spec."},
        413: {"model": ErrorBody, "description": "Request body too large."},
        503: {"model": ErrorBody, "description": "Not ready or broker unavailable; retry."},
    },
)
async def submit_job(
    spec: JobSpec,
    backend: BackendDep,
    response: Response,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=IDEMPOTENCY_KEY_MAX_CHARS)
    ] = None,
) -> Job:
    """Accept a job (state ``pending``). The same Idempotency-Key returns the same job.

    422 for an invalid spec, and for a ``checkpoint.uri`` or ``dataset.uri`` outside the roots
    the operator allows (the error's ``msg`` names them); one error per field."""
    job, created = await backend.submit(spec, idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.job_id}"
    return Job.of(job, backend.schedule())


@router.get("")
async def list_jobs(
    backend: BackendDep, state: StateFilter = None, limit: ListLimit = 100
) -> JobList:
    """Jobs, newest submission first; ``state=queued``: the jobs waiting for trainers."""
    schedule = backend.schedule()
    jobs = [Job.of(job, schedule) for job in backend.list_jobs(state=state, limit=limit)]
    return JobList(jobs=jobs, count=len(jobs))


@router.get("/{job_id}", responses=_NOT_FOUND)
async def get_job(job_id: str, backend: BackendDep) -> Job:
    return Job.of(backend.get_job(job_id), backend.schedule())


@router.post(
    "/{job_id}/cancel",
    status_code=status.HTTP_202_ACCEPTED,
    responses={**_NOT_FOUND, 409: {"model": ErrorBody, "description": "Job already finished."}},
)
async def cancel_job(job_id: str, backend: BackendDep) -> Job:
    """Request cancellation; the job turns ``cancelled`` once its services stopped it."""
    return Job.of(await backend.cancel(job_id), backend.schedule())


@router.post(
    "/{job_id}/resume",
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        **_NOT_FOUND,
        409: {"model": ErrorBody, "description": "Not failed or cancelled, or no checkpoint."},
    },
)
async def resume_job(job_id: str, backend: BackendDep) -> Job:
    """Restart a failed or cancelled job, under its id, from its newest usable checkpoint
    (``resumed_from``); it turns ``pending`` and runs on like before. 409 for a job that is
    running or completed, or that has no checkpoint to resume from."""
    return Job.of(await backend.resume(job_id), backend.schedule())


@router.get("/{job_id}/stages", responses=_NOT_FOUND)
async def job_stages(job_id: str, backend: BackendDep) -> JobStages:
    """Per-stage latency percentiles (seconds) of the recent batches, as trainers report them."""
    return JobStages.of(backend.get_job(job_id))


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={**_NOT_FOUND, 200: {"content": {"text/event-stream": {}}}},
)
async def job_events(job_id: str, backend: BackendDep) -> StreamingResponse:
    """Server-sent events: a ``snapshot`` (the job), then one event per applied job event
    (``planned``, ``progress``, ...; data: job_id, event, at, seq, state, data, progress),
    ending after the terminal one. Idle streams get ``: keepalive`` comments."""
    backend.get_job(job_id)  # 404 now, before the stream starts
    return StreamingResponse(
        _event_stream(backend, job_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _frame(event: str, seq: int, data: str) -> str:
    return f"event: {event}\nid: {seq}\ndata: {data}\n\n"


async def _event_stream(backend: JobsBackend, job_id: str) -> AsyncIterator[str]:
    keepalive_s = backend.settings.sse_keepalive_s
    # Subscribe and snapshot with no await in between: no event falls between the two.
    subscription = backend.hub.subscribe(job_id)
    try:
        job = backend.get_job(job_id)
        seen_seq = job.seq
        yield _frame("snapshot", job.seq, Job.of(job, backend.schedule()).model_dump_json())
        if job.terminal:
            return
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    item = await subscription.get()
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            if item is None:  # the gateway is shutting down
                return
            if item.missed:  # this client fell behind: resynchronise with a snapshot
                job = backend.get_job(job_id)
                seen_seq = job.seq
                yield _frame("snapshot", job.seq, Job.of(job, backend.schedule()).model_dump_json())
                if job.terminal:
                    return
                continue
            if item.seq <= seen_seq:
                continue
            seen_seq = item.seq
            yield _frame(item.event, item.seq, json.dumps(item.payload, default=str))
            if item.terminal:
                return
    finally:
        backend.hub.unsubscribe(subscription)
