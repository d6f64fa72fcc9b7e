"""Decoding encoded images (JPEG, PNG) into uint8 arrays, strictly and with bounded size.

Pillow decodes; only the formats listed in :data:`IMAGE_FORMATS` are accepted (a file whose
bytes are something else is a bad sample, whatever its name says), and an image of more than
:data:`MAX_IMAGE_PIXELS` pixels is refused before it is decoded (decompression bombs).
Truncated or corrupt data raises :class:`BadImage` with Pillow's reason.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError

IMAGE_FORMATS = frozenset({"JPEG", "PNG"})
"""Pillow format names accepted."""
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
"""File name endings of image files (compared in lower case)."""
MAX_IMAGE_PIXELS = 64 * 2**20
"""Largest width * height decoded (64 Mpx; a 8k x 8k photo)."""
CHANNEL_MODES = {1: "L", 3: "RGB"}
"""Channels of the decoded array -> the Pillow mode images are converted to."""


class BadImage(ValueError):
    """The bytes are not a decodable JPEG/PNG image within the limits; ``str()`` says why."""


def decode_image(data: bytes, *, channels: int) -> NDArray[np.uint8]:
    """Decode ``data`` to uint8 ``[C, h, w]`` with ``C = channels`` (1: grayscale, 3: RGB),
    converting from the stored mode (palette, alpha, 16-bit...). BadImage otherwise."""
    mode = CHANNEL_MODES.get(channels)
    if mode is None:
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=sorted(IMAGE_FORMATS)) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise BadImage(
                        f"image of {width}x{height} pixels exceeds {MAX_IMAGE_PIXELS} pixels"
                    )
                image.load()
                converted = image if image.mode == mode else image.convert(mode)
                pixels = np.asarray(converted, dtype=np.uint8)  # [h,w] or [h,w,3]
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(f"not a {'/'.join(sorted(IMAGE_FORMATS))} image") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImage(f"corrupt image: {exc}") from None
    except Image.DecompressionBombWarning as exc:
        raise BadImage(f"image too large: {exc}") from None
    if pixels.ndim == 2:
        return pixels[None]  # [1,h,w]
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))  # [3,h,w]


def encode_png(pixels: NDArray[np.uint8]) -> bytes:
    """PNG bytes of uint8 ``[C, H, W]`` (C 1 or 3) pixels; for tests and packing."""
    return _encode(pixels, "PNG")


def encode_jpeg(pixels: NDArray[np.uint8], *, quality: int = 90) -> bytes:
    """JPEG bytes of uint8 ``[C, H, W]`` (C 1 or 3) pixels."""
    return _encode(pixels, "JPEG", quality=quality)


def _encode(pixels: NDArray[np.uint8], image_format: str, **options: int) -> bytes:
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[0] not in CHANNEL_MODES:
        raise ValueError(f"pixels must be uint8 [C,H,W] with C 1 or 3, got {pixels.dtype} "
                         f"{pixels.shape}")  # fmt: skip
    hwc = pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(hwc)).save(buffer, format=image_format, **options)
    return buffer.getvalue()
