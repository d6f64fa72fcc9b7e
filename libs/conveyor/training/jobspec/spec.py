"""The whole job spec: its sections and the rules that span them."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import Field, ValidationInfo, field_validator

from conveyor.training.jobspec.base import (
    IMAGE_FILE_SCHEMES,
    LANGUAGE_MODELS,
    _Spec,
)
from conveyor.training.jobspec.data import DatasetSpec, PreprocessSpec
from conveyor.training.jobspec.distribution import DistributionSpec
from conveyor.training.jobspec.model import ModelSpec
from conveyor.training.jobspec.optimization import TrainingSpec
from conveyor.training.jobspec.runtime import CheckpointSpec, FlowSpec, ResourcesSpec

DEFAULT_LEAD_BYTES = 256 * 2**20
"""The backlog a job's default flow-control lead allows, in bytes of uint8 image batches."""
DEFAULT_LEAD_BATCHES_RANGE = (64, 512)
"""The fewest and most batches of a default lead."""
UNSIZED_LEAD_BATCHES = 64
"""The default lead of a job whose sample size in bytes is not known before it is planned (no
``preprocess.image_size``, and a dataset other than the built-in digits or ``synthetic://``:
npz, idx and token datasets): the lead before the default was sized by bytes. Not more while
the bytes are unknown: 64 micro-batches of 32 224x224x3 images from an npz set already exceed
the 256 MiB of ``DEFAULT_LEAD_BYTES``."""

LEAD_SHARD_TASKS = 16
"""Shard tasks the default shard size fits in a job's flow-control lead: enough for a pool of
16 preprocessor slots (processes x ``CONVEYOR_PREPROCESSOR_CONCURRENCY``) to work at once."""


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
    flow: FlowSpec = Field(default_factory=FlowSpec, validate_default=True)

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
    def _lead_sized_by_bytes(cls, flow: FlowSpec, info: ValidationInfo) -> FlowSpec:
        if flow.max_lead_batches is not None:
            return flow
        training, distribution = info.data.get("training"), info.data.get("distribution")
        lead = default_lead_batches(info.data.get("dataset"), info.data.get("preprocess"), training)
        if training is not None and distribution is not None:
            # A local window's (or a deterministic step's) batches are all released before it
            # can close: a default lead holds two, so the next one's are decoded meanwhile.
            lead = max(lead, 2 * window_batches(training, distribution))
        return flow.model_copy(update={"max_lead_batches": lead})

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
        # Overlapped steps take the next window's batches while these wait (no help without).
        window = window_batches(training, distribution)
        lead = flow.max_lead_batches
        assert lead is not None  # _lead_sized_by_bytes ran first
        if lead < window:
            raise ValueError(
                f"max_lead_batches ({lead}) must hold one local-mode window: "
                f"(sync_every_steps + overlap_steps) x micro-batches per step = {window}"
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
        lead = flow.max_lead_batches
        assert lead is not None  # _lead_sized_by_bytes ran first
        if lead < step:
            raise ValueError(
                f"max_lead_batches ({lead}) must hold one deterministic step: {step} micro-batches"
            )
        return flow

    @property
    def language_model(self) -> bool:
        """Whether the job trains a language model on token sequences (``tokens://``): its
        losses are per token, it has a perplexity and no accuracy."""
        return self.dataset.scheme == "tokens"

    @property
    def lead_batches(self) -> int:
        """``flow.max_lead_batches`` as resolved when the spec was validated (never None)."""
        assert self.flow.max_lead_batches is not None  # _lead_sized_by_bytes set it
        return self.flow.max_lead_batches

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches in one optimizer step (all trainers together)."""
        return self.training.global_batch_size // self.training.micro_batch_size

    @property
    def shard_size(self) -> int:
        """Samples per shard task: ``flow.shard_size``, or by default as many micro-batches
        (1 to 8) as let the flow-control lead hold ``LEAD_SHARD_TASKS`` tasks: a preprocessor
        slot works on one whole task and its batches count against the lead from release, so
        with fewer tasks than slots in the lead some slots sit idle however starved the
        trainers are (a lead of 64 batches in shards of 8 kept at most 8 slots busy)."""
        if self.flow.shard_size is not None:
            return self.flow.shard_size
        batches = min(8, max(1, self.lead_batches // LEAD_SHARD_TASKS))
        return batches * self.training.micro_batch_size

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


def window_batches(training: TrainingSpec, distribution: DistributionSpec) -> int:
    """Micro-batches (all trainers together) that one contribution round takes: a local-mode
    window of ``sync_every_steps + overlap_steps`` steps, else one step."""
    steps = (distribution.sync_every_steps or 1) + distribution.overlap_steps
    return steps * (training.global_batch_size // training.micro_batch_size)


def default_lead_batches(
    dataset: DatasetSpec | None, preprocess: PreprocessSpec | None, training: TrainingSpec | None
) -> int:
    """The flow-control lead of a job that sets none: as many micro-batches of uint8 images as
    fit ``DEFAULT_LEAD_BYTES``, within ``DEFAULT_LEAD_BATCHES_RANGE``; ``UNSIZED_LEAD_BATCHES``
    when the spec does not say the images' size (``preprocess.image_size``, else what the
    dataset URI says: :attr:`DatasetSpec.sample_bytes`). The lead must cover what the trainers
    consume while a consumption report travels to the sharder and the released shards are
    decoded (a GPU trainer eating 3,000 64x64 images a second starved behind a lead of 32
    batches and was fed at 128; local-mode trainers of the digits job waited 8-16% of the time
    for data behind 64 on 2 cores and 1.3-1.7% behind 512, see docs/operations.md)."""
    if training is None:
        return UNSIZED_LEAD_BATCHES
    if preprocess is not None and preprocess.image_size is not None:
        height, width = preprocess.image_size
        sample_bytes = (preprocess.channels or 3) * height * width
    elif dataset is not None and dataset.sample_bytes is not None:
        sample_bytes = dataset.sample_bytes
    else:
        return UNSIZED_LEAD_BATCHES
    least, most = DEFAULT_LEAD_BATCHES_RANGE
    return min(most, max(least, DEFAULT_LEAD_BYTES // (training.micro_batch_size * sample_bytes)))
