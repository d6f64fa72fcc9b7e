"""Build trainer heartbeats the short way in tests: ``heartbeat("j", "w0", at=1.0, **state)``
with neutral values for the state fields a test does not care about."""

from __future__ import annotations

import time
from typing import Any

from conveyor.platform.messages import Heartbeat, TrainerState

STATE_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "version": None,
    "epoch": 0,
    "samples_per_second": 0.0,
    "throughput_samples_per_second": 0.0,
    "data_wait_ratio": None,
    "step_time_s": {},
    "outstanding": 0,
    "ready_batches": 0,
    "queued_batches": 0,
    "held_batches": 0,
    "in_flight": 0,
    "batches_partitions": [],
    "gpu": {},
}


def trainer_state(**fields: Any) -> TrainerState:
    return TrainerState(**{**STATE_DEFAULTS, **fields})


def heartbeat(
    job_id: str, worker_id: str, *, at: float | None = None, leaving: bool = False, **state: Any
) -> Heartbeat:
    return Heartbeat(
        job_id=job_id,
        worker_id=worker_id,
        at=time.time() if at is None else at,
        state=trainer_state(**state),
        leaving=leaving,
    )
