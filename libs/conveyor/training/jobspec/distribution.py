"""``distribution``: trainers, aggregator slices, the mode of the gradient plane and its
compression."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from conveyor.training.jobspec.base import (
    _Spec,
)
from conveyor.training.jobspec.optimization import OptimizerSpec

OVERLAP_MIN_GRADIENT_BYTES = 1 << 20
"""Smallest fp32 gradient whose slices leave during the backward by default (1 MiB, DDP's
first bucket). Below it the hooks and the hand-overs between threads cost more than the send
they hide: ``bench_overlap`` on 2 quiet cores, a step's last pass and its slices acknowledged,
overlap / serial: the digits small_cnn (94 KiB) 1.17, resnet18 width 16 (2.7 MiB) 0.96-0.97."""


class CompressionSpec(_Spec):
    kind: Literal["none", "fp16", "bf16", "topk"] = "none"
    """How trainers encode gradient slices."""
    ratio: float | None = Field(default=None, gt=0.0, le=1.0, validate_default=True)
    """Share of gradient elements kept by topk; required for topk, only for topk."""
    error_feedback: bool = True
    """topk: keep the dropped residual locally and add it to the next gradient."""
    momentum_correction: bool = True
    """topk with error feedback and SGD momentum: the trainers keep the momentum and
    accumulate it before selecting (DGC momentum correction), the aggregator's SGD runs
    without it; no effect otherwise (see :func:`conveyor.training.optim.momentum_correction`)."""

    @field_validator("ratio")
    @classmethod
    def _ratio_only_for_topk(cls, ratio: float | None, info: ValidationInfo) -> float | None:
        kind = info.data.get("kind")
        if kind == "topk" and ratio is None:
            raise ValueError("ratio is required when kind is topk (e.g. 0.01)")
        if kind is not None and kind != "topk" and ratio is not None:
            raise ValueError(f"ratio applies to kind topk only, not {kind}")
        return ratio


class DistributionSpec(_Spec):
    trainers: int = Field(default=1, ge=1, le=1024)
    """Trainer processes the job wants from the pool (the scheduler gives it this many once
    every job ahead of it has its minimum)."""
    min_trainers: int | None = Field(default=None, ge=1, le=1024)
    """Fewest trainers the job runs with (elastic job); None = ``trainers``. A job that cannot
    get them waits in the queue."""
    max_trainers: int | None = Field(default=None, ge=1, le=1024)
    """Most trainers the job grows to when the pool has spare ones (elastic job); None =
    ``trainers``."""
    aggregator_shards: int = Field(default=1, ge=1, le=256)
    """K, the parameter slices = partitions of the grads/params topics, each owned by one
    aggregator process at a time (the key predates the word "slice" and stays: a shard is a
    data shard everywhere else)."""
    mode: Literal["sync", "ssp", "local"] = "sync"
    """sync: every step waits for all members; ssp: bounded-staleness async; local:
    low-communication (DiLoCo-style) training: each trainer takes ``sync_every_steps`` steps of
    the job's optimizer on its own batches, then the aggregators apply ``outer_optimizer`` to
    the sample-weighted mean of the trainers' parameter deltas (one version per window)."""
    staleness: int = Field(default=2, ge=0, le=1000)
    """ssp: a contribution computed on version v applies while current - v <= staleness."""
    sync_every_steps: int | None = Field(default=None, ge=1, le=100_000, validate_default=True)
    """local: H, the inner optimizer steps (each of the global batch, split over the trainers
    as in sync mode) between two outer steps; required for local, only for local."""
    overlap_steps: int = Field(default=0, ge=0, le=100_000)
    """local: up to this many inner steps of the next window run while the window's delta
    travels and its outer step is applied (Streaming DiLoCo's overlap); then the trainer moves
    its parameters onto the new version keeping the progress of those steps
    (``new + (current - sent)``) and finishes the window there. A step only takes batches
    already in hand; 0: wait for the new version before the next window (plain DiLoCo). At
    most ``sync_every_steps - 1``; only for local."""
    outer_optimizer: OptimizerSpec | None = Field(default=None, validate_default=True)
    """local: the optimizer the aggregators apply to the mean parameter delta (the outer
    gradient); None: SGD lr 0.7 with Nesterov momentum 0.5 (DiLoCo's lr; its momentum 0.9
    diverges on top of an inner SGD momentum of 0.9, see docs/operations.md). Only for local."""
    allocation: Literal["adaptive", "equal"] = "adaptive"
    """adaptive: each trainer's micro-batches per step, and its share of the batches (the
    routing of batches to partitions), follow its measured throughput; equal: the step is
    split equally and the batches are spread over the partitions equally (each trainer reads
    an equal share)."""
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    """How each gradient (local mode: parameter delta) travels to the aggregator."""
    overlap_backward: bool | None = Field(default=None, validate_default=True)
    """sync and ssp: during the backward pass of a step's last micro-batch, each gradient
    slice is encoded and sent as soon as the pass has completed it (DDP-style buckets; the
    layers nearest the loss come first, so the last slices leave while the first are still
    being computed); false: the whole backward, then every slice. The bytes sent are the same
    either way. None: on in sync and ssp for a gradient of at least
    :data:`OVERLAP_MIN_GRADIENT_BYTES` (see :meth:`overlaps_backward`). local mode refuses
    true (its delta exists only after the window's optimizer steps)."""
    deterministic: bool = False
    """Bit-exact training: the same spec gives the same parameters and per-step losses, run
    straight through or resumed after any number of kills. The trainer takes each step's
    micro-batches in plan order (waiting for the next one rather than sending a partial step)
    and seeds torch's RNG per micro-batch from the job seed and the batch id. Needs one trainer
    (no elastic bounds), sync mode, and no top-k (its residual lives in the trainer's memory)."""

    @field_validator("deterministic")
    @classmethod
    def _deterministic_can_hold(cls, deterministic: bool, info: ValidationInfo) -> bool:
        if not deterministic:
            return deterministic
        data = info.data
        # A step's sums depend on which trainer gets which micro-batch, and top-k's residual
        # and local mode's inner optimizer live in a trainer's memory, lost with it.
        if (
            data.get("trainers", 1) != 1
            or data.get("min_trainers") not in (None, 1)
            or (data.get("max_trainers") not in (None, 1))
        ):
            raise ValueError(
                "deterministic needs exactly one trainer (trainers: 1, no min/max_trainers): "
                "with several, each step's gradient sum depends on which trainer got which batch"
            )
        if data.get("mode", "sync") != "sync":
            raise ValueError(f"deterministic needs mode sync, not {data.get('mode')}")
        compression = data.get("compression")
        if compression is not None and compression.kind == "topk":
            raise ValueError(
                "deterministic cannot use topk compression: its error-feedback residual lives "
                "in the trainer and is lost when it is killed (none, fp16 or bf16 can)"
            )
        return deterministic

    @field_validator("overlap_backward")
    @classmethod
    def _overlap_needs_gradients(cls, overlap: bool | None, info: ValidationInfo) -> bool | None:
        if overlap and info.data.get("mode") == "local":
            raise ValueError(
                "overlap_backward applies to modes sync and ssp: local mode sends its parameter "
                "delta after the window's optimizer steps, not during a backward pass"
            )
        return overlap

    def overlaps_backward(self, gradient_bytes: int) -> bool:
        """Whether a step's slices are sent during its last backward pass: ``overlap_backward``
        when set; None: in sync and ssp when the fp32 gradient (``gradient_bytes``) is at
        least :data:`OVERLAP_MIN_GRADIENT_BYTES`."""
        if self.overlap_backward is not None:
            return self.overlap_backward
        return self.mode != "local" and gradient_bytes >= OVERLAP_MIN_GRADIENT_BYTES

    @field_validator("min_trainers")
    @classmethod
    def _fewest_within_wanted(cls, fewest: int | None, info: ValidationInfo) -> int | None:
        wanted = info.data.get("trainers")
        if wanted is not None and fewest is not None and fewest > wanted:
            raise ValueError(f"min_trainers ({fewest}) must be <= trainers ({wanted})")
        return fewest

    @field_validator("max_trainers")
    @classmethod
    def _most_within_wanted(cls, most: int | None, info: ValidationInfo) -> int | None:
        wanted = info.data.get("trainers")
        if wanted is not None and most is not None and most < wanted:
            raise ValueError(f"max_trainers ({most}) must be >= trainers ({wanted})")
        return most

    @property
    def trainer_bounds(self) -> tuple[int, int, int]:
        """(fewest, wanted, most) trainers of the job; equal for a job that is not elastic."""
        fewest = self.trainers if self.min_trainers is None else self.min_trainers
        most = self.trainers if self.max_trainers is None else self.max_trainers
        return fewest, self.trainers, most

    @field_validator("sync_every_steps")
    @classmethod
    def _window_only_for_local(cls, steps: int | None, info: ValidationInfo) -> int | None:
        mode = info.data.get("mode")
        if mode == "local" and steps is None:
            raise ValueError("sync_every_steps is required when mode is local (e.g. 8)")
        if mode is not None and mode != "local" and steps is not None:
            raise ValueError(f"sync_every_steps applies to mode local only, not {mode}")
        return steps

    @field_validator("overlap_steps")
    @classmethod
    def _overlap_within_a_window(cls, steps: int, info: ValidationInfo) -> int:
        if steps == 0:
            return steps
        mode, window = info.data.get("mode"), info.data.get("sync_every_steps")
        if mode is not None and mode != "local":
            raise ValueError(f"overlap_steps applies to mode local only, not {mode}")
        if window is not None and steps >= window:
            raise ValueError(
                f"overlap_steps ({steps}) must be less than sync_every_steps ({window}): the "
                "window's own steps finish on the new version"
            )
        return steps

    @field_validator("outer_optimizer")
    @classmethod
    def _outer_only_for_local(
        cls, outer: OptimizerSpec | None, info: ValidationInfo
    ) -> OptimizerSpec | None:
        mode = info.data.get("mode")
        if mode is not None and mode != "local" and outer is not None:
            raise ValueError(f"outer_optimizer applies to mode local only, not {mode}")
        return outer

    @property
    def outer(self) -> OptimizerSpec:
        """The outer optimizer of local mode: ``outer_optimizer`` or the default (SGD lr 0.7,
        Nesterov momentum 0.5)."""
        if self.outer_optimizer is not None:
            return self.outer_optimizer
        return OptimizerSpec(name="sgd", lr=0.7, momentum=0.5, nesterov=True)
