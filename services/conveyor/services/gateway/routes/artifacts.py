"""``/v1/jobs/{id}/checkpoints`` and ``/v1/jobs/{id}/model/{file}``: what a job left in its
object store, and asking for a checkpoint now."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import APIRouter, Response, status

from conveyor.services.gateway.routes.deps import BackendDep
from conveyor.services.gateway.schemas import API_PREFIX, Checkpoint, CheckpointList, ErrorBody, Job

router = APIRouter(prefix=f"{API_PREFIX}/jobs", tags=["checkpoints"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such job (or file)."}
}


@router.get("/{job_id}/checkpoints", responses=_NOT_FOUND)
async def list_checkpoints(job_id: str, backend: BackendDep) -> CheckpointList:
    """The job's checkpoints, newest first: committed ones and incomplete ones (being written,
    or torn by a crash; never loaded)."""
    job = backend.get_job(job_id)
    rows = await asyncio.to_thread(backend.artifacts.checkpoints, job)
    checkpoints = [Checkpoint(**dataclasses.asdict(row)) for row in rows]
    return CheckpointList(id=job_id, checkpoints=checkpoints, count=len(checkpoints))


@router.post(
    "/{job_id}/checkpoints",
    status_code=status.HTTP_202_ACCEPTED,
    responses={**_NOT_FOUND, 409: {"model": ErrorBody, "description": "Job not running."}},
)
async def request_checkpoint(job_id: str, backend: BackendDep) -> Job:
    """Ask for a checkpoint at the job's next step; it appears in the list once committed
    (a ``checkpoint`` event in the job's event stream)."""
    return Job.of(await backend.request_checkpoint(job_id), backend.schedule())


@router.get(
    "/{job_id}/model/{name}",
    response_class=Response,
    responses={**_NOT_FOUND, 200: {"content": {"application/octet-stream": {}}}},
)
async def model_file(job_id: str, name: str, backend: BackendDep) -> Response:
    """A file of the job's exported model: ``model.safetensors`` (the state_dict),
    ``config.json`` (how to rebuild and feed it) or ``losses.json`` (the per-step training
    losses)."""
    job = backend.get_job(job_id)
    data = await asyncio.to_thread(backend.artifacts.model_file, job, name)
    media = "application/json" if name.endswith(".json") else "application/octet-stream"
    return Response(content=data, media_type=media)
