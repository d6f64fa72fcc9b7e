"""``/v1/queue``: the trainer pool, which jobs have trainers and which wait, in order."""

from __future__ import annotations

from fastapi import APIRouter

from conveyor.services.gateway.routes.deps import BackendDep
from conveyor.services.gateway.schemas import API_PREFIX, PlacedJob, Queue, QueuedJob
from conveyor.training.scheduling import Demand

router = APIRouter(prefix=f"{API_PREFIX}/queue", tags=["queue"])


@router.get("")
async def get_queue(backend: BackendDep) -> Queue:
    """The schedule the trainers compute from the jobs topic, as this gateway has read it."""
    schedule = backend.schedule()
    placed_ids = list(dict.fromkeys(schedule.placement.values()))
    demands = {job_id: backend.get_job(job_id) for job_id in (*placed_ids, *schedule.queue)}

    def demand_of(job_id: str) -> Demand:
        demand = demands[job_id].demand
        assert demand is not None  # scheduled jobs have one
        return demand

    placed = sorted(placed_ids, key=lambda job_id: demand_of(job_id).rank)
    return Queue(
        pool_size=schedule.pool_size,
        idle_trainers=schedule.idle,
        placed=[
            PlacedJob(
                id=job_id,
                name=demands[job_id].name,
                priority=demand_of(job_id).priority,
                trainers=schedule.trainers_of(job_id),
                min_trainers=demand_of(job_id).fewest,
                max_trainers=demand_of(job_id).most,
            )
            for job_id in placed
        ],
        queued=[
            QueuedJob(
                id=job_id,
                name=demands[job_id].name,
                position=position,
                priority=demand_of(job_id).priority,
                min_trainers=demand_of(job_id).fewest,
                submitted_at=demands[job_id].submitted_at,
            )
            for position, job_id in enumerate(schedule.queue, start=1)
        ],
    )
