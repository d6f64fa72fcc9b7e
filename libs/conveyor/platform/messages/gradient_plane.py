"""Schemas of the gradient plane (trainers <-> the aggregators' slice owners).

Versions: the model's parameters at version v are what every trainer computes on; version v+1
results from applying the contributions listed in the StepClose of version v+1. Version 0 is
the seeded initialisation. Slice p of the flattened fp32 parameter vector lives on partition p
of the grads and params topics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.platform.messages.registry import Message, Record, message

if TYPE_CHECKING:  # the registry resolves it without torch (TensorAnnotation)
    from torch import Tensor


@message("GradSlice", version=1)
@dataclass(kw_only=True, slots=True)
class GradSlice(Message):
    """One slice of one contribution's gradient, on partition ``slice_index`` of
    ``Topics.grads(job_id)`` (key: the slice index).

    The gradient is that of the SUM of the per-sample losses over the contribution's samples
    (not the mean), so combining contributions is a plain sum divided by the total samples.
    """

    job_id: str
    """Id of the job."""
    contribution_id: str
    """``f"{worker_id}:{sequence}"``, unique per contribution; the same for all its slices."""
    worker_id: str
    """Trainer that computed it."""
    base_version: int
    """Parameter version the gradient was computed on."""
    slice_index: int
    """Which slice (0..K-1) of the flattened parameters."""
    numel: int
    """Number of elements of the dense slice."""
    encoding: str
    """``dense`` (float32 values), ``fp16``/``bf16`` (values in that dtype) or ``topk``
    (values float32 at ``indices``; every other element is zero)."""
    values: Tensor
    """[numel] for dense/fp16/bf16, [k] for topk."""
    indices: Tensor
    """int32 [k] positions within the slice for ``topk``; empty for the other encodings."""
    sent_at: float
    """Unix seconds."""


@message("Contribution", version=5)
@dataclass(kw_only=True, slots=True)
class Contribution(Message):
    """Sent by a trainer on ``Topics.control(job_id)`` after ALL of its GradSlices were
    acknowledged: from then on every slice owner can apply it. May be empty
    (``num_samples == 0``) when the trainer had no batch for the step (sync mode).

    Version 2 added ``epoch`` and ``sample_ids``: what the gradient was really computed on,
    which the coordinator counts into the job's sample ledger when a StepClose applies it.
    Version 3 added ``inner_steps`` (local mode, whose GradSlices carry the window's parameter
    delta times ``num_samples`` instead of a summed gradient). Version 4 added the step's
    stamps (``params_published_at`` .. ``computed_at``): with ``sent_at`` and the StepCloses'
    ``closed_at`` they time each hop of a step (``loadtests/plane_hops.py``). They are Unix
    seconds of different processes' clocks: across machines only as good as their sync.
    Version 5 added ``carried_steps`` (local mode's ``overlap_steps``).
    """

    job_id: str
    """Id of the job."""
    contribution_id: str
    """Same id as its GradSlices."""
    worker_id: str
    """Trainer that computed it."""
    base_version: int
    """Parameter version the gradient was computed on."""
    num_samples: int
    """Samples the gradient sums over (its weight)."""
    batch_ids: list[str]
    """Batches it consumed, each once; a batch id is applied at most once per job."""
    epoch: int
    """Epoch of the batches it computed on (their ``Batch.epoch``; the coordinator rejects a
    contribution whose batch ids are not all of it). An empty contribution carries the
    trainer's current epoch. Added in version 2."""
    sample_ids: Tensor
    """int32 or int64 [num_samples]: the dataset ids of the samples the gradient was computed
    on, micro-batch after micro-batch as computed (each ``Batch.sample_ids`` in row order; a
    micro-batch computed twice is here twice). int32 when every id fits, else int64: 4 or 8
    bytes a sample, after the header (a contribution of 2**20 samples, the largest global
    batch, is 4-8 MiB). Added in version 2."""
    loss_sum: float
    """Sum of the per-sample training losses."""
    grad_bytes: int
    """Bytes of gradient payload sent for it (all slices), for the wire-bytes report."""
    sent_at: float
    """Unix seconds."""
    inner_steps: list[int] = field(default_factory=list)
    """Local mode: the forward/backward passes (micro-batches) of each inner optimizer step
    of the window, in order (their sum is the passes in ``sample_ids``); empty in sync and
    ssp mode (one step). Added in version 3."""
    carried_steps: int = 0
    """Local mode with ``overlap_steps``: how many of ``inner_steps`` (the first ones) ran
    before ``base_version`` was in, on the trainer's parameters as its previous window ended,
    which it then moved onto ``base_version`` keeping their progress
    (``base + (current - sent)``); 0: the window started on ``base_version``. Added in
    version 5."""
    params_published_at: float | None = None
    """The latest ``ParamSlice.published_at`` of ``base_version``'s slices (Unix seconds).
    Added in version 4, as are the next three; all four are None in an empty contribution
    (nothing was computed) and in one of an earlier version."""
    params_received_at: float | None = None
    """When this trainer held every slice of ``base_version`` (Unix seconds)."""
    started_at: float | None = None
    """When the step began: ``base_version`` loaded into the model, gathering starts."""
    computed_at: float | None = None
    """When the gradient (local mode: the delta) was computed and encoded: before its first
    GradSlice went out, or, where slices leave during the last backward pass
    (``overlap_backward``), once every slice was handed to the producer; ``sent_at`` is
    stamped once every GradSlice is acknowledged."""

    def __post_init__(self) -> None:
        if self.num_samples < 0 or self.epoch < 0:
            raise ValueError(
                f"num_samples and epoch must be >= 0, got {self.num_samples}, {self.epoch}"
            )
        if any(passes < 1 for passes in self.inner_steps):
            raise ValueError(f"every inner step has >= 1 pass, got {self.inner_steps}")
        if not 0 <= self.carried_steps <= len(self.inner_steps):
            raise ValueError(
                f"carried_steps must be within the {len(self.inner_steps)} inner steps, got "
                f"{self.carried_steps}"
            )
        import torch  # loaded already: sample_ids is a tensor

        ids = self.sample_ids
        if ids.dtype not in (torch.int32, torch.int64) or ids.shape != (self.num_samples,):
            raise ValueError(
                f"sample_ids must be int32/int64 [num_samples={self.num_samples}], got "
                f"{ids.dtype} {list(ids.shape)}"
            )


def sample_ids_tensor(sample_ids: Sequence[int]) -> Tensor:
    """``Contribution.sample_ids`` for ``sample_ids`` (ids >= 0): int32 [S] when every id
    fits, else int64 [S]."""
    import torch  # here, not at the top: the schemas load without torch

    high = max(sample_ids, default=0)
    dtype = torch.int32 if high < 2**31 else torch.int64
    return torch.tensor(sample_ids, dtype=dtype)


@dataclass(kw_only=True, slots=True, frozen=True)
class AppliedContribution(Record):
    """One contribution a :class:`StepClose` applies."""

    contribution_id: str
    """The contribution (``worker:sequence``)."""
    worker_id: str
    """Trainer that computed it."""
    base_version: int
    """Parameter version it was computed on."""
    num_samples: int
    """Samples it sums over (0: an empty contribution, no GradSlice)."""
    staleness: int
    """Versions between its base and the one it is applied to (0 in sync mode)."""

    def __post_init__(self) -> None:
        if self.num_samples < 0 or self.staleness < 0:
            raise ValueError(
                f"num_samples and staleness must be >= 0, got {self.num_samples}, {self.staleness}"
            )


@message("StepClose", version=4)
@dataclass(kw_only=True, slots=True)
class StepClose(Message):
    """The coordinator's decision, on ``Topics.control(job_id)``: version ``version`` is the
    previous one plus exactly these contributions. Every slice owner applies it to its slice and
    publishes its ParamSlice of ``version``; trainers learn from it which batches are applied
    (commit them, skip redeliveries) and their next micro-batch allocation."""

    job_id: str
    """Id of the job."""
    version: int
    """The new version (previous + 1)."""
    contributions: list[AppliedContribution]
    """The contributions applied, in the order they were decided. A typed row since
    version 3."""
    batch_ids: list[str]
    """Every batch applied in this step."""
    num_samples: int
    """Total samples of the step (the divisor of the summed gradient)."""
    epoch: int
    """Epoch the step's batches belong to."""
    lr: float
    """Learning rate used for this step (after warmup/decay)."""
    allocation: dict[str, int]
    """Micro-batches each live trainer should contribute to the next step (sync mode)."""
    closed_at: float
    """Unix seconds."""
    momentum: float | None = None
    """SGD momentum of this step; None: the job's. Bounded staleness damps it by the
    staleness of the step's gradient (:func:`conveyor.training.optim.staleness_momentum`).
    Added in version 2."""
    checkpoint: str | None = None
    """Why the job is checkpointed at this version (``every_steps``, ``every_s``,
    ``epoch_end``, ``request``, ``job_end``); None: it is not. Each slice owner saves its
    slice's state right after applying it and announces it with a :class:`SliceSaved`.
    Added in version 4."""


@message("Rejection", version=1)
@dataclass(kw_only=True, slots=True)
class Rejection(Message):
    """Bounded-staleness mode: a contribution was too stale (``current - base > s``) and was
    not applied; the trainer recomputes its batches on newer parameters."""

    job_id: str
    """Id of the job."""
    contribution_id: str
    """The rejected contribution."""
    worker_id: str
    """Its trainer."""
    current_version: int
    """Version at the time of the decision."""
    reason: str
    """Why, for logs."""


@message("ParamSlice", version=1)
@dataclass(kw_only=True, slots=True)
class ParamSlice(Message):
    """Slice ``slice_index`` of the parameters at ``version``, on partition ``slice_index`` of
    ``Topics.params(job_id)`` (key: the slice index)."""

    job_id: str
    """Id of the job."""
    slice_index: int
    """Which slice (0..K-1)."""
    version: int
    """Parameter version."""
    values: Tensor
    """float32 [numel] parameters of the slice."""
    published_at: float
    """Unix seconds."""


@message("EvalResult", version=1)
@dataclass(kw_only=True, slots=True)
class EvalResult(Message):
    """A trainer's evaluation of some eval batches of ``epoch`` with the parameters at the end
    of that epoch (``version``), on ``Topics.control(job_id)``; the coordinator sums them."""

    job_id: str
    """Id of the job."""
    worker_id: str
    """Trainer that evaluated."""
    epoch: int
    """Epoch whose end-of-epoch parameters were used."""
    version: int
    """That parameter version."""
    batch_ids: list[str]
    """Eval batches covered (each counted once by the coordinator)."""
    loss_sum: float
    """Sum of per-sample losses."""
    correct: int
    """Correct predictions."""
    num_samples: int
    """Samples evaluated."""


@message("CheckpointRequest", version=1)
@dataclass(kw_only=True, slots=True)
class CheckpointRequest(Message):
    """Asks for a checkpoint at the next step, on ``Topics.control(job_id)``: the gateway
    (``POST /v1/jobs/{id}/checkpoints``) and the checkpointer (its ``every_s`` timer) send it;
    the coordinator marks the next StepClose (``checkpoint="request"`` or ``"every_s"``)."""

    job_id: str
    """Id of the job."""
    reason: str
    """``request`` (a user asked) or ``every_s`` (the timer)."""
    requested_at: float
    """Unix seconds."""


@message("SliceSaved", version=1)
@dataclass(kw_only=True, slots=True)
class SliceSaved(Message):
    """A slice owner wrote (or failed to write) its slice's state at a checkpointed version,
    on ``Topics.control(job_id)``; the checkpointer commits the checkpoint once every slice of
    the version is saved."""

    job_id: str
    """Id of the job."""
    version: int
    """The checkpointed version."""
    slice_index: int
    """Which slice."""
    key: str
    """Object key of the state file (relative to the job's store); empty on failure."""
    size_bytes: int
    """Bytes of the file."""
    sha256: str
    """Its sha256 (lowercase hex)."""
    grads_offset: int
    """Lowest grads-partition offset versions after this one may need (replay start)."""
    error: str | None = None
    """Why the write failed (the checkpoint of this version cannot be committed)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EndedEpoch(Record):
    """An epoch whose train batches were all applied at or before a :class:`ResumePoint`."""

    epoch: int
    """The epoch."""
    version: int
    """The version that applied its last train batch."""
    evaluated: bool
    """Its eval batches were all covered (its result is known); False only for an epoch that
    ended at the resume point's version itself: the trainers evaluate it on those
    parameters."""

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.version < 1:
            raise ValueError(f"epoch must be >= 0 and version >= 1, got {self.epoch}, "
                             f"{self.version}")  # fmt: skip


@message("ResumePoint", version=1)
@dataclass(kw_only=True, slots=True)
class ResumePoint(Message):
    """Where a resumed job starts: the first record of its (new) control topic, written
    by the sharder from checkpoint ``version``. Everyone who folds the control log starts
    from it instead of version 0: the coordinator (which also loads its own state, the ledger
    included, from the checkpoint), the slice owners (their slices from the checkpoint's
    files), the trainers and the checkpointer."""

    job_id: str
    """Id of the job."""
    version: int
    """The checkpoint's parameter version: the first StepClose after it is ``version + 1``."""
    steps: int
    """Optimizer steps with samples up to ``version``."""
    samples_trained: int
    """Train samples applied up to ``version``, over all epochs."""
    ended_epochs: list[EndedEpoch]
    """Every epoch ended at or before ``version``, by epoch."""
    applied_batches: list[str]
    """Train batches of the epochs not ended that ``version`` includes (a trainer skips their
    redeliveries)."""

    def __post_init__(self) -> None:
        if self.version < 1 or self.steps < 0 or self.samples_trained < 0:
            raise ValueError(
                f"ResumePoint needs version >= 1, steps and samples >= 0, got {self.version}, "
                f"{self.steps}, {self.samples_trained}"
            )
        if [e.epoch for e in self.ended_epochs] != list(range(len(self.ended_epochs))):
            raise ValueError("ResumePoint.ended_epochs lists epochs 0..E-1 in order")
        if any(not e.evaluated and e.version != self.version for e in self.ended_epochs):
            raise ValueError("only an epoch that ended at the resume version may lack its eval")
