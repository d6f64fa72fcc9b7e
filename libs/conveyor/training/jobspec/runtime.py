"""``checkpoint``, ``resources`` and ``flow``: where state goes, what a trainer runs on, how
far data runs ahead."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from conveyor.training.jobspec.base import (
    CHECKPOINT_SCHEMES,
    _Spec,
)


class CheckpointSpec(_Spec):
    every_steps: int | None = Field(default=None, ge=1)
    """Checkpoint every N optimizer steps; None = only at epoch and job end."""
    every_s: float | None = Field(default=None, gt=0.0)
    """Checkpoint at most this many seconds apart; None = no time trigger."""
    keep_last: int = Field(default=3, ge=1, le=1000)
    """Committed checkpoints kept; older ones are deleted after a new commit."""
    uri: str | None = Field(default=None, max_length=1024)
    """file://<dir> or s3://<bucket>[/prefix] inside the operator's output roots
    (:mod:`conveyor.training.locations`, checked at submission and before writing); None = the
    stack's object store."""

    @field_validator("uri")
    @classmethod
    def _object_store_scheme(cls, uri: str | None) -> str | None:
        if uri is not None:
            scheme, sep, rest = uri.partition("://")
            if not sep or not rest or scheme not in CHECKPOINT_SCHEMES:
                raise ValueError("checkpoint uri must be file://<dir> or s3://<bucket>[/prefix]")
        return uri


class ResourcesSpec(_Spec):
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda|cuda:\d{1,3})$")
    """auto (cuda when present, else cpu), cpu, cuda or cuda:N."""
    memory_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    """Cap on the share of GPU memory one trainer process may use."""
    threads: int | None = Field(default=None, ge=1, le=1024)
    """torch intra-op threads per trainer; None = torch's default."""

    @field_validator("memory_fraction")
    @classmethod
    def _gpu_only(cls, fraction: float | None, info: ValidationInfo) -> float | None:
        if fraction is not None and info.data.get("device") == "cpu":
            raise ValueError(
                "memory_fraction caps a trainer's share of GPU memory: device cpu has none "
                "(use device auto or cuda, or leave memory_fraction out)"
            )
        return fraction


class FlowSpec(_Spec):
    max_lead_batches: int | None = Field(default=None, ge=1, le=1_000_000)
    """How many ready train batches may exist ahead of what the trainers consumed (the bound
    on the job's backlog in the broker). None: sized by the batch's bytes, see
    ``JobSpec.lead_batches`` (a job spec always holds the resolved number)."""
    shard_size: int | None = Field(default=None, ge=1, le=10_000_000)
    """Samples per shard task; None = 1 to 8 micro-batches, so the lead holds 16 tasks (see
    JobSpec.shard_size)."""
