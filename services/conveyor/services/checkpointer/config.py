"""Settings of the checkpointer (``CONVEYOR_CHECKPOINTER_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings, worker_id_field


class CheckpointerSettings(_FileAwareSettings):
    """How the checkpointer follows the jobs."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_CHECKPOINTER_", frozen=True, extra="forbid"
    )

    worker_id: str = worker_id_field("checkpointer")
    poll_s: Annotated[float, Field(gt=0, le=10)] = Field(
        default=0.2, description="Longest wait for control records before checking the timers."
    )
    retry_backoff_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=2.0,
        description="Wait before following a job again after a retriable broker/storage failure.",
    )
    registry_interval_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=1.0,
        description="Pause between two passes over the jobs for the object store: the registry "
        "of live jobs, and the final checkpoints of completed jobs not committed yet.",
    )
