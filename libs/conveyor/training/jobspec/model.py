"""``model``: which model a job trains, and its options."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from conveyor.training.jobspec.base import (
    ModelOption,
)


class ModelSpec(BaseModel):
    """A model from the registry; no user code.

    Every key other than ``name`` is a keyword argument of the registry's builder
    (``{name: small_cnn, num_classes: 10}``), so a spec reads like the design's
    example. Options must be JSON scalars or lists of them.
    """

    model_config = ConfigDict(
        extra="allow", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    """Registry name of the model (``small_cnn``, ``mlp``, ``resnet18``...)."""

    __pydantic_extra__: dict[str, ModelOption] = Field(init=False)

    @property
    def options(self) -> dict[str, ModelOption]:
        """Builder keyword arguments: every key but ``name``."""
        return dict(self.model_extra or {})
