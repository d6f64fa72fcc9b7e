"""Settings of the sharder (``CONVEYOR_SHARDER_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings


class SharderSettings(_FileAwareSettings):
    """How the sharder opens datasets, paces releases and keeps finished jobs' topics.

    The topics' partition counts are :class:`~conveyor.platform.config.TopologySettings`.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_SHARDER_", frozen=True, extra="forbid")

    dataset_open_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0,
        description="Longest wait for a dataset to open while planning; past it the job fails.",
    )
    tick_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5,
        description="Longest time between release passes when no job event arrives (seconds).",
    )
    finished_topics_grace_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=10.0,
        description=(
            "Seconds a finished job's topics are kept before they are deleted, so that the "
            "job's trainers and aggregators leave it (final commits, leaving their groups) "
            "before its topics go (0: deleted as soon as the job ends; each of them then "
            "retries its final commit against a missing topic for 5 s, logging errors)."
        ),
    )
    max_held_events: Annotated[int, Field(ge=16, le=1_000_000)] = Field(
        default=10_000,
        description=(
            "Unacknowledged job events one sharder may hold (its consumer's max_in_flight). "
            "The submitted event of every active job stays unacknowledged so that a restart "
            "replays it: this bounds the active jobs per sharder process."
        ),
    )
