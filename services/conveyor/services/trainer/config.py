"""Settings of the trainer (``CONVEYOR_TRAINER_...``), read once at the edge.

What a job asks for (model, precision, compression, mode, device, threads, memory fraction)
comes from its spec; these settings are the process's own: identity, cadences, buffer depths
and the waits of the gradient-plane protocol.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings, worker_id_field
from conveyor.training.cadence import check_progress_intervals


class TrainerSettings(_FileAwareSettings):
    """How one trainer process trains the job it joins."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_TRAINER_", frozen=True, extra="forbid")

    worker_id: str = worker_id_field("trainer")
    prefetch_batches: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=4,
        description="Batches copied to the device ahead of the step loop (the prefetch depth).",
    )
    in_flight_margin_batches: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        default=64,
        description=(
            "Extra unacknowledged batches the consumer may hold beyond the job's lead, one epoch "
            "of eval batches and the outstanding contributions (duplicates, shard granularity)."
        ),
    )
    progress_interval_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5, description="Least time between two progress events of a job."
    )
    progress_max_interval_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=5.0,
        description=(
            "The time between two progress events grows with the time this trainer has been "
            "on the job (a 60th of it) from progress_interval_s up to this (see "
            "conveyor.training.cadence): a long job writes ~12 a minute instead of 120 to the "
            "jobs topic. Keep it under the autoscaler's signal_max_age_s (15)."
        ),
    )
    heartbeat_interval_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=1.0,
        description=(
            "Time between heartbeats on the job's control topic (membership and throughput "
            "for the coordinator; keep it well under its member timeout)."
        ),
    )
    presence_ttl_s: Annotated[float, Field(ge=1, le=3600)] = Field(
        default=15.0,
        description=(
            "The trainer says it is in the pool (TrainerPresence on the jobs topic) every third "
            "of this; without a word for this long on the log's clock it counts as gone and "
            "the scheduler gives its place to another trainer."
        ),
    )
    empty_contribution_wait_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.2,
        description=(
            "Sync mode: how long a step waits for a batch of the current epoch before it "
            "sends an empty contribution (so a trainer without data never holds a step up); "
            "also the longest wait for each further micro-batch of a step."
        ),
    )
    member_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=10.0,
        description=(
            "A trainer without a heartbeat for this long no longer counts as live when this "
            "trainer splits a step equally before its first allocation (the coordinator's own "
            "membership timeout decides the steps)."
        ),
    )
    stage_window: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=256, description="Recent batches per stage kept for latency percentiles."
    )
    rate_window_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=10.0,
        description="Window of the recent throughput and data-wait ratio in progress events.",
    )
    device: str | None = Field(
        default=None,
        pattern=r"^(auto|cpu|cuda|cuda:\d{1,3})$",
        description=(
            "Overrides the job's resources.device for this process (a CPU-only worker node); "
            "unset: the job decides."
        ),
    )
    retry_backoff_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=2.0,
        description="Wait before rejoining a job after a retriable broker failure.",
    )
    simulated_step_delay_s: Annotated[float, Field(ge=0, le=60)] = Field(
        default=0.0,
        description=(
            "Simulation/benchmark knob, 0 in production: extra seconds the compute thread "
            "sleeps per micro-batch (train and eval), counted as compute, to emulate a slower "
            "accelerator (heterogeneous-pool simulation on one machine)."
        ),
    )
    drain_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=20.0,
        description="How long a stop waits for the job's contribution in flight to be sent.",
    )

    @model_validator(mode="after")
    def _progress_intervals_ordered(self) -> TrainerSettings:
        check_progress_intervals(self.progress_interval_s, self.progress_max_interval_s)
        return self
