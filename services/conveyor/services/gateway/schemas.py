"""Request and response bodies of the gateway API, with their limits stated once.

The request body of ``POST /v1/jobs`` is :class:`~conveyor.training.jobspec.JobSpec` itself.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, Field

from conveyor.training.jobview import JobState, JobView
from conveyor.training.scheduling import Schedule

API_PREFIX = "/v1"
MAX_LIST_LIMIT = 1000
IDEMPOTENCY_KEY_MAX_CHARS = 200

ListLimit = Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT, description="Most jobs returned.")]
ShownState = JobState | Literal["queued"]
"""A job's state as the API shows it: ``queued`` is a planned (or started) job that the
schedule leaves waiting for trainers."""
StateFilter = Annotated[ShownState | None, Query(description="Only jobs in this state.")]


def shown_state(view: JobView, schedule: Schedule) -> tuple[ShownState, int | None]:
    """The job's state as the API (and its event stream) shows it, and its 1-based place in
    the queue while the schedule leaves it waiting (None otherwise)."""
    position = schedule.position(view.job_id)
    return ("queued" if position is not None else view.state), position


class Progress(BaseModel):
    """Training progress summed over the job's trainers (latest report of each)."""

    epoch: int
    epochs: int = Field(description="Epochs the spec asks for.")
    step: int
    total_steps: int | None = Field(description="Known once the job is planned.")
    samples_trained: int
    batches_consumed: int
    consumed_train_batches: int
    loss: float | None
    samples_per_second: float
    data_wait_ratio: float | None = Field(description="Mean over trainers of exposed data wait.")
    step_time_s: dict[str, float] = Field(
        description="Mean over trainers of their recent steps' seconds per part (data_wait, "
        "h2d, compute, grad_send, param_wait)."
    )
    workers: list[str]


class EpochResult(BaseModel):
    epoch: int
    train_loss: float | None
    eval_loss: float | None
    eval_accuracy: float | None


class Job(BaseModel):
    """One job as the view knows it."""

    id: str
    name: str
    state: ShownState
    queue_position: int | None = Field(
        description="1-based place in the queue of jobs waiting for trainers (state queued)."
    )
    trainers: list[str] = Field(description="The trainers the schedule places on the job now.")
    submitted_at: float = Field(description="Unix seconds.")
    updated_at: float = Field(description="Unix seconds of the last applied event.")
    cancel_requested: bool
    reason: str | None = Field(description="Why the job failed or was cancelled.")
    idempotency_key: str | None
    progress: Progress
    epochs: list[EpochResult]
    plan: dict[str, Any] | None = Field(description="The sharder's plan (data of 'planned').")
    summary: dict[str, Any] | None = Field(description="Final summary once completed.")
    skipped_samples: int = Field(
        description="Distinct samples left out because they failed validation (corrupt "
        "image, bad tar member...); past dataset.max_bad_samples the job fails."
    )
    skipped_reasons: list[str] = Field(description="'<file>: <reason>' of the first of them.")
    spec: dict[str, Any]
    resumed_from: int | None = Field(
        default=None, description="Checkpoint version of the latest resume (null: none)."
    )

    @classmethod
    def of(cls, view: JobView, schedule: Schedule) -> Job:
        state, position = shown_state(view, schedule)
        return cls(
            id=view.job_id,
            name=view.name,
            state=state,
            queue_position=position,
            trainers=schedule.trainers_of(view.job_id),
            submitted_at=view.submitted_at,
            updated_at=view.updated_at,
            cancel_requested=view.cancel_requested,
            reason=view.reason,
            idempotency_key=view.idempotency_key,
            progress=Progress(**view.progress()),
            epochs=[
                EpochResult(epoch=epoch, **results)
                for epoch, results in sorted(view.epochs.items())
            ],
            plan=None if view.plan is None else view.plan.details(),
            summary=view.summary,
            skipped_samples=len(view.skipped_ids),
            skipped_reasons=list(view.skipped_reasons),
            spec=view.spec,
            resumed_from=view.resumed_from,
        )


class JobList(BaseModel):
    jobs: list[Job]
    count: int = Field(description="Number of jobs in this response.")


class QueuedJob(BaseModel):
    """A job waiting for its minimum of trainers."""

    id: str
    name: str
    position: int = Field(description="1-based; the first is served first.")
    priority: int
    min_trainers: int = Field(description="Trainers it needs before it starts.")
    submitted_at: float = Field(description="Unix seconds.")


class PlacedJob(BaseModel):
    """A job the schedule gives trainers."""

    id: str
    name: str
    priority: int
    trainers: list[str]
    min_trainers: int
    max_trainers: int


class Queue(BaseModel):
    """The trainer pool and the schedule, as every trainer computes it from the jobs topic."""

    pool_size: int = Field(description="Live trainers (TrainerPresence within its ttl).")
    idle_trainers: list[str] = Field(description="Live trainers the schedule gives no job.")
    placed: list[PlacedJob] = Field(description="Jobs with trainers, in the schedule's order.")
    queued: list[QueuedJob] = Field(description="Jobs waiting, in the order they will start.")


class StageLatency(BaseModel):
    """Percentiles (seconds) over the recent progress reports of one pipeline stage."""

    count: int = Field(description="Reports in the window.")
    p50: float
    p90: float
    p99: float
    max: float
    last: float


class JobStages(BaseModel):
    id: str
    window: int = Field(description="Most recent reports kept per stage.")
    stages: dict[str, StageLatency]

    @classmethod
    def of(cls, view: JobView) -> JobStages:
        stages = {name: StageLatency(**values) for name, values in view.stage_percentiles().items()}
        return cls(id=view.job_id, window=view.stage_window, stages=stages)


class Checkpoint(BaseModel):
    """One checkpoint of a job in its object store."""

    version: int = Field(description="Parameter version it holds.")
    step: int | None = Field(description="Optimizer steps up to it (committed ones).")
    state: str = Field(description="committed (its manifest exists) or incomplete.")
    created_at: float | None = Field(description="Unix seconds of the commit.")
    size_bytes: int = Field(description="Bytes of its files (committed ones).")
    trigger: str | None = Field(
        description="every_steps, every_s, epoch_end, request or job_end (committed ones)."
    )
    uri: str
    latest: bool = Field(description="The newest committed one: what a resume would use.")


class CheckpointList(BaseModel):
    id: str
    checkpoints: list[Checkpoint] = Field(description="Newest first.")
    count: int


class ErrorBody(BaseModel):
    detail: str


class AutoscalerStatus(BaseModel):
    """``GET /v1/autoscaler``: the records of the autoscaler topic, as plain values."""

    state: dict[str, Any] | None = Field(
        description="The preprocessor pool's latest ScalingDecision (replicas, bounds, reason, "
        "inputs); null before the autoscaler's first."
    )
    pools: dict[str, dict[str, Any]] = Field(
        description="Each pool's latest ScalingDecision: preprocessor, and trainer when the "
        "autoscaler sizes the trainer pool."
    )
    changes: int = Field(description="Decisions that changed the pool since the topic began.")
    decisions: list[dict[str, Any]] = Field(description="Recent changes, newest first (<= 50).")
    restarts: list[dict[str, Any]] = Field(description="Recent restarts, newest first (<= 50).")
