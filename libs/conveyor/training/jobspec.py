"""The job spec: what a user submits to the gateway (DESIGN section 6).

Pydantic v2 models, ``extra="forbid"`` everywhere except :class:`ModelSpec`,
frozen, every limit stated once with ``Field``. Validation is pure (no I/O): a
dataset URI is checked for its scheme only; whether it can be read is the
sharder's job. Cross-field rules are field validators on the later field, so a
422 points at the field to fix (``training.micro_batch_size``), not the model.

Invalid input raises :class:`pydantic.ValidationError` (a ``ValueError``);
:meth:`JobSpec.from_yaml` raises ``ValueError`` for unparsable YAML too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DATASET_SCHEMES = frozenset(
    {"builtin", "synthetic", "npz", "mnist-idx", "imagefolder", "webdataset", "parquet", "tokens"}
)
"""URI schemes a dataset may use; the datasets library resolves what follows ``://``."""

LANGUAGE_MODELS = frozenset({"gpt"})
"""Models that read token sequences and predict the next token: the models of ``tokens://``
jobs, and only of those (every other model, plug-ins included, classifies images)."""

IMAGE_FILE_SCHEMES = frozenset({"imagefolder", "webdataset", "parquet"})
"""Schemes of encoded images of any size: a job needs ``preprocess.image_size`` for them."""

CHECKPOINT_SCHEMES = frozenset({"file", "s3"})
"""Object-store schemes a checkpoint location may use."""

MAX_SEED = 2**63 - 1

JsonScalar = str | int | float | bool | None
ModelOption = JsonScalar | list[JsonScalar]


class _Spec(BaseModel):
    """Common config of every spec section: unknown keys are errors, values are final."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(BaseModel):
    """A model from the registry; no user code.

    Every key other than ``name`` is a keyword argument of the registry's builder
    (``{name: small_cnn, num_classes: 10}``), so a spec reads like the design's
    example. Options must be JSON scalars or lists of them.
    """

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    """Registry name of the model (``small_cnn``, ``mlp``, ``resnet18``...)."""

    __pydantic_extra__: dict[str, ModelOption] = Field(init=False)

    @property
    def options(self) -> dict[str, ModelOption]:
        """Builder keyword arguments: every key but ``name``."""
        return dict(self.model_extra or {})


class DatasetSpec(_Spec):
    uri: str = Field(min_length=1, max_length=1024)
    """``builtin://sklearn-digits``, ``synthetic://...``, ``npz://<dir or s3 prefix>``,
    ``mnist-idx://<dir>``, ``imagefolder://<dir or s3 prefix>``,
    ``webdataset://<dir or s3 prefix>/{000000..000009}.tar``, ``parquet://<file or dir>``; a
    stored one must lie inside the operator's dataset roots
    (:mod:`conveyor.training.locations`, checked at submission and before reading)."""
    eval_fraction: float = Field(default=0.2, ge=0.0, le=0.5)
    """Share of the samples held out for evaluation."""
    max_bad_samples: int = Field(default=10, ge=0, le=1_000_000)
    """Distinct samples that fail validation (corrupt image, bad tar member, null label...) that
    the job skips; one more fails it, naming the files. Array datasets (npz, idx) have no
    per-sample failures: a bad shard fails the job at once."""

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme, sep, rest = uri.partition("://")
        if not sep:
            raise ValueError(f"dataset uri {uri!r} must look like <scheme>://<location>")
        if scheme not in DATASET_SCHEMES:
            known = ", ".join(sorted(DATASET_SCHEMES))
            raise ValueError(f"unknown dataset scheme {scheme!r}; expected one of: {known}")
        # Only synthetic:// has a meaningful empty location (every parameter defaulted).
        if not rest and scheme != "synthetic":
            raise ValueError(f"dataset uri {uri!r} names no location after {scheme}://")
        return uri

    @property
    def scheme(self) -> str:
        """The URI scheme (``builtin``, ``synthetic``, ``npz``, ``mnist-idx``, ``imagefolder``,
        ``webdataset``, ``parquet``, ``tokens``)."""
        return self.uri.partition("://")[0]


class NormalizeSpec(_Spec):
    mean: list[float] = Field(min_length=1, max_length=16)
    """Per-channel mean of the [0, 1]-scaled image (one value broadcasts)."""
    std: list[float] = Field(min_length=1, max_length=16)
    """Per-channel standard deviation; every value > 0."""

    @field_validator("std")
    @classmethod
    def _std_matches_mean(cls, std: list[float], info: ValidationInfo) -> list[float]:
        if any(not value > 0 for value in std):
            raise ValueError("every std value must be > 0")
        mean = info.data.get("mean")
        if mean is not None and len(mean) != len(std):
            raise ValueError(f"std has {len(std)} values but mean has {len(mean)}")
        return std


class RandomCropSpec(_Spec):
    """Pad by ``padding`` pixels on each side, then crop back at a random offset."""

    name: Literal["random_crop"]
    padding: int = Field(default=4, ge=0, le=64)


class HFlipSpec(_Spec):
    """Mirror horizontally with probability ``p``."""

    name: Literal["hflip"]
    p: float = Field(default=0.5, ge=0.0, le=1.0)


class CpuCostSpec(_Spec):
    """Burn ``ms`` of CPU per sample: stands in for expensive decoding in load tests."""

    name: Literal["cpu_cost"]
    ms: float = Field(default=1.0, ge=0.0, le=10_000.0)


class ResizeSpec(_Spec):
    """Bring the image to the output size: ``crop`` scales the shorter side to fit and cuts
    the centre (keeps the aspect ratio), ``stretch`` scales each side. Deterministic."""

    name: Literal["resize"]
    fit: Literal["crop", "stretch"] = "crop"


class RandomResizedCropSpec(_Spec):
    """Cut a random area (a share ``scale`` of the image, aspect ratio in ``ratio``) and scale
    it to the output size (torchvision's RandomResizedCrop); evaluation batches get ``resize``
    (fit crop) instead."""

    name: Literal["random_resized_crop"]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    @field_validator("scale", "ratio")
    @classmethod
    def _ordered_positive(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < bounds[0] <= bounds[1]:
            raise ValueError(f"bounds must satisfy 0 < low <= high, got {list(bounds)}")
        return bounds

    @field_validator("scale")
    @classmethod
    def _scale_at_most_one(cls, scale: tuple[float, float]) -> tuple[float, float]:
        if scale[1] > 1.0:
            raise ValueError(f"scale is a share of the image, at most 1, got {list(scale)}")
        return scale


class ColorJitterSpec(_Spec):
    """Random brightness, contrast and saturation factors in ``[1 - x, 1 + x]`` and a hue shift
    in ``[-hue, hue]`` turns (saturation and hue leave one-channel images alone)."""

    name: Literal["color_jitter"]
    brightness: float = Field(default=0.0, ge=0.0, le=1.0)
    contrast: float = Field(default=0.0, ge=0.0, le=1.0)
    saturation: float = Field(default=0.0, ge=0.0, le=1.0)
    hue: float = Field(default=0.0, ge=0.0, le=0.5)


AugmentSpec = Annotated[
    RandomCropSpec | HFlipSpec | CpuCostSpec | ResizeSpec | RandomResizedCropSpec | ColorJitterSpec,
    Field(discriminator="name"),
]

SIZING_OPS = frozenset({"resize", "random_resized_crop"})
"""Augment ops that bring an image to the output size (at most one per job)."""


class PreprocessSpec(_Spec):
    normalize: NormalizeSpec | None = None
    """Applied on the trainer's device after the uint8 batch arrives; None = scale to [0, 1]."""
    image_size: tuple[int, int] | None = None
    """Output ``[H, W]`` of every image; required for image files (any size), optional for
    array datasets (their own size when None). Images reach it through the augment list's
    ``resize`` or ``random_resized_crop``, or a ``resize`` (fit crop) before the list."""
    channels: Literal[1, 3] | None = None
    """Image files are decoded to grayscale (1) or RGB (3, the default); array datasets keep
    their own channels (a different value is refused when the job is planned)."""
    augment: list[AugmentSpec] = Field(default_factory=list, max_length=16)
    """Applied in order by the preprocessors, seeded by (job seed, epoch, sample id); on
    evaluation batches only the deterministic ops run (``random_resized_crop`` becomes
    ``resize``)."""

    @field_validator("image_size")
    @classmethod
    def _size_range(cls, size: tuple[int, int] | None) -> tuple[int, int] | None:
        if size is not None and not all(1 <= side <= 4096 for side in size):
            raise ValueError(f"image_size sides must be in [1, 4096], got {list(size)}")
        return size

    @field_validator("augment")
    @classmethod
    def _one_sizing_op(cls, augment: list[AugmentSpec]) -> list[AugmentSpec]:
        sizing = [op.name for op in augment if op.name in SIZING_OPS]
        if len(sizing) > 1:
            raise ValueError(f"at most one of resize, random_resized_crop, got {sizing}")
        return augment


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
    outer_optimizer: OptimizerSpec | None = Field(default=None, validate_default=True)
    """local: the optimizer the aggregators apply to the mean parameter delta (the outer
    gradient); None: SGD lr 0.7 with Nesterov momentum 0.5 (DiLoCo's lr; its momentum 0.9
    diverges on top of an inner SGD momentum of 0.9, see docs/operations.md). Only for local."""
    allocation: Literal["adaptive", "equal"] = "adaptive"
    """adaptive: each trainer's micro-batches per step, and its share of the batches (the
    routing of batches to partitions), follow its measured throughput; equal: the step is
    split equally and batches are not routed (each trainer reads an equal share)."""
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
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


class FlowSpec(_Spec):
    max_lead_batches: int = Field(default=64, ge=1, le=1_000_000)
    """How many ready train batches may exist ahead of what the trainers consumed."""
    shard_size: int | None = Field(default=None, ge=1, le=10_000_000)
    """Samples per shard task; None = 8 * micro_batch_size (see JobSpec.shard_size)."""


class JobSpec(_Spec):
    """A complete, validated job description."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")
    """Human name; lower-case letters, digits, '-', '_', '.'."""
    priority: int = Field(default=0, ge=-1000, le=1000)
    """Scheduling priority: a higher one gets trainers first (and takes a lower one's elastic
    extras); equal priorities are served in submission order."""
    model: ModelSpec
    dataset: DatasetSpec
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec, validate_default=True)
    training: TrainingSpec
    distribution: DistributionSpec = Field(default_factory=DistributionSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    flow: FlowSpec = Field(default_factory=FlowSpec)

    @field_validator("preprocess")
    @classmethod
    def _image_files_have_a_size(
        cls, preprocess: PreprocessSpec, info: ValidationInfo
    ) -> PreprocessSpec:
        dataset = info.data.get("dataset")
        if (
            dataset is not None
            and dataset.scheme in IMAGE_FILE_SCHEMES
            and preprocess.image_size is None
        ):
            raise ValueError(
                f"{dataset.scheme}:// images have any size: set image_size [H, W], the shape "
                f"the preprocessors bring them to"
            )
        if dataset is not None and dataset.scheme == "tokens" and preprocess != PreprocessSpec():
            raise ValueError(
                "tokens:// sequences go to the model as they are: leave preprocess out "
                "(no image_size, channels, normalize or augment)"
            )
        return preprocess

    @field_validator("dataset")
    @classmethod
    def _language_models_read_tokens(
        cls, dataset: DatasetSpec, info: ValidationInfo
    ) -> DatasetSpec:
        model = info.data.get("model")
        if model is not None and (dataset.scheme == "tokens") != (model.name in LANGUAGE_MODELS):
            if dataset.scheme == "tokens":
                names = ", ".join(sorted(LANGUAGE_MODELS))
                raise ValueError(
                    f"tokens:// datasets train language models ({names}), not {model.name!r}"
                )
            raise ValueError(
                f"model {model.name!r} reads tokens:// datasets, not {dataset.scheme}://"
            )
        return dataset

    @field_validator("flow")
    @classmethod
    def _shard_holds_whole_batches(cls, flow: FlowSpec, info: ValidationInfo) -> FlowSpec:
        training = info.data.get("training")
        if flow.shard_size is not None and training is not None:
            micro = training.micro_batch_size
            if flow.shard_size % micro:
                raise ValueError(
                    f"shard_size ({flow.shard_size}) must be a multiple of "
                    f"training.micro_batch_size ({micro})"
                )
        return flow

    @field_validator("flow")
    @classmethod
    def _lead_holds_a_window(cls, flow: FlowSpec, info: ValidationInfo) -> FlowSpec:
        training, distribution = info.data.get("training"), info.data.get("distribution")
        if training is None or distribution is None or distribution.sync_every_steps is None:
            return flow
        # A window's batches are acknowledged only once its outer step closes, so the
        # sharder's lead must let one window's worth be released at a time.
        window = distribution.sync_every_steps * (
            training.global_batch_size // training.micro_batch_size
        )
        if flow.max_lead_batches < window:
            raise ValueError(
                f"max_lead_batches ({flow.max_lead_batches}) must hold one local-mode window: "
                f"sync_every_steps x micro-batches per step = {window}"
            )
        return flow

    @field_validator("flow")
    @classmethod
    def _lead_holds_a_step(cls, flow: FlowSpec, info: ValidationInfo) -> FlowSpec:
        training, distribution = info.data.get("training"), info.data.get("distribution")
        if training is None or distribution is None or not distribution.deterministic:
            return flow
        # A deterministic step waits for all its micro-batches (never sends a partial one),
        # so the sharder's lead must let a whole step's worth be released.
        step = training.global_batch_size // training.micro_batch_size
        if flow.max_lead_batches < step:
            raise ValueError(
                f"max_lead_batches ({flow.max_lead_batches}) must hold one deterministic step: "
                f"{step} micro-batches"
            )
        return flow

    @property
    def language_model(self) -> bool:
        """Whether the job trains a language model on token sequences (``tokens://``): its
        losses are per token, it has a perplexity and no accuracy."""
        return self.dataset.scheme == "tokens"

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches in one optimizer step (all trainers together)."""
        return self.training.global_batch_size // self.training.micro_batch_size

    @property
    def shard_size(self) -> int:
        """Samples per shard task: ``flow.shard_size`` or 8 micro-batches."""
        if self.flow.shard_size is not None:
            return self.flow.shard_size
        return 8 * self.training.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict that :meth:`from_dict` turns back into an equal spec."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Validate a decoded mapping; raises ``pydantic.ValidationError``."""
        return cls.model_validate(data)

    @classmethod
    def from_yaml(cls, text: str) -> JobSpec:
        """Parse and validate YAML (JSON is YAML too); raises ``ValueError``."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"job spec is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("job spec must be a YAML mapping at the top level")
        return cls.model_validate(data)
