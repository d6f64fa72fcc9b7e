"""``dataset`` and ``preprocess``: what a job reads and how its samples become tensors."""

from __future__ import annotations

import math
from typing import Annotated, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, ValidationInfo, field_validator

from conveyor.training.jobspec.base import (
    DATASET_SCHEMES,
    _Spec,
)


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

    @property
    def sample_bytes(self) -> int | None:
        """Bytes of one uint8 sample when the URI alone says (no I/O): the built-in digits
        (1x8x8) and ``synthetic://`` (its ``shape``, 3x32x32 by default); None for datasets
        whose images are only known once read. For sizing only: the datasets library
        validates the URI when the job is planned, and a shape it would refuse gives None."""
        if self.uri == "builtin://sklearn-digits":
            return 8 * 8
        if self.scheme != "synthetic":
            return None
        shape = parse_qs(urlsplit(self.uri).query).get("shape", ["3x32x32"])[-1]
        sides = shape.lower().split("x")
        if len(sides) not in (2, 3) or not all(side.isdigit() and int(side) > 0 for side in sides):
            return None
        return math.prod(int(side) for side in sides)


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
