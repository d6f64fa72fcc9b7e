"""Image files decoded straight to the output size: a JPEG at the DCT scale its crop needs, the
same random draws as the ops on full pixels, and a file that fails to decode left out."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor.services.preprocessor.augment import build_augmenter
from conveyor.services.preprocessor.image_ops import resize_region
from conveyor.training.datasets.images import (
    BadImage,
    EncodedImage,
    decode_image,
    encode_jpeg,
    encode_png,
)

SIZE = (64, 64)


def photo(height: int, width: int, seed: int) -> bytes:
    """A smooth RGB JPEG (gradients and a blob), like a photo to a DCT."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    cy, cx = rng.uniform(0.3, 0.7, 2) * (height, width)
    blob = 120 * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (0.05 * height * width))
    channels = [(x / width) * 200 + blob, (y / height) * 180, 255 - blob - (x / width) * 60]
    pixels = np.clip(np.stack(channels), 0, 255).astype(np.uint8)  # [3,h,w]
    return encode_jpeg(pixels, quality=92)


def test_a_large_region_decodes_at_a_reduced_scale_close_to_the_full_decode() -> None:
    data = photo(384, 320, seed=1)
    image = EncodedImage.parse(data, channels=3)
    assert (image.height, image.width) == (384, 320)
    box = (16.0, 40.0, 304.0, 360.0)  # 288 x 320: a quarter-scale decode still covers 64 x 64
    reduced = image.region(SIZE, box)
    full = image.region(SIZE, box, reduce=False)
    assert reduced.shape == full.shape == (3, *SIZE) and reduced.dtype == np.uint8
    # Decoded at 1/4 the pixels differ from the full decode's, by little.
    difference = np.abs(reduced.astype(np.int16) - full.astype(np.int16))
    assert difference.max() > 0
    assert difference.mean() < 2.0
    # The full decode is the whole image resized, as before: decode, then crop and resize.
    whole = decode_image(data, channels=3)
    np.testing.assert_array_equal(full, resize_region(whole, SIZE, box))


def test_a_region_too_small_to_reduce_is_the_full_decode() -> None:
    image = EncodedImage.parse(photo(300, 280, seed=2), channels=3)
    box = (10.0, 20.0, 130.0, 120.0)  # 120 x 100: half of it is under 64 rows
    np.testing.assert_array_equal(image.region(SIZE, box), image.region(SIZE, box, reduce=False))


def test_grayscale_and_png_regions() -> None:
    gray = EncodedImage.parse(photo(256, 256, seed=3), channels=1)
    assert gray.region(SIZE).shape == (1, *SIZE)
    png = encode_png(decode_image(photo(256, 256, seed=3), channels=3))
    image = EncodedImage.parse(png, channels=3)
    np.testing.assert_array_equal(image.region(SIZE), image.region(SIZE, reduce=False))


@pytest.mark.parametrize(
    "ops",
    [
        [{"name": "random_resized_crop"}, {"name": "hflip"}],
        [],  # the implicit resize (fit crop)
        [{"name": "hflip"}, {"name": "random_resized_crop"}],  # not first: decoded whole
    ],
)
def test_encoded_images_get_the_same_draws_as_decoded_ones(ops: list[dict[str, object]]) -> None:
    augmenter = build_augmenter(ops, image_size=SIZE)
    files = [photo(256 + 24 * i, 400 - 30 * i, seed=i) for i in range(5)]
    sources = [EncodedImage.parse(f, channels=3) for f in files]
    ids = [40, 3, 17, 8, 22]
    expected = augmenter.apply(
        [decode_image(f, channels=3) for f in files], ids, seed=5, epoch=2
    )  # [5,3,64,64]
    whole = augmenter.apply_encoded(sources, ids, seed=5, epoch=2, reduce=False)
    assert whole.kept == [0, 1, 2, 3, 4] and whole.bad == []
    np.testing.assert_array_equal(whole.x, expected)
    reduced = augmenter.apply_encoded(sources, ids, seed=5, epoch=2)
    assert reduced.x.shape == expected.shape
    difference = np.abs(reduced.x.astype(np.int16) - expected.astype(np.int16))
    assert difference.mean() < 2.0  # the same crops and flips, at most a DCT scale apart


def test_a_file_that_does_not_decode_is_left_out_with_its_reason() -> None:
    augmenter = build_augmenter([{"name": "random_resized_crop"}], image_size=SIZE)
    good = photo(300, 300, seed=7)
    torn = good[: len(good) // 3]  # the header parses, the scan data stops
    sources = [EncodedImage.parse(f, channels=3) for f in (good, torn, good)]
    outcome = augmenter.apply_encoded(sources, [0, 1, 2], seed=0, epoch=0)
    assert outcome.kept == [0, 2] and outcome.x.shape == (2, 3, *SIZE)
    [(position, reason)] = outcome.bad
    assert position == 1 and reason.startswith("corrupt image")
    np.testing.assert_array_equal(
        outcome.x[1], augmenter.apply_encoded(sources[2:], [2], seed=0, epoch=0).x[0]
    )
    with pytest.raises(BadImage, match="not a JPEG/PNG image"):
        EncodedImage.parse(b"plain text", channels=3)
