"""``training``: optimizer, learning-rate schedule, batch sizes and epochs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from conveyor.training.jobspec.base import (
    MAX_SEED,
    _Spec,
)


class OptimizerSpec(_Spec):
    name: Literal["sgd", "adam", "adamw"]
    """Element-wise optimizer run by the aggregators, one per parameter slice."""
    lr: float = Field(gt=0.0, le=10.0)
    """Learning rate."""
    momentum: float = Field(default=0.0, ge=0.0, lt=1.0)
    """SGD momentum (sgd only)."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """L2 penalty (sgd, adam) or decoupled decay (adamw)."""
    nesterov: bool = Field(default=False, validate_default=True)
    """Nesterov momentum (sgd with momentum > 0 only)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW moving-average coefficients, each in [0, 1)."""
    eps: float = Field(default=1e-8, gt=0.0, le=1.0)
    """Adam/AdamW denominator term."""

    @field_validator("nesterov")
    @classmethod
    def _sgd_only_options(cls, nesterov: bool, info: ValidationInfo) -> bool:
        name, momentum = info.data.get("name"), info.data.get("momentum")
        if name is not None and name != "sgd" and momentum:
            raise ValueError(f"momentum applies to sgd only; {name} uses betas")
        if nesterov and (name != "sgd" or not momentum):
            raise ValueError("nesterov requires optimizer sgd with momentum > 0")
        return nesterov

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class LrScheduleSpec(_Spec):
    """Learning rate per optimizer step: linear warmup, then constant, cosine or step decay
    (see :func:`conveyor.training.optim.lr_at`)."""

    name: Literal["constant", "cosine", "step"] = "constant"
    """After warmup: keep ``lr``; cosine from ``lr`` to ``min_lr`` over the remaining steps;
    or multiply by ``gamma`` every ``step_size`` steps."""
    warmup_steps: int = Field(default=0, ge=0, le=10_000_000)
    """Steps of linear warmup from ``lr / warmup_steps`` up to ``lr``."""
    step_size: int | None = Field(default=None, ge=1, le=10_000_000, validate_default=True)
    """step: steps between two decays; required for step, only for step."""
    gamma: float = Field(default=0.1, gt=0.0, le=1.0)
    """step: decay factor."""
    min_lr: float = Field(default=0.0, ge=0.0, le=10.0)
    """Floor of the decayed learning rate (cosine ends there)."""

    @field_validator("step_size")
    @classmethod
    def _step_size_only_for_step(cls, step_size: int | None, info: ValidationInfo) -> int | None:
        name = info.data.get("name")
        if name == "step" and step_size is None:
            raise ValueError("step_size is required when name is step")
        if name is not None and name != "step" and step_size is not None:
            raise ValueError(f"step_size applies to name step only, not {name}")
        return step_size


class TrainingSpec(_Spec):
    epochs: int = Field(ge=1, le=10_000)
    """Passes over the train split; each ends with an evaluation of the eval split."""
    global_batch_size: int = Field(ge=1, le=1_048_576)
    """Samples per optimizer step, summed over all trainers."""
    micro_batch_size: int = Field(ge=1, le=65_536)
    """Samples per batch message; global_batch_size must be a multiple of it."""
    optimizer: OptimizerSpec
    """The optimizer of every step: the aggregators' (sync, ssp), or the trainers' inner
    optimizer in local mode."""
    lr_schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec)
    """Learning rate per step, computed by the aggregator's coordinator (local mode: by each
    trainer for its inner steps, counted as in sync mode; the outer lr is constant)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute precision of forward/backward (bf16 via autocast)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Root of every random choice: shard order, augmentation, initial weights."""
    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimizer steps even if epochs remain."""

    @field_validator("micro_batch_size")
    @classmethod
    def _divides_global(cls, micro: int, info: ValidationInfo) -> int:
        global_batch = info.data.get("global_batch_size")
        if global_batch is not None and global_batch % micro:
            raise ValueError(
                f"global_batch_size ({global_batch}) must be a multiple of "
                f"micro_batch_size ({micro})"
            )
        return micro
