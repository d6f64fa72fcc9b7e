"""Deterministic per-sample augmentation of uint8 image batches.

``build_augmenter([{"name": "random_crop", "padding": 4}, {"name": "hflip"}])``
returns an ``Augmenter`` whose ``apply(x, sample_ids, seed=, epoch=)`` gives
each sample its own random stream keyed by ``(seed, epoch, sample_id)``, so a
sample's augmentation never depends on which batch or process it lands in, and a
resumed job reproduces it exactly. Ops run in the order given; each draws its
random numbers whether or not it changes the image, so one op's outcome never
shifts another's.

Ops (pixel units are uint8 levels 0..255):
- ``random_crop {padding: int >= 0 = 4}``: zero-pad each side, crop back to HxW.
- ``hflip {p: float in [0,1] = 0.5}``: mirror left-right with probability p.
- ``noise {std: float >= 0}``: add Gaussian noise, round, clip to 0..255.
- ``cpu_cost {ms: float >= 0}``: burn that much CPU per sample (emulates heavy decoding).

Normalisation is not here: images stay uint8 until the trainer's device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from conveyor.training.datasets.base import burn_cpu

Image = NDArray[np.uint8]
"""One image ``[C, H, W]``."""

_U64 = (1 << 64) - 1
_AUGMENT_STREAM = 1
"""Top counter word of augmentation streams; keeps them apart from other users of a key."""


class Op(ABC):
    """One augmentation step on a single image."""

    NAME: ClassVar[str]
    PARAMS: ClassVar[tuple[str, ...]]

    @abstractmethod
    def __call__(self, image: Image, rng: np.random.Generator) -> Image:
        """Return the augmented ``[C,H,W]`` image (may be a view of ``image``)."""

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.NAME, **{p: getattr(self, p) for p in self.PARAMS}}


def _number(
    name: str,
    params: Mapping[str, Any],
    key: str,
    default: float | None,
    low: float,
    high: float = float("inf"),
) -> float:
    value = params.get(key, default)
    if value is None:
        raise ValueError(f"augment op {name!r} needs parameter {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"augment op {name!r}: {key} must be a number, got {value!r}")
    if not low <= float(value) <= high:  # also rejects nan
        raise ValueError(f"augment op {name!r}: {key}={value} must be in [{low}, {high}]")
    return float(value)


@dataclass(frozen=True, slots=True)
class RandomCrop(Op):
    NAME: ClassVar[str] = "random_crop"
    PARAMS: ClassVar[tuple[str, ...]] = ("padding",)
    padding: int

    def __call__(self, image: Image, rng: np.random.Generator) -> Image:
        p = self.padding
        dy, dx = rng.integers(0, 2 * p + 1, size=2).tolist()
        shift_y, shift_x = dy - p, dx - p  # output pixel (i, j) shows input (i + sy, j + sx)
        if shift_y == 0 and shift_x == 0:
            return image
        _, h, w = image.shape
        out = np.zeros_like(image)  # [C,H,W]; what falls outside the input is zero padding
        out[:, _dst(shift_y, h), _dst(shift_x, w)] = image[:, _src(shift_y, h), _src(shift_x, w)]
        return out


def _dst(shift: int, size: int) -> slice:
    return slice(min(size, max(0, -shift)), max(0, min(size, size - shift)))


def _src(shift: int, size: int) -> slice:
    return slice(min(size, max(0, shift)), max(0, min(size, size + shift)))


@dataclass(frozen=True, slots=True)
class HFlip(Op):
    NAME: ClassVar[str] = "hflip"
    PARAMS: ClassVar[tuple[str, ...]] = ("p",)
    p: float

    def __call__(self, image: Image, rng: np.random.Generator) -> Image:
        return image[:, :, ::-1] if rng.random() < self.p else image


@dataclass(frozen=True, slots=True)
class Noise(Op):
    NAME: ClassVar[str] = "noise"
    PARAMS: ClassVar[tuple[str, ...]] = ("std",)
    std: float

    def __call__(self, image: Image, rng: np.random.Generator) -> Image:
        noisy = rng.standard_normal(image.shape, dtype=np.float32)  # [C,H,W]
        noisy *= self.std
        noisy += image
        return np.rint(noisy, out=noisy).clip(0.0, 255.0).astype(np.uint8)


@dataclass(frozen=True, slots=True)
class CpuCost(Op):
    NAME: ClassVar[str] = "cpu_cost"
    PARAMS: ClassVar[tuple[str, ...]] = ("ms",)
    ms: float

    def __call__(self, image: Image, rng: np.random.Generator) -> Image:
        burn_cpu(self.ms)
        return image


def _random_crop(params: Mapping[str, Any]) -> Op:
    padding = _number("random_crop", params, "padding", 4, 0, 1024)
    if padding != int(padding):
        raise ValueError(f"augment op 'random_crop': padding must be an integer, got {padding}")
    return RandomCrop(int(padding))


_BUILDERS: dict[str, Callable[[Mapping[str, Any]], Op]] = {
    "random_crop": _random_crop,
    "hflip": lambda params: HFlip(_number("hflip", params, "p", 0.5, 0.0, 1.0)),
    "noise": lambda params: Noise(_number("noise", params, "std", None, 0.0, 255.0)),
    "cpu_cost": lambda params: CpuCost(_number("cpu_cost", params, "ms", None, 0.0, 10_000.0)),
}
_PARAMS = {op.NAME: op.PARAMS for op in (RandomCrop, HFlip, Noise, CpuCost)}


def known_ops() -> list[str]:
    """Names accepted by ``build_augmenter``."""
    return sorted(_BUILDERS)


@dataclass(frozen=True, slots=True)
class Augmenter:
    """A fixed sequence of ops; picklable, so it can be shipped to worker processes."""

    ops: tuple[Op, ...]

    def apply(
        self,
        x: NDArray[np.uint8],
        sample_ids: Sequence[int] | NDArray[np.integer],
        *,
        seed: int,
        epoch: int,
    ) -> NDArray[np.uint8]:
        """Augment ``x`` uint8 ``[N,C,H,W]``; ``sample_ids`` ``[N]`` are the samples' global ids.

        Returns a new array (``x`` itself when there are no ops). ValueError for
        mismatched shapes, a non-uint8 input or a negative epoch.
        """
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)  # [N]
        if x.dtype != np.uint8 or x.ndim != 4:
            raise ValueError(f"x must be uint8 [N,C,H,W], got {x.dtype} {x.shape}")
        if ids.size != x.shape[0]:
            raise ValueError(f"{x.shape[0]} images but {ids.size} sample ids")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not self.ops:
            return x
        out = np.empty_like(x)  # [N,C,H,W]
        key_seed = seed & _U64  # negative seeds map to distinct unsigned keys
        counter = np.array([0, 0, epoch, _AUGMENT_STREAM], dtype=np.uint64)
        for row, sample_id in enumerate(ids.tolist()):
            key = np.array([key_seed, sample_id & _U64], dtype=np.uint64)
            rng = np.random.Generator(np.random.Philox(key=key, counter=counter))
            image = x[row]  # [C,H,W]
            for op in self.ops:
                image = op(image, rng)
            out[row] = image
        return out

    def to_specs(self) -> list[dict[str, Any]]:
        """The normalised specs (defaults filled in) this augmenter was built from."""
        return [op.to_spec() for op in self.ops]


def build_augmenter(specs: Sequence[Mapping[str, Any]]) -> Augmenter:
    """Build an Augmenter from specs like ``{"name": "hflip", "p": 0.5}``.

    ValueError for an unknown op (listing the known ones), an unknown parameter,
    or a parameter of the wrong type or range.
    """
    ops: list[Op] = []
    for i, spec in enumerate(specs):
        name = spec.get("name")
        builder = _BUILDERS.get(name) if isinstance(name, str) else None
        if builder is None or not isinstance(name, str):
            raise ValueError(f"augment[{i}]: unknown op {name!r} (known: {', '.join(known_ops())})")
        params = {k: v for k, v in spec.items() if k != "name"}
        unknown = sorted(set(params) - set(_PARAMS[name]))
        if unknown:
            raise ValueError(
                f"augment[{i}] {name!r}: unknown parameter(s) {unknown} "
                f"(accepted: {list(_PARAMS[name])})"
            )
        ops.append(builder(params))
    return Augmenter(tuple(ops))
