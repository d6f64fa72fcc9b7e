"""Schemas of the data plane: shard tasks for the preprocessors, ready batches for the
trainers, workers' heartbeats and dead letters (the job's own events are in
:mod:`~conveyor.platform.messages.job_events`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.platform.messages.registry import Message, Record, message
from conveyor.platform.messages.topics import SPLITS

if TYPE_CHECKING:  # the registry resolves it without torch (TensorAnnotation)
    from torch import Tensor


@message("DeadLetter", version=1)
@dataclass(kw_only=True, slots=True)
class DeadLetter(Message):
    """A record a consumer could not decode or validate, parked on ``Topics.dlq``."""

    source_topic: str
    """Topic the record was read from."""
    partition: int
    """Partition it was read from."""
    offset: int
    """Its offset in that partition."""
    key: bytes | None
    """Its Kafka key."""
    reason: str
    """Why it failed (the codec error's text)."""
    payload: bytes
    """The record value as received (the sender may cut it to fit the size limits)."""
    failed_at: float
    """When it failed, unix time in seconds."""


@message("ShardTask", version=4)
@dataclass(kw_only=True, slots=True)
class ShardTask(Message):
    """Work for one preprocessor on ``Topics.shards``: turn a shard's samples into batches."""

    job_id: str
    """Id of the job."""
    shard_id: str
    """Deterministic id of the shard within the job and epoch."""
    epoch: int
    """Epoch number, from 0."""
    index: int
    """Position of the shard in the epoch's order, from 0."""
    split: str
    """``"train"`` or ``"eval"``."""
    dataset_uri: str
    """Where the samples are (``builtin://``, ``synthetic://``, ``npz://``, ``mnist-idx://``)."""
    sample_ids: list[int]
    """Ids of the shard's samples, in the order they are batched."""
    micro_batch_size: int
    """Samples per batch (the last batch of the shard may be smaller)."""
    seed: int
    """Job seed; augmentation randomness derives from (seed, epoch, sample id)."""
    preprocess: dict[str, Any]
    """The job spec's preprocess section."""
    released_at: float = 0.0
    """When the sharder released the task, unix time in seconds (0.0: not released by a
    sharder); becomes the ``released`` timestamp of the shard's batches."""
    partitions: list[int] = dataclasses.field(default_factory=list)
    """The partition of the job's batches topic for each of the shard's batches, in order
    (:func:`conveyor.training.routing.shard_partitions`). Empty: the key's hash picks (a task
    not released by a sharder). Version 4; replaces version 2's per-partition weights."""
    incarnation: int = 0
    """The job's incarnation (resumes so far): its batches go to that run's batches topic.
    Added in version 3."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        batches = math.ceil(len(self.sample_ids) / self.micro_batch_size)
        if self.partitions and len(self.partitions) != batches:
            raise ValueError(f"{len(self.partitions)} partitions for {batches} batches")
        if min(self.partitions, default=0) < 0:
            raise ValueError(f"partitions must be >= 0, got {self.partitions!r}")


@message("Batch", version=2)
@dataclass(kw_only=True, slots=True)
class Batch(Message):
    """A ready micro-batch on ``Topics.batches(job_id)``: images (uint8 until the device) and
    class labels, or (since version 2) token sequences and their next-token targets."""

    job_id: str
    """Id of the job."""
    batch_id: str
    """Deterministic id (from shard id and position), the dedup key downstream."""
    shard_id: str
    """Shard the samples came from."""
    epoch: int
    """Epoch number, from 0."""
    split: str
    """``"train"`` or ``"eval"``."""
    sample_ids: list[int]
    """Ids of the B samples, in row order."""
    x: Tensor
    """uint8 [B, C, H, W] images, augmented, not normalised; or int32 [B, T] token ids. The
    preprocessors build batches of numpy arrays (the codec sends them as tensors, and they
    never load torch); a decoded batch holds torch tensors."""
    y: Tensor
    """int64 [B] class labels; or int64 [B, T] targets, ``x`` shifted by one token."""
    timestamps: dict[str, float]
    """Stage name -> unix time in seconds: ``released`` (sharder), ``read_start``,
    ``read_end``, ``augment_end``, ``sent`` (preprocessor), then the trainer's stages."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        # Runs on every decoded batch: each tensor attribute is read once (they are not free).
        x, y = self.x, self.y
        x_shape, y_shape = x.shape, y.shape
        x_dtype, y_dtype = _dtype_name(x.dtype), _dtype_name(y.dtype)
        rows = x_shape[0] if len(x_shape) else 0
        if x_dtype == "uint8" and len(x_shape) == 4:
            expected_y: tuple[int, ...] = (rows,)
        elif x_dtype == "int32" and len(x_shape) == 2:
            expected_y = tuple(x_shape)
        else:
            raise ValueError(
                f"x must be uint8 [B,C,H,W] or int32 [B,T], got {x_dtype} {list(x_shape)}"
            )
        if y_dtype != "int64" or tuple(y_shape) != expected_y:
            raise ValueError(f"y must be int64 {list(expected_y)}, got {y_dtype} {list(y_shape)}")
        if len(self.sample_ids) != rows:
            raise ValueError(f"{len(self.sample_ids)} sample_ids for {rows} rows")


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainerState(Record):
    """What a trainer's heartbeat says about it: what the coordinator allocates micro-batches
    and routes batches by, and what people look at (step-time breakdown, queues, GPU)."""

    device: str
    """The torch device it computes on (``cpu``, ``cuda:0``, ...)."""
    version: int | None
    """Parameter version it last loaded (None before the first)."""
    epoch: int
    """Epoch it works on."""
    samples_per_second: float
    """Its recent compute throughput: what its share of a step is proportional to."""
    throughput_samples_per_second: float
    """Its recent wall-clock throughput."""
    data_wait_ratio: float | None
    """Recent exposed data wait / step time (None before a step)."""
    step_time_s: dict[str, float]
    """Mean seconds per step of each part (``data_wait``, ``compute``, ...), recent window."""
    outstanding: int
    """Its contributions sent and not decided yet."""
    ready_batches: int
    """Batches on the device ahead of compute (the prefetch queue)."""
    queued_batches: int
    """Train batches received and not yet gathered into a step."""
    held_batches: int
    """Batches of a later epoch held until the current one ends."""
    in_flight: int
    """Batches delivered and not acknowledged yet."""
    batches_partitions: list[int]
    """Partitions of the job's batches topic its consumer owns (the routing weights)."""
    gpu: dict[str, float]
    """GPU readings (``gpu_utilization_ratio``, ``gpu_memory_used_bytes``, ...,
    ``torch_allocated_bytes``); empty without a GPU."""

    def __post_init__(self) -> None:
        if self.samples_per_second < 0 or self.throughput_samples_per_second < 0:
            raise ValueError("throughputs must be >= 0")
        if min(self.batches_partitions, default=0) < 0:
            raise ValueError(f"partitions must be >= 0, got {self.batches_partitions}")


@message("Heartbeat", version=2)
@dataclass(kw_only=True, slots=True)
class Heartbeat(Message):
    """A trainer's periodic sign of life and state on ``Topics.control(job_id)``: its
    membership in the job's steps."""

    job_id: str
    """Id of the job."""
    worker_id: str
    """Id of the trainer, stable for its process's lifetime."""
    at: float
    """When it was sent, unix time in seconds."""
    state: TrainerState
    """Its state now. A typed row since version 2 (was a dict ``info``)."""
    leaving: bool = False
    """It is leaving the job: the coordinator drops it from the membership at once."""


_DTYPE_NAMES: dict[object, str] = {}
"""torch or numpy dtype -> its name, as met (a few at most)."""


def _dtype_name(dtype: object) -> str:
    """``uint8`` for ``torch.uint8`` and for numpy's ``uint8`` alike (without importing torch)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype)
        name = _DTYPE_NAMES[dtype] = name[6:] if name.startswith("torch.") else name
    return name
