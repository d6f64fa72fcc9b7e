"""Build typed job events the short way in tests: ``job_event("j1", "planned", **fields)``.

Each event name of the progress stream maps to its message class; ``progress`` is the
coordinator's (the one the sharder and the view count) unless a ``worker_id`` other than the
coordinator's is given. Fields a test does not care about get neutral values.
"""

from __future__ import annotations

import time
from typing import Any

from conveyor.platform.messages import (
    COORDINATOR_WORKER_ID,
    CancelRequested,
    CoordinatorProgress,
    EpochCompleted,
    JobCancelled,
    JobCompleted,
    JobEvent,
    JobFailed,
    JobPlanned,
    JobSubmitted,
    SamplesSkipped,
    TrainerJoined,
    TrainerProgress,
)

PLANNED_DEFAULTS: dict[str, Any] = {
    "num_train": 80,
    "num_eval": 20,
    "num_classes": 10,
    "sample_shape": [1, 8, 8],
    "train_batches_per_epoch": 5,
    "eval_batches_per_epoch": 2,
    "steps_per_epoch": 5,
    "shards_per_epoch": 2,
    "batches_topic": "t.batches",
    "control_topic": "t.control",
    "batches_partitions": 1,
}
COORDINATOR_DEFAULTS: dict[str, Any] = {
    "consumed_batches": 0,
    "consumed_train_batches": 0,
    "version": 0,
    "step": 0,
    "epoch": 0,
    "samples_trained": 0,
    "loss": None,
}
TRAINER_DEFAULTS: dict[str, Any] = {
    "epoch": 0,
    "step": 0,
    "samples_trained": 0,
    "batches_trained": 0,
    "eval_batches": 0,
    "duplicates": 0,
    "contributions": 0,
    "empty_contributions": 0,
    "rejected_contributions": 0,
    "grad_bytes": 0,
    "loss": None,
    "samples_per_second": 0.0,
    "data_wait_ratio": None,
    "data_wait_ratio_job": None,
    "stage_latency_s": {},
    "stage_latency_p95_s": {},
    "step_time_s": {},
}


def job_event(job_id: str, name: str, *, at: float | None = None, **fields: Any) -> JobEvent:
    """The typed event of stream name ``name`` for ``job_id`` with ``fields``."""
    stamp = time.time() if at is None else at
    if name == "submitted":
        return JobSubmitted(job_id=job_id, at=stamp, **fields)
    if name == "planned":
        return JobPlanned(job_id=job_id, at=stamp, **{**PLANNED_DEFAULTS, **fields})
    if name == "progress":
        if fields.get("worker_id", COORDINATOR_WORKER_ID) == COORDINATOR_WORKER_ID:
            values = {**COORDINATOR_DEFAULTS, **fields}
            return CoordinatorProgress(job_id=job_id, at=stamp, **values)
        return TrainerProgress(job_id=job_id, at=stamp, **{**TRAINER_DEFAULTS, **fields})
    if name == "running":
        return TrainerJoined(job_id=job_id, at=stamp, **fields)
    if name == "epoch_completed":
        defaults = {"version": 0, "train_loss": None, "eval_loss": None, "eval_accuracy": None}
        return EpochCompleted(job_id=job_id, at=stamp, **{**defaults, **fields})
    if name == "completed":
        return JobCompleted(job_id=job_id, at=stamp, **{"worker_id": "w", "summary": {}, **fields})
    if name == "cancel_requested":
        return CancelRequested(job_id=job_id, at=stamp, **{"reason": "test", **fields})
    if name == "failed":
        return JobFailed(job_id=job_id, at=stamp, **{"reason": "test", **fields})
    if name == "cancelled":
        return JobCancelled(job_id=job_id, at=stamp, **{"reason": "test", **fields})
    if name == "samples_skipped":
        return SamplesSkipped(job_id=job_id, at=stamp, **fields)
    raise ValueError(f"no job event is called {name!r}")
