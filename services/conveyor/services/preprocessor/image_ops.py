"""Geometric and colour operations on one uint8 ``[C, h, w]`` image (C 1 or 3), with Pillow.

Pure functions: the random draws are the caller's (``augment.py`` passes each sample's own
generator), so the same draws give the same pixels. Resampling is Pillow's bilinear filter,
which low-passes when it shrinks (what torchvision's PIL path does).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray
from PIL import Image

Pixels = NDArray[np.uint8]
"""One image ``[C, h, w]``."""
Box = tuple[float, float, float, float]
"""A source region ``(left, top, right, bottom)`` in pixels."""

_GRAY_WEIGHTS = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2, as Pillow's L


def to_pil(pixels: Pixels) -> Image.Image:
    """``[C,h,w]`` -> a Pillow image of mode L (C 1) or RGB (C 3)."""
    hwc = pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)
    return Image.fromarray(np.ascontiguousarray(hwc))


def from_pil(image: Image.Image) -> Pixels:
    """A Pillow image of mode L or RGB -> ``[C,h,w]``."""
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[None] if pixels.ndim == 2 else np.ascontiguousarray(pixels.transpose(2, 0, 1))


def resize_region(pixels: Pixels, size: tuple[int, int], box: Box | None = None) -> Pixels:
    """Scale the ``box`` region (the whole image when None) to ``size`` ``(H, W)``."""
    height, width = size
    if box is None and pixels.shape[1:] == size:
        return pixels
    resized = to_pil(pixels).resize((width, height), Image.Resampling.BILINEAR, box=box)
    return from_pil(resized)


def center_fit_box(image_hw: tuple[int, int], size: tuple[int, int]) -> Box:
    """The centred region of an ``image_hw`` image with the aspect ratio of ``size``: scaled
    to ``size`` it fills it, cutting what overflows (resize the shorter side, crop the centre)."""
    h, w = image_hw
    height, width = size
    scale = max(height / h, width / w)
    # height / (height / h) can round to a hair over h (392 -> 392.00000000000006 for 64):
    # Pillow refuses a box that leaves the image, so the box is kept inside it.
    box_h, box_w = min(h, height / scale), min(w, width / scale)
    top, left = (h - box_h) / 2, (w - box_w) / 2
    return (left, top, left + box_w, top + box_h)


def random_resized_box(
    image_hw: tuple[int, int],
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: np.random.Generator,
) -> Box:
    """torchvision's RandomResizedCrop choice: up to 10 tries of an area share in ``scale``
    and a log-uniform aspect ratio in ``ratio`` that fits; else the centre crop nearest to
    ``ratio``."""
    h, w = image_hw
    area = h * w
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_low, log_high))
        crop_w = round(math.sqrt(target * aspect))
        crop_h = round(math.sqrt(target / aspect))
        if 0 < crop_w <= w and 0 < crop_h <= h:
            top = int(rng.integers(0, h - crop_h + 1))
            left = int(rng.integers(0, w - crop_w + 1))
            return (left, top, left + crop_w, top + crop_h)
    in_ratio = w / h
    if in_ratio < ratio[0]:
        crop_w, crop_h = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        crop_w, crop_h = round(h * ratio[1]), h
    else:
        crop_w, crop_h = w, h
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    return (left, top, left + crop_w, top + crop_h)


def _gray(image: NDArray[np.float32]) -> NDArray[np.float32]:
    """Luma ``[1,h,w]`` of a float ``[C,h,w]`` image."""
    if image.shape[0] == 1:
        return image
    gray: NDArray[np.float32] = np.tensordot(_GRAY_WEIGHTS, image, axes=1)[None]
    return gray


def color_jitter(
    pixels: Pixels, brightness: float, contrast: float, saturation: float, hue: float
) -> Pixels:
    """Scale brightness by ``brightness``, contrast (about the mean luma) by ``contrast``,
    saturation (about the pixel's luma) by ``saturation`` (factors; 1 = unchanged), then turn
    the hue by ``hue`` of a full turn; clipped to 0..255 after each step, like torchvision.
    Saturation and hue leave a one-channel image alone."""
    image = pixels.astype(np.float32)  # [C,h,w]
    if brightness != 1.0:
        image = np.clip(image * brightness, 0.0, 255.0)
    if contrast != 1.0:
        mean = float(_gray(image).mean())
        image = np.clip((image - mean) * contrast + mean, 0.0, 255.0)
    if saturation != 1.0 and image.shape[0] == 3:
        gray = _gray(image)
        image = np.clip((image - gray) * saturation + gray, 0.0, 255.0)
    out = np.rint(image).astype(np.uint8)
    if hue != 0.0 and out.shape[0] == 3:
        hsv = np.array(to_pil(out).convert("HSV"))  # [h,w,3] uint8
        shift = round(hue * 255)
        hsv[..., 0] = (hsv[..., 0].astype(np.int16) + shift) % 256
        height, width = hsv.shape[:2]
        out = from_pil(Image.frombytes("HSV", (width, height), hsv.tobytes()).convert("RGB"))
    return out
