"""Settings of the autoscaler (``CONVEYOR_AUTOSCALER_...``), read once at the edge."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from conveyor.platform.config import _FileAwareSettings, worker_id_field
from conveyor.services.autoscaler.policy import PolicyConfig
from conveyor.services.autoscaler.trainers import TrainerPoolConfig

Driver = Literal["local", "docker", "kubernetes"]

_DRIVER_SETTINGS: dict[str, tuple[str, ...]] = {
    "local": ("restart_", "stack_dir"),
    "docker": ("docker_",),
    "kubernetes": ("kubernetes_",),
}
"""The settings of one driver (by name prefix): set for another driver, they are refused."""


class AutoscalerSettings(_FileAwareSettings):
    """What the autoscaler sizes, how, and by which rules (``docs/operations.md``)."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_AUTOSCALER_", frozen=True, extra="forbid"
    )

    worker_id: str = worker_id_field("autoscaler")
    driver: Driver = Field(
        default="local",
        description=(
            "How replicas are counted and changed: local (processes of the embedded stack; "
            "also restarts any dead service), docker (containers of a compose service over the "
            "Docker Engine API), kubernetes (a Deployment's scale)."
        ),
    )
    interval_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=2.0, description="Seconds between two measurements (and decisions)."
    )
    report_every_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0,
        description="Longest time without a record on the autoscaler topic (a `hold` report).",
    )
    signal_max_age_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=15.0,
        description=(
            "A trainer's progress report or a preprocessor's busy report older than this no "
            "longer counts."
        ),
    )
    min_replicas: Annotated[int, Field(ge=0, le=1024)] = Field(
        default=1, description="Fewest preprocessors."
    )
    max_replicas: Annotated[int, Field(ge=0, le=1024)] = Field(
        default=8,
        description="Most preprocessors (the shards topic's partition count bounds it too).",
    )
    target_data_wait_ratio: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=0.05, description="Scale up while trainers wait for data more than this share."
    )
    calm_data_wait_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.01, description="Scale down only while every trainer waits less than this."
    )
    up_interval_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=20.0,
        description=(
            "Least seconds between two steps up: a new preprocessor's start plus the "
            "trainers' data-wait window (CONVEYOR_TRAINER_RATE_WINDOW_S)."
        ),
    )
    cooldown_s: Annotated[float, Field(ge=0, le=86400)] = Field(
        default=60.0, description="Seconds of surplus (and no change) before each step down."
    )
    surplus_batches_per_trainer: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        default=16, description="Ready batches per trainer beyond which batches pile up."
    )
    max_up_factor: Annotated[float, Field(gt=1, le=64)] = Field(
        default=4.0, description="Largest growth of one step up."
    )
    saturated_busy_ratio: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.7,
        description="Scale up only while the preprocessors' mean busy ratio is at least this.",
    )
    idle_busy_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.3,
        description="While jobs run, preprocessors busy less than this are more than enough.",
    )
    trainer_min_replicas: Annotated[int, Field(ge=0, le=1024)] = Field(
        default=1, description="Fewest trainers, when the trainer pool is scaled."
    )
    trainer_max_replicas: Annotated[int, Field(ge=0, le=1024)] = Field(
        default=0,
        description=(
            "Most trainers; 0: the trainer pool is not scaled (its size is the deployment's). "
            "Above 0 the pool follows what the queued and running jobs ask for."
        ),
    )
    trainer_cooldown_s: Annotated[float, Field(ge=0, le=86400)] = Field(
        default=60.0, description="Seconds of more trainers than asked before the pool shrinks."
    )
    restart_backoff_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=1.0,
        description=(
            "local: wait before restarting a dead service; doubles with each restart of the "
            "same instance within restart_reset_s, up to restart_backoff_max_s."
        ),
    )
    restart_backoff_max_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0, description="local: longest wait before a restart."
    )
    restart_reset_s: Annotated[float, Field(gt=0, le=86400)] = Field(
        default=60.0, description="local: a restarted instance alive this long starts over."
    )
    stack_dir: str | None = Field(
        default=None,
        description="local: the embedded stack's state directory (conveyor up sets it).",
    )
    docker_url: str = Field(
        default="unix:///var/run/docker.sock",
        pattern=r"^(unix://|https?://)",
        description="docker: the Docker Engine API (unix:// socket or http(s)://).",
    )
    docker_project: str | None = Field(
        default=None,
        description="docker: the compose project (the com.docker.compose.project label).",
    )
    kubernetes_namespace: str = Field(default="default", description="kubernetes: namespace.")
    kubernetes_deployment: str = Field(
        default="preprocessor", description="kubernetes: the Deployment to scale."
    )
    kubernetes_trainer_deployment: str = Field(
        default="trainer", description="kubernetes: the trainers' Deployment (trainer pool)."
    )
    kubernetes_api_url: str | None = Field(
        default=None,
        description=(
            "kubernetes: the API server; unset: the in-cluster configuration (service account), "
            "else the kubeconfig."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalerSettings:
        self.policy()  # ValueError for thresholds or bounds that contradict each other
        self.trainer_pool()
        trainer_fields = {"trainer_min_replicas", "trainer_cooldown_s",
                          "kubernetes_trainer_deployment"} & self.model_fields_set  # fmt: skip
        if trainer_fields and self.trainer_max_replicas == 0:
            raise ValueError(f"{', '.join(sorted(trainer_fields))} need trainer_max_replicas > 0 "
                             "(the trainer pool is not scaled)")  # fmt: skip
        for driver, prefixes in _DRIVER_SETTINGS.items():
            foreign = sorted(name for name in self.model_fields_set
                             if name.startswith(prefixes) and driver != self.driver)  # fmt: skip
            if foreign:
                raise ValueError(f"{', '.join(foreign)} apply to the {driver} driver only, "
                                 f"not to {self.driver}")  # fmt: skip
        if self.driver == "local" and not self.stack_dir:
            raise ValueError("driver local needs stack_dir (conveyor up sets it)")
        if self.driver == "docker" and not self.docker_project:
            raise ValueError("driver docker needs docker_project (the compose project name)")
        return self

    def policy(self) -> PolicyConfig:
        """The policy's parameters."""
        return PolicyConfig(
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            target_data_wait_ratio=self.target_data_wait_ratio,
            calm_data_wait_ratio=self.calm_data_wait_ratio,
            up_interval_s=self.up_interval_s,
            cooldown_s=self.cooldown_s,
            surplus_batches_per_trainer=self.surplus_batches_per_trainer,
            max_up_factor=self.max_up_factor,
            saturated_busy_ratio=self.saturated_busy_ratio,
            idle_busy_ratio=self.idle_busy_ratio,
        )

    def trainer_pool(self) -> TrainerPoolConfig | None:
        """The trainer pool's bounds; None when it is not scaled."""
        if self.trainer_max_replicas == 0:
            return None
        return TrainerPoolConfig(min_replicas=self.trainer_min_replicas,
                                 max_replicas=self.trainer_max_replicas,
                                 cooldown_s=self.trainer_cooldown_s)  # fmt: skip
