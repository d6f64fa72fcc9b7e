"""Settings of the aggregator (``CONVEYOR_AGGREGATOR_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings, worker_id_field
from conveyor.training.cadence import check_progress_intervals


class AggregatorSettings(_FileAwareSettings):
    """How one aggregator process serves the jobs' gradient planes."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_AGGREGATOR_", frozen=True, extra="forbid"
    )

    worker_id: str = worker_id_field("aggregator")
    member_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=10.0,
        description=(
            "A trainer not heard from (heartbeat or contribution) for this long is dropped "
            "from its job's membership, so a sync step stops waiting for it."
        ),
    )
    tick_s: Annotated[float, Field(gt=0, le=10)] = Field(
        default=0.1,
        description="Longest time between two decision passes when nothing arrives (seconds).",
    )
    progress_interval_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5, description="Least time between two coordinator progress events of a job."
    )
    progress_max_interval_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=5.0,
        description=(
            "The time between two coordinator progress events grows with the job's age (a 60th "
            "of it) from progress_interval_s up to this, but stays under a quarter of the "
            "flow-control lead's worth of consumption, which the sharder releases by (see "
            "conveyor.training.cadence)."
        ),
    )
    max_held_slices: Annotated[int, Field(ge=16, le=1_000_000)] = Field(
        default=4096,
        description=(
            "Gradient-slice records one job's slice owners may hold unacknowledged (the grads "
            "consumer's max_in_flight): a few steps' worth of contributions per slice."
        ),
    )
    export_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=120.0,
        description="Longest wait at the job's end for every slice's final ParamSlice.",
    )
    retry_backoff_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=2.0,
        description="Wait before serving a job again after a retriable broker/storage failure.",
    )

    @model_validator(mode="after")
    def _progress_intervals_ordered(self) -> AggregatorSettings:
        check_progress_intervals(self.progress_interval_s, self.progress_max_interval_s)
        return self
