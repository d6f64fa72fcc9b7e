"""The job spec: what a user submits to the gateway (DESIGN section 6), one module a section
(:mod:`.model`, :mod:`.data`, :mod:`.optimization`, :mod:`.distribution`, :mod:`.runtime`)
and :mod:`.spec` for the whole.

Pydantic v2 models, ``extra="forbid"`` everywhere except :class:`ModelSpec`,
frozen, every limit stated once with ``Field``. Validation is pure (no I/O): a
dataset URI is checked for its scheme only; whether it can be read is the
sharder's job. Cross-field rules are field validators on the later field, so a
422 points at the field to fix (``training.micro_batch_size``), not the model.

Invalid input raises :class:`pydantic.ValidationError` (a ``ValueError``);
:meth:`JobSpec.from_yaml` raises ``ValueError`` for unparsable YAML too.
"""

from __future__ import annotations

from conveyor.training.jobspec.base import (
    CHECKPOINT_SCHEMES,
    DATASET_SCHEMES,
    IMAGE_FILE_SCHEMES,
    LANGUAGE_MODELS,
    MAX_SEED,
    JsonScalar,
    ModelOption,
)
from conveyor.training.jobspec.data import (
    SIZING_OPS,
    AugmentSpec,
    ColorJitterSpec,
    CpuCostSpec,
    DatasetSpec,
    HFlipSpec,
    NormalizeSpec,
    PreprocessSpec,
    RandomCropSpec,
    RandomResizedCropSpec,
    ResizeSpec,
)
from conveyor.training.jobspec.distribution import (
    CompressionSpec,
    DistributionSpec,
)
from conveyor.training.jobspec.model import (
    ModelSpec,
)
from conveyor.training.jobspec.optimization import (
    LrScheduleSpec,
    OptimizerSpec,
    TrainingSpec,
)
from conveyor.training.jobspec.runtime import (
    CheckpointSpec,
    FlowSpec,
    ResourcesSpec,
)
from conveyor.training.jobspec.spec import (
    JobSpec,
)

__all__ = [
    "CHECKPOINT_SCHEMES",
    "DATASET_SCHEMES",
    "IMAGE_FILE_SCHEMES",
    "LANGUAGE_MODELS",
    "MAX_SEED",
    "SIZING_OPS",
    "AugmentSpec",
    "CheckpointSpec",
    "ColorJitterSpec",
    "CompressionSpec",
    "CpuCostSpec",
    "DatasetSpec",
    "DistributionSpec",
    "FlowSpec",
    "HFlipSpec",
    "JobSpec",
    "JsonScalar",
    "LrScheduleSpec",
    "ModelOption",
    "ModelSpec",
    "NormalizeSpec",
    "OptimizerSpec",
    "PreprocessSpec",
    "RandomCropSpec",
    "RandomResizedCropSpec",
    "ResizeSpec",
    "ResourcesSpec",
    "TrainingSpec",
]
