"""What every section of the job spec shares: the base model and the schemes and limits
that several sections check against."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

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

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )
