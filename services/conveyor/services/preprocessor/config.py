"""Settings of the preprocessor (``CONVEYOR_PREPROCESSOR_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings, worker_id_field


class PreprocessorSettings(_FileAwareSettings):
    """How many shard tasks one preprocessor works on and how it treats datasets."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_PREPROCESSOR_", frozen=True, extra="forbid"
    )

    worker_id: str = worker_id_field("preprocessor")
    concurrency: Annotated[int, Field(ge=1, le=256)] = Field(
        default=2,
        description=(
            "Shard tasks processed at once (each in a worker thread). Also the consumer's "
            "max in-flight, so a process never holds more tasks than it works on."
        ),
    )
    revoke_grace_s: Annotated[float, Field(ge=0, le=300)] = Field(
        default=30.0,
        description=(
            "When the shards group rebalances (a preprocessor joins or leaves), how long this "
            "one finishes the tasks it is working on before giving their partitions up, so "
            "that they are committed instead of done again by the partitions' next owner; the "
            "group's rebalance waits meanwhile. 0 gives them up at once."
        ),
    )
    dataset_cache_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=8, description="Open datasets kept per process (least recently used dropped)."
    )
    dataset_open_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=60.0, description="Longest wait for a dataset to open (then it counts as failed)."
    )
    dataset_attempts: Annotated[int, Field(ge=1, le=100)] = Field(
        default=3,
        description=(
            "Tries of a read whose storage is unavailable (retriable) before the job is failed."
        ),
    )
    retry_backoff_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5, description="Wait before the first retry of a read; doubles after each."
    )
    busy_window_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=10.0, description="Window of the busy-ratio gauge (seconds)."
    )
    load_report_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=5.0,
        description=(
            "Seconds between two busy reports (PreprocessorLoad on the autoscaler topic, an "
            "input of the autoscaler's policy)."
        ),
    )
