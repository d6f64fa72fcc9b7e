"""``/v1/autoscaler``: the autoscaler's current state, recent decisions and restarts."""

from __future__ import annotations

from fastapi import APIRouter

from conveyor.services.gateway.routes.deps import BackendDep
from conveyor.services.gateway.schemas import API_PREFIX, AutoscalerStatus

router = APIRouter(prefix=f"{API_PREFIX}/autoscaler", tags=["autoscaler"])


@router.get("")
async def autoscaler_status(backend: BackendDep) -> AutoscalerStatus:
    """The preprocessor pool as the autoscaler last decided it (``state``: replicas, bounds,
    the inputs: each running job's data wait and batch backlog, the shard backlog), the
    decisions that changed it (newest first) and the dead services its supervisor restarted.
    ``state`` is null until the autoscaler has run."""
    return AutoscalerStatus(**backend.autoscaler.snapshot())
