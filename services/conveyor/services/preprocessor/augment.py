"""Deterministic per-sample augmentation of uint8 images, to the job's fixed size.

``build_augmenter([{"name": "random_crop", "padding": 4}, {"name": "hflip"}])``
returns an ``Augmenter`` whose ``apply(x, sample_ids, seed=, epoch=)`` gives
each sample its own random stream keyed by ``(seed, epoch, sample_id)``, so a
sample's augmentation never depends on which batch or process it lands in, and a
resumed job or a redelivered shard reproduces it exactly. Ops run in the order given; each
draws its random numbers whether or not it changes the image, so one op's outcome never
shifts another's.

``x`` is a batch ``[N,C,H,W]`` or a list of images of any size (decoded image files); the
output is ``[N,C,H,W]`` at ``image_size`` (``build_augmenter(..., image_size=(H, W))``; None:
the input's size). An image reaches the size through the list's sizing op (``resize`` or
``random_resized_crop``, at most one) or, when the list has none, a ``resize`` (fit crop)
before it. ``apply_encoded`` takes the image files themselves (``EncodedImage``) and, when the
first op sizes, decodes each straight to the output size with the same draws (a JPEG at a
reduced DCT scale; see ``EncodedImage.region``).

Ops (pixel units are uint8 levels 0..255):
- ``random_crop {padding: int >= 0 = 4}``: zero-pad each side, crop back to HxW.
- ``hflip {p: float in [0,1] = 0.5}``: mirror left-right with probability p.
- ``noise {std: float >= 0}``: add Gaussian noise, round, clip to 0..255.
- ``cpu_cost {ms: float >= 0}``: burn that much CPU per sample (emulates heavy decoding).
- ``resize {fit: crop|stretch = crop}``: to the output size; ``crop`` keeps the aspect ratio
  (shorter side to fit, centre cut), ``stretch`` does not.
- ``random_resized_crop {scale: [lo, hi] = [0.08, 1], ratio: [lo, hi] = [3/4, 4/3]}``: a random
  region (area share, aspect ratio) scaled to the output size.
- ``color_jitter {brightness, contrast, saturation: [0, 1] = 0, hue: [0, 0.5] = 0}``: random
  factors in ``[1 - x, 1 + x]`` and a hue turn in ``[-hue, hue]``.

``for_eval()`` is the augmenter of evaluation batches: the deterministic ops only
(``random_resized_crop`` becomes ``resize`` with fit crop; ``cpu_cost`` stays, it stands for
decoding). Normalisation is not here: images stay uint8 until the trainer's device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from conveyor.services.preprocessor.image_ops import (
    center_fit_box,
    color_jitter,
    random_resized_box,
    resize_region,
)
from conveyor.training.datasets.base import burn_cpu
from conveyor.training.datasets.images import BadImage, EncodedImage

Image = NDArray[np.uint8]
"""One image ``[C, H, W]``."""
Size = tuple[int, int]
"""Output ``(H, W)``."""

_U64 = (1 << 64) - 1
_AUGMENT_STREAM = 1
"""Top counter word of augmentation streams; keeps them apart from other users of a key."""


class Op(ABC):
    """One augmentation step on a single image."""

    NAME: ClassVar[str]
    PARAMS: ClassVar[tuple[str, ...]]
    SIZING: ClassVar[bool] = False
    """Brings the image to the output size (else keeps its size)."""

    @abstractmethod
    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        """Return the augmented ``[C,h,w]`` image (may be a view of ``image``); ``size`` is
        the output ``(H, W)``, which a sizing op returns and the others ignore."""

    def for_eval(self) -> Op | None:
        """This op on evaluation batches: itself when deterministic, None to skip it."""
        return None

    def decode_sized(
        self, source: EncodedImage, rng: np.random.Generator, size: Size, *, reduce: bool
    ) -> Image:
        """A sizing op's output decoded straight from an image file, with the same random
        draws as ``__call__`` on its pixels (``reduce``: see :meth:`EncodedImage.region`).
        BadImage for corrupt data."""
        raise NotImplementedError(f"{self.NAME} is not a sizing op")

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

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
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

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        return image[:, :, ::-1] if rng.random() < self.p else image


@dataclass(frozen=True, slots=True)
class Noise(Op):
    NAME: ClassVar[str] = "noise"
    PARAMS: ClassVar[tuple[str, ...]] = ("std",)
    std: float

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        noisy = rng.standard_normal(image.shape, dtype=np.float32)  # [C,H,W]
        noisy *= self.std
        noisy += image
        return np.rint(noisy, out=noisy).clip(0.0, 255.0).astype(np.uint8)


@dataclass(frozen=True, slots=True)
class CpuCost(Op):
    NAME: ClassVar[str] = "cpu_cost"
    PARAMS: ClassVar[tuple[str, ...]] = ("ms",)
    ms: float

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        burn_cpu(self.ms)
        return image

    def for_eval(self) -> Op | None:
        return self


@dataclass(frozen=True, slots=True)
class Resize(Op):
    NAME: ClassVar[str] = "resize"
    PARAMS: ClassVar[tuple[str, ...]] = ("fit",)
    SIZING: ClassVar[bool] = True
    fit: str

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        if image.shape[1:] == size:
            return image
        box = center_fit_box(image.shape[1:], size) if self.fit == "crop" else None
        return resize_region(image, size, box)

    def decode_sized(
        self, source: EncodedImage, rng: np.random.Generator, size: Size, *, reduce: bool
    ) -> Image:
        hw = (source.height, source.width)
        box = center_fit_box(hw, size) if self.fit == "crop" and hw != size else None
        return source.region(size, box, reduce=reduce)

    def for_eval(self) -> Op | None:
        return self


@dataclass(frozen=True, slots=True)
class RandomResizedCrop(Op):
    NAME: ClassVar[str] = "random_resized_crop"
    PARAMS: ClassVar[tuple[str, ...]] = ("scale", "ratio")
    SIZING: ClassVar[bool] = True
    scale: tuple[float, float]
    ratio: tuple[float, float]

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        box = random_resized_box(image.shape[1:], self.scale, self.ratio, rng)
        return resize_region(image, size, box)

    def decode_sized(
        self, source: EncodedImage, rng: np.random.Generator, size: Size, *, reduce: bool
    ) -> Image:
        box = random_resized_box((source.height, source.width), self.scale, self.ratio, rng)
        return source.region(size, box, reduce=reduce)

    def for_eval(self) -> Op | None:
        return Resize("crop")

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.NAME, "scale": list(self.scale), "ratio": list(self.ratio)}


@dataclass(frozen=True, slots=True)
class ColorJitter(Op):
    NAME: ClassVar[str] = "color_jitter"
    PARAMS: ClassVar[tuple[str, ...]] = ("brightness", "contrast", "saturation", "hue")
    brightness: float
    contrast: float
    saturation: float
    hue: float

    def __call__(self, image: Image, rng: np.random.Generator, size: Size) -> Image:
        b, c, s = (rng.uniform(1.0 - x, 1.0 + x) for x in
                   (self.brightness, self.contrast, self.saturation))  # fmt: skip
        h = rng.uniform(-self.hue, self.hue)
        return color_jitter(image, b, c, s, h)


def _random_crop(params: Mapping[str, Any]) -> Op:
    padding = _number("random_crop", params, "padding", 4, 0, 1024)
    if padding != int(padding):
        raise ValueError(f"augment op 'random_crop': padding must be an integer, got {padding}")
    return RandomCrop(int(padding))


def _bounds(name: str, params: Mapping[str, Any], key: str, default: tuple[float, float],
            high: float) -> tuple[float, float]:  # fmt: skip
    value = params.get(key, default)
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"augment op {name!r}: {key} must be [low, high], got {value!r}")
    low = _number(name, {key: value[0]}, key, None, 1e-6, high)
    top = _number(name, {key: value[1]}, key, None, low, high)
    return (low, top)


def _resize(params: Mapping[str, Any]) -> Op:
    fit = params.get("fit", "crop")
    if fit not in ("crop", "stretch"):
        raise ValueError(f"augment op 'resize': fit must be crop or stretch, got {fit!r}")
    return Resize(fit)


def _random_resized_crop(params: Mapping[str, Any]) -> Op:
    scale = _bounds("random_resized_crop", params, "scale", (0.08, 1.0), 1.0)
    ratio = _bounds("random_resized_crop", params, "ratio", (3 / 4, 4 / 3), 100.0)
    return RandomResizedCrop(scale, ratio)


def _color_jitter(params: Mapping[str, Any]) -> Op:
    brightness, contrast, saturation = (
        _number("color_jitter", params, key, 0.0, 0.0, 1.0)
        for key in ("brightness", "contrast", "saturation")
    )
    hue = _number("color_jitter", params, "hue", 0.0, 0.0, 0.5)
    return ColorJitter(brightness, contrast, saturation, hue)


_BUILDERS: dict[str, Callable[[Mapping[str, Any]], Op]] = {
    "random_crop": _random_crop,
    "resize": _resize,
    "random_resized_crop": _random_resized_crop,
    "color_jitter": _color_jitter,
    "hflip": lambda params: HFlip(_number("hflip", params, "p", 0.5, 0.0, 1.0)),
    "noise": lambda params: Noise(_number("noise", params, "std", None, 0.0, 255.0)),
    "cpu_cost": lambda params: CpuCost(_number("cpu_cost", params, "ms", None, 0.0, 10_000.0)),
}
_OPS: tuple[type[Op], ...] = (
    RandomCrop, HFlip, Noise, CpuCost, Resize, RandomResizedCrop, ColorJitter,
)  # fmt: skip
_PARAMS = {op.NAME: op.PARAMS for op in _OPS}


def known_ops() -> list[str]:
    """Names accepted by ``build_augmenter``."""
    return sorted(_BUILDERS)


@dataclass(frozen=True, slots=True)
class EncodedOutcome:
    """What :meth:`Augmenter.apply_encoded` made of a list of image files."""

    x: NDArray[np.uint8]
    """uint8 ``[N', C, H, W]``: the files that decoded, in their order."""
    kept: list[int]
    """Positions (in the input list) of the rows of ``x``."""
    bad: list[tuple[int, str]]
    """Position and reason of each file that did not decode."""


def _stream(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The sample's own random stream, keyed by (seed, epoch, sample id)."""
    key = np.array([seed & _U64, sample_id & _U64], dtype=np.uint64)  # a negative seed too
    counter = np.array([0, 0, epoch, _AUGMENT_STREAM], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


@dataclass(frozen=True, slots=True)
class Augmenter:
    """A fixed sequence of ops and the output size; picklable, so it can be shipped to worker
    processes."""

    ops: tuple[Op, ...]
    image_size: Size | None = None
    """Output ``(H, W)``; None: each input's own size (then every input has one size)."""

    def for_eval(self) -> Augmenter:
        """The augmenter of evaluation batches (see the module docstring)."""
        ops = tuple(op for op in (op.for_eval() for op in self.ops) if op is not None)
        return Augmenter(ops, self.image_size)

    def apply(
        self,
        x: NDArray[np.uint8] | Sequence[NDArray[np.uint8]],
        sample_ids: Sequence[int] | NDArray[np.integer],
        *,
        seed: int,
        epoch: int,
    ) -> NDArray[np.uint8]:
        """Augment ``x`` (uint8 ``[N,C,H,W]``, or N images ``[C,h,w]`` of any sizes and the
        same C); ``sample_ids`` ``[N]`` are the samples' global ids. Returns a new array
        ``[N,C,H',W']`` at the output size (``x`` itself when there is nothing to do).
        ValueError for mismatched shapes, a non-uint8 input, a negative epoch, or images of
        several sizes without an ``image_size``."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)  # [N]
        images = list(x) if not isinstance(x, np.ndarray) else x
        if isinstance(images, np.ndarray) and (images.dtype != np.uint8 or images.ndim != 4):
            raise ValueError(f"x must be uint8 [N,C,H,W], got {images.dtype} {images.shape}")
        if any(i.dtype != np.uint8 or i.ndim != 3 for i in images):
            raise ValueError("every image must be uint8 [C,H,W]")
        if ids.size != len(images):
            raise ValueError(f"{len(images)} images but {ids.size} sample ids")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if len(images) == 0:
            return np.empty((0, 1, *(self.image_size or (1, 1))), dtype=np.uint8)
        size = self.image_size or images[0].shape[1:]
        channels = images[0].shape[0]
        sized = isinstance(images, np.ndarray) and images.shape[2:] == size
        if not self.ops and sized:
            assert isinstance(images, np.ndarray)
            return images
        out = np.empty((len(images), channels, *size), dtype=np.uint8)  # [N,C,H,W]
        for row, sample_id in enumerate(ids.tolist()):
            rng = _stream(seed, epoch, sample_id)
            image = images[row]  # [C,h,w]
            for op in self._ops_to_size():
                image = op(image, rng, size)
            out[row] = self._checked(image, out.shape[1:], sample_id)
        return out

    def apply_encoded(
        self,
        sources: Sequence[EncodedImage],
        sample_ids: Sequence[int],
        *,
        seed: int,
        epoch: int,
        reduce: bool = True,
    ) -> EncodedOutcome:
        """Decode and augment image files (one channel count): what :meth:`apply` gives for
        their decoded pixels, except that a sizing first op (the implicit ``resize``, or a
        list's leading ``resize``/``random_resized_crop``) decodes each file straight to the
        output size (:meth:`EncodedImage.region`; ``reduce`` False decodes it whole first).
        A file that does not decode is left out with BadImage's reason. ValueError as for
        :meth:`apply`."""
        if len(sources) != len(sample_ids):
            raise ValueError(f"{len(sources)} images but {len(sample_ids)} sample ids")
        ops = self._ops_to_size()
        if self.image_size is None or not ops or not ops[0].SIZING:
            return self._decode_then_apply(sources, sample_ids, seed=seed, epoch=epoch)
        first, rest = ops[0], ops[1:]
        size, channels = self.image_size, sources[0].channels if sources else 1
        out = np.empty((len(sources), channels, *size), dtype=np.uint8)  # [N,C,H,W]
        kept: list[int] = []
        bad: list[tuple[int, str]] = []
        for position, (source, sample_id) in enumerate(zip(sources, sample_ids, strict=True)):
            rng = _stream(seed, epoch, sample_id)
            try:
                image = first.decode_sized(source, rng, size, reduce=reduce)  # [C,H,W]
            except BadImage as exc:
                bad.append((position, str(exc)))
                continue
            for op in rest:
                image = op(image, rng, size)
            out[len(kept)] = self._checked(image, out.shape[1:], sample_id)
            kept.append(position)
        return EncodedOutcome(x=out[: len(kept)], kept=kept, bad=bad)

    def _decode_then_apply(
        self, sources: Sequence[EncodedImage], sample_ids: Sequence[int], *, seed: int, epoch: int
    ) -> EncodedOutcome:
        images: list[Image] = []
        kept: list[int] = []
        bad: list[tuple[int, str]] = []
        for position, source in enumerate(sources):
            try:
                images.append(source.pixels())  # [C,h,w]
            except BadImage as exc:
                bad.append((position, str(exc)))
                continue
            kept.append(position)
        ids = [sample_ids[position] for position in kept]
        return EncodedOutcome(x=self.apply(images, ids, seed=seed, epoch=epoch), kept=kept, bad=bad)

    def _ops_to_size(self) -> tuple[Op, ...]:
        """The ops run on each image: a ``resize`` (fit crop) first when there is an output
        size and no sizing op."""
        if self.image_size is not None and not any(op.SIZING for op in self.ops):
            return (Resize("crop"), *self.ops)
        return self.ops

    @staticmethod
    def _checked(image: Image, shape: tuple[int, ...], sample_id: int) -> Image:
        if image.shape != shape:
            raise ValueError(
                f"sample {sample_id}: image of shape {list(image.shape)} after the ops, "
                f"expected {list(shape)} (images of several sizes need image_size)"
            )
        return image

    def to_specs(self) -> list[dict[str, Any]]:
        """The normalised specs (defaults filled in) this augmenter was built from."""
        return [op.to_spec() for op in self.ops]


def build_augmenter(
    specs: Sequence[Mapping[str, Any]], *, image_size: Sequence[int] | None = None
) -> Augmenter:
    """Build an Augmenter from specs like ``{"name": "hflip", "p": 0.5}`` and the output
    ``image_size`` ``(H, W)`` (None: the inputs' size).

    ValueError for an unknown op (listing the known ones), an unknown parameter,
    a parameter of the wrong type or range, more than one sizing op or a bad size.
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
    sizing = [op.NAME for op in ops if op.SIZING]
    if len(sizing) > 1:
        raise ValueError(f"augment: at most one of resize, random_resized_crop, got {sizing}")
    size: Size | None = None
    if image_size is not None:
        if len(image_size) != 2 or not all(
            isinstance(side, int) and 1 <= side <= 4096 for side in image_size
        ):
            raise ValueError(f"image_size must be [H, W] within [1, 4096], got {image_size!r}")
        size = (int(image_size[0]), int(image_size[1]))
    return Augmenter(tuple(ops), size)
