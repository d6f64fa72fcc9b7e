"""Settings of the sharder (``CONVEYOR_SHARDER_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings


def group_id(topic_prefix: str) -> str:
    """Consumer group of the sharders on the jobs topic (a job's partition picks its sharder):
    ``conveyor-sharder`` under the default prefix ``conveyor.``, so that stacks sharing a
    cluster under different prefixes never share a group."""
    return f"{topic_prefix.rstrip('.') or 'conveyor'}-sharder"


class SharderSettings(_FileAwareSettings):
    """How the sharder creates topics, opens datasets and paces releases."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_SHARDER_", frozen=True, extra="forbid")

    jobs_partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=4, description="Partitions of the jobs topic when the sharder creates it."
    )
    shards_partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=8,
        description=(
            "Partitions of the shards topic when the sharder creates it: the most "
            "preprocessors that can work at once."
        ),
    )
    batches_partitions_per_trainer: Annotated[int, Field(ge=1, le=64)] = Field(
        default=2, description="Partitions of a job's batches topic per trainer the job wants."
    )
    min_batches_partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=2, description="Fewest partitions of a job's batches topic."
    )
    dataset_open_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0,
        description="Longest wait for a dataset to open while planning; past it the job fails.",
    )
    tick_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5,
        description="Longest time between release passes when no job event arrives (seconds).",
    )
    finished_topics_grace_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=0.0,
        description=(
            "Seconds a finished job's topics are kept before they are deleted, for readers "
            "still reading its last records (0: deleted as soon as the job ends)."
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

    def batches_partitions(self, trainers: int) -> int:
        """Partitions of a job's batches topic for a job that wants ``trainers`` trainers."""
        return max(self.min_batches_partitions, self.batches_partitions_per_trainer * trainers)
