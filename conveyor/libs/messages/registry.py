"""Message schemas and topic names: the wire contract between Conveyor's services.

A schema is a ``@dataclass(kw_only=True, slots=True)`` subclass of :class:`Message`,
registered under its wire name and schema version::

    @message("Example", version=1)
    @dataclass(kw_only=True, slots=True)
    class Example(Message):
        \"\"\"What it means, who sends it, on which topic.\"\"\"

        job_id: str
        \"\"\"Id of the job.\"\"\"
        x: Tensor
        \"\"\"uint8 [B, C, H, W] images.\"\"\"

Field types allowed: ``None``, ``bool``, ``int``, ``float`` (an ``int`` is accepted too),
``str``, ``bytes``, ``list[...]``, ``dict[str, ...]`` (nested of those), ``Any`` (a plain value
of those types), a union of those with ``None``, and ``torch.Tensor`` either as a whole field
or as the values of a ``dict[str, Tensor]`` field. Registration turns each annotation into a
:class:`FieldSpec` that the codec (:mod:`conveyor.libs.codec`) checks values against, so
annotations must resolve at import time (import ``Tensor`` for real, not under
``TYPE_CHECKING``). Changing a schema's fields means a new version number.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

ENVELOPE_KEYS = frozenset({"v", "type"})
"""Header keys the envelope uses; no field may take these names."""

SPLITS = ("train", "eval")
"""Values of the ``split`` fields."""


@dataclass(kw_only=True, slots=True)
class Message:
    """Base of every wire message; subclasses are registered with :func:`message`.

    The generated ``__eq__`` compares fields as a tuple, which raises for multi-element
    tensors: compare tensor-carrying messages field by field (``torch.equal``).
    """

    TYPE: ClassVar[str]
    """Wire name, set by :func:`message`."""
    VERSION: ClassVar[int]
    """Schema version, set by :func:`message`."""


class FieldKind(Enum):
    """How a field travels on the wire."""

    VALUE = "value"
    """A plain msgpack value inside the header."""
    TENSOR = "tensor"
    """One tensor, its bytes after the header."""
    TENSOR_DICT = "tensor_dict"
    """A ``dict[str, Tensor]``, each tensor's bytes after the header."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldSpec:
    """What the codec checks for one field, derived from its annotation."""

    name: str
    """Field name, also its key in the wire header."""
    kind: FieldKind
    """How it travels."""
    types: frozenset[type] | None = None
    """Exact Python types the value may have (``type(v) in types``); None: any plain value."""
    item_types: frozenset[type] | None = None
    """Exact types of a list's items or a dict's values; None: not checked item by item."""
    nested: bool = False
    """The value may hold containers of unchecked content, walked on encode."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageSchema:
    """A registered message class with its wire name, version and field specs."""

    cls: type[Message]
    name: str
    version: int
    fields: tuple[FieldSpec, ...]


_REGISTRY: dict[str, MessageSchema] = {}

M = TypeVar("M", bound=Message)


def message(name: str, version: int) -> Callable[[type[M]], type[M]]:
    """Class decorator: register a message class under wire ``name`` with schema ``version``.

    Raises ValueError for a taken name, a version < 1, a class that is not a kw-only slotted
    dataclass subclass of :class:`Message`, or a field named like an envelope key; TypeError
    for a field annotation the codec cannot carry.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"message name must be a non-empty string, got {name!r}")
    if type(version) is not int or version < 1:
        raise ValueError(f"message version must be an int >= 1, got {version!r}")

    def register(cls: type[M]) -> type[M]:
        if name in _REGISTRY:
            raise ValueError(f"message name {name!r} is already taken by {_REGISTRY[name].cls}")
        if not issubclass(cls, Message):
            raise ValueError(f"{cls.__qualname__} must subclass Message")
        # Checked on the class itself: a subclass inherits its parent's dataclass markers.
        if "__dataclass_fields__" not in cls.__dict__ or "__slots__" not in cls.__dict__:
            raise ValueError(
                f"{cls.__qualname__} must be declared with @dataclass(kw_only=True, slots=True)"
            )
        hints = typing.get_type_hints(cls)
        specs = []
        for field in dataclasses.fields(cls):
            where = f"{cls.__qualname__}.{field.name}"
            if field.name in ENVELOPE_KEYS:
                raise ValueError(f"{where}: the name is reserved for the envelope")
            if not field.kw_only:
                raise ValueError(f"{where}: the dataclass must be declared with kw_only=True")
            try:
                specs.append(_field_spec(field.name, hints[field.name]))
            except TypeError as exc:
                raise TypeError(f"{where}: {exc}") from None
        cls.TYPE = name
        cls.VERSION = version
        _REGISTRY[name] = MessageSchema(cls=cls, name=name, version=version, fields=tuple(specs))
        return cls

    return register


def schema_for(name: str) -> MessageSchema | None:
    """The schema registered under wire ``name``, or None."""
    return _REGISTRY.get(name)


def registered_messages() -> Mapping[str, type[Message]]:
    """Every registered message class by wire name (a snapshot)."""
    return {name: schema.cls for name, schema in _REGISTRY.items()}


_NONE_TYPE = type(None)
_SCALAR_TYPES: dict[object, frozenset[type]] = {
    bool: frozenset({bool}),
    int: frozenset({int}),
    # msgpack keeps 1 and 1.0 apart; an int is a fine float (as for mypy).
    float: frozenset({float, int}),
    str: frozenset({str}),
    bytes: frozenset({bytes}),
    _NONE_TYPE: frozenset({_NONE_TYPE}),
}
_ValueTypes = tuple[frozenset[type] | None, frozenset[type] | None, bool]


def _field_spec(name: str, annotation: object) -> FieldSpec:
    if annotation is Tensor:
        return FieldSpec(name=name, kind=FieldKind.TENSOR)
    if typing.get_origin(annotation) is dict and typing.get_args(annotation) == (str, Tensor):
        return FieldSpec(name=name, kind=FieldKind.TENSOR_DICT)
    value_types, item_types, nested = _value_types(annotation)
    return FieldSpec(
        name=name, kind=FieldKind.VALUE, types=value_types, item_types=item_types, nested=nested
    )


def _value_types(annotation: object) -> _ValueTypes:
    """(types, item_types, nested) of a plain-value annotation; TypeError if unsupported."""
    if annotation is Any:
        return None, None, True
    if annotation in _SCALAR_TYPES:
        return _SCALAR_TYPES[annotation], None, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    container = origin if origin is not None else annotation
    if container is list or container is dict:
        if container is dict and args and args[0] is not str:
            raise TypeError(f"dict keys must be str in {annotation!r}")
        item = args[-1] if args else Any
        if item in _SCALAR_TYPES:
            return frozenset({container}), _SCALAR_TYPES[item], False
        _value_types(item)  # rejects tensors and other types nested deeper
        return frozenset({container}), None, True
    if origin is types.UnionType or origin is typing.Union:
        arms = [_value_types(arm) for arm in args]
        if any(arm_types is None for arm_types, _, _ in arms):
            return None, None, True
        value_types = frozenset().union(*(arm_types or () for arm_types, _, _ in arms))
        containers = [arm for arm in arms if arm[0] and arm[0] & {list, dict}]
        item_types: frozenset[type] | None = None
        if containers and all(items is not None for _, items, _ in containers):
            item_types = frozenset().union(*(items or () for _, items, _ in containers))
        nested = any(arm_nested for _, _, arm_nested in arms)
        return value_types, item_types, nested
    raise TypeError(
        f"unsupported field type {annotation!r}: use None, bool, int, float, str, bytes, list, "
        "dict[str, ...], Any, Tensor or dict[str, Tensor]"
    )


_TOPIC_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]*")
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True, slots=True)
class Topics:
    """Kafka topic names under one prefix (``KafkaSettings.topic_prefix``, e.g. ``"conveyor."``).

    Per-job names are ``<prefix>job.<job_id>.<kind>``. Raises ValueError for a prefix or job id
    with characters Kafka does not allow in topic names (job ids may not contain dots).
    """

    prefix: str
    """Prepended verbatim, so it carries its own separator: ``"conveyor."``."""

    def __post_init__(self) -> None:
        if not _TOPIC_PREFIX_RE.fullmatch(self.prefix) or len(self.prefix) > 100:
            raise ValueError(f"invalid topic prefix {self.prefix!r}: use [A-Za-z0-9._-], <= 100")

    @property
    def jobs(self) -> str:
        """Job lifecycle events (:class:`JobEvent`), key = job id."""
        return f"{self.prefix}jobs"

    @property
    def shards(self) -> str:
        """Shard tasks (:class:`ShardTask`) for the preprocessor pool, key = job id."""
        return f"{self.prefix}shards"

    @property
    def dlq(self) -> str:
        """Records that failed to decode or validate (:class:`DeadLetter`)."""
        return f"{self.prefix}dlq"

    def batches(self, job_id: str) -> str:
        """Ready batches (:class:`Batch`) of one job, key = batch id."""
        return self._job(job_id, "batches")

    def grads(self, job_id: str) -> str:
        """Gradient slices of one job; partition = slice."""
        return self._job(job_id, "grads")

    def params(self, job_id: str) -> str:
        """Parameter slices per version of one job; partition = slice."""
        return self._job(job_id, "params")

    def control(self, job_id: str) -> str:
        """Membership, heartbeats, step plans, checkpoint protocol, eval results of one job."""
        return self._job(job_id, "control")

    def job_topics(self, job_id: str) -> tuple[str, ...]:
        """Every per-job topic, created when the job is accepted and deleted when it ends."""
        return (
            self.batches(job_id),
            self.grads(job_id),
            self.params(job_id),
            self.control(job_id),
        )

    def _job(self, job_id: str, kind: str) -> str:
        if not _JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"invalid job id {job_id!r} for a topic name: use [A-Za-z0-9_-]")
        return f"{self.prefix}job.{job_id}.{kind}"


def shard_id_for(job_id: str, epoch: int, split: str, index: int) -> str:
    """Deterministic shard id: ``<job_id>:e<epoch>:<split>:<index:05d>`` (index within the
    split of that epoch, from 0)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return f"{job_id}:e{epoch}:{split}:{index:05d}"


def batch_id_for(shard_id: str, position: int) -> str:
    """Deterministic batch id: ``<shard_id>:b<position:03d>`` (position within the shard)."""
    return f"{shard_id}:b{position:03d}"


# --------------------------------------------------------------------------- schemas (v1)


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


@message("JobEvent", version=1)
@dataclass(kw_only=True, slots=True)
class JobEvent(Message):
    """One step in a job's life on ``Topics.jobs``; the job state is the fold of its events."""

    job_id: str
    """Id of the job."""
    event: str
    """What happened (``submitted``, ``running``, ``failed``, ...)."""
    at: float
    """When it happened, unix time in seconds."""
    data: dict[str, Any]
    """Event-specific details (the spec on submit, the reason on failure, ...)."""


@message("ShardTask", version=2)
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
    routing: list[float] = dataclasses.field(default_factory=list)
    """One weight per partition of the job's batches topic (>= 0, positive sum): each batch
    goes to the partition :func:`conveyor.libs.routing.choose_partition` picks from its id.
    Empty: unweighted (the key's hash picks). Added in version 2."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.routing and not (
            all(math.isfinite(w) and w >= 0 for w in self.routing) and sum(self.routing) > 0
        ):
            raise ValueError(f"routing weights must be finite, >= 0 with a positive sum, "
                             f"got {self.routing!r}")  # fmt: skip


@message("Batch", version=1)
@dataclass(kw_only=True, slots=True)
class Batch(Message):
    """A ready micro-batch on ``Topics.batches(job_id)``; images stay uint8 until the device."""

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
    """uint8 [B, C, H, W] images, augmented, not normalised."""
    y: Tensor
    """int64 [B] class labels."""
    timestamps: dict[str, float]
    """Stage name -> unix time in seconds: ``released`` (sharder), ``read_start``,
    ``read_end``, ``augment_end``, ``sent`` (preprocessor), then the trainer's stages."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        # Runs on every decoded batch: each tensor attribute is read once (they are not free).
        x, y = self.x, self.y
        x_shape, y_shape = x.shape, y.shape
        if x.dtype is not torch.uint8 or len(x_shape) != 4:
            raise ValueError(f"x must be uint8 [B,C,H,W], got {x.dtype} {list(x_shape)}")
        rows = x_shape[0]
        if y.dtype is not torch.int64 or y_shape != (rows,):
            raise ValueError(f"y must be int64 [B], got {y.dtype} {list(y_shape)}")
        if len(self.sample_ids) != rows:
            raise ValueError(f"{len(self.sample_ids)} sample_ids for {rows} rows")


@message("Heartbeat", version=1)
@dataclass(kw_only=True, slots=True)
class Heartbeat(Message):
    """A worker's periodic sign of life and state on ``Topics.control(job_id)``."""

    job_id: str
    """Id of the job."""
    worker_id: str
    """Id of the worker process, stable for its lifetime."""
    role: str
    """``trainer``, ``preprocessor``, ``aggregator``, ..."""
    at: float
    """When it was sent, unix time in seconds."""
    info: dict[str, Any]
    """Role-specific state (throughput, step-time breakdown, GPU state, ...)."""


# --- Gradient plane (trainers <-> aggregator shards) -------------------------------------------
#
# Versions: the model's parameters at version v are what every trainer computes on; version v+1
# results from applying the contributions listed in the StepClose of version v+1. Version 0 is
# the seeded initialisation. Slice p of the flattened fp32 parameter vector lives on partition p
# of the grads and params topics.


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


@message("Contribution", version=1)
@dataclass(kw_only=True, slots=True)
class Contribution(Message):
    """Sent by a trainer on ``Topics.control(job_id)`` after ALL of its GradSlices were
    acknowledged: from then on every aggregator shard can apply it. May be empty
    (``num_samples == 0``) when the trainer had no batch for the step (sync mode)."""

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
    """Batches it consumed; a batch id is applied at most once per job."""
    loss_sum: float
    """Sum of the per-sample training losses."""
    grad_bytes: int
    """Bytes of gradient payload sent for it (all slices), for the wire-bytes report."""
    sent_at: float
    """Unix seconds."""


@message("StepClose", version=1)
@dataclass(kw_only=True, slots=True)
class StepClose(Message):
    """The coordinator's decision, on ``Topics.control(job_id)``: version ``version`` is the
    previous one plus exactly these contributions. Every shard applies it to its slice and
    publishes its ParamSlice of ``version``; trainers learn from it which batches are applied
    (commit them, skip redeliveries) and their next micro-batch allocation."""

    job_id: str
    """Id of the job."""
    version: int
    """The new version (previous + 1)."""
    contributions: list[dict[str, Any]]
    """Each ``{contribution_id, worker_id, base_version, num_samples, staleness}``."""
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
