"""Augmentation: determinism independent of batching, each op's effect, spec validation."""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
import pytest

from conveyor.services.preprocessor.augment import build_augmenter, known_ops


def _images(n: int = 12, shape: tuple[int, int, int] = (3, 8, 8)) -> np.ndarray:
    return np.random.default_rng(1).integers(1, 255, (n, *shape), dtype=np.uint8)


ALL_OPS: list[dict[str, Any]] = [
    {"name": "random_crop", "padding": 2},
    {"name": "hflip"},
    {"name": "noise", "std": 8},
]


def test_same_sample_same_result_whatever_the_batching() -> None:
    augmenter = build_augmenter(ALL_OPS)
    x = _images()
    ids = np.arange(100, 112)
    whole = augmenter.apply(x, ids, seed=5, epoch=2)
    order = [7, 0, 11, 3]
    part = augmenter.apply(x[order], ids[order], seed=5, epoch=2)
    np.testing.assert_array_equal(part, whole[order])
    singles = np.concatenate(
        [augmenter.apply(x[i : i + 1], ids[i : i + 1], seed=5, epoch=2) for i in range(12)]
    )
    np.testing.assert_array_equal(singles, whole)
    unpickled = pickle.loads(pickle.dumps(augmenter))  # what a process pool does
    np.testing.assert_array_equal(unpickled.apply(x, ids, seed=5, epoch=2), whole)
    assert whole.dtype == np.uint8 and whole.shape == x.shape
    np.testing.assert_array_equal(x, _images())  # the input is untouched


def test_seed_epoch_and_sample_id_each_change_the_result() -> None:
    augmenter = build_augmenter(ALL_OPS)
    x = _images()
    ids = np.arange(12)
    base = augmenter.apply(x, ids, seed=5, epoch=0)
    assert not np.array_equal(base, augmenter.apply(x, ids, seed=6, epoch=0))
    assert not np.array_equal(base, augmenter.apply(x, ids, seed=5, epoch=1))
    assert not np.array_equal(base, augmenter.apply(x, ids + 1000, seed=5, epoch=0))
    negative = augmenter.apply(x, ids, seed=-3, epoch=0)  # any int seed works
    np.testing.assert_array_equal(negative, augmenter.apply(x, ids, seed=-3, epoch=0))


def test_hflip_always_and_never() -> None:
    x = _images(4)
    flipped = build_augmenter([{"name": "hflip", "p": 1.0}]).apply(x, range(4), seed=0, epoch=0)
    np.testing.assert_array_equal(flipped, x[:, :, :, ::-1])
    kept = build_augmenter([{"name": "hflip", "p": 0}]).apply(x, range(4), seed=0, epoch=0)
    np.testing.assert_array_equal(kept, x)
    half = build_augmenter([{"name": "hflip"}]).apply(_images(200), range(200), seed=0, epoch=0)
    flips = sum(np.array_equal(h, o[:, :, ::-1]) for h, o in zip(half, _images(200), strict=True))
    assert 60 < flips < 140


def test_random_crop_is_a_zero_padded_shift() -> None:
    x = _images(64, shape=(1, 6, 6))
    out = build_augmenter([{"name": "random_crop", "padding": 2}]).apply(
        x, range(64), seed=1, epoch=0
    )
    shifts = set()
    for src, dst in zip(x, out, strict=True):
        padded = np.pad(src, ((0, 0), (2, 2), (2, 2)))
        matches = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if np.array_equal(padded[:, dy : dy + 6, dx : dx + 6], dst)
        ]
        assert len(matches) == 1
        shifts.add(matches[0])
    assert len(shifts) > 10  # offsets vary across samples


def test_noise_changes_pixels_with_roughly_the_asked_std() -> None:
    x = np.full((8, 1, 16, 16), 128, np.uint8)
    out = build_augmenter([{"name": "noise", "std": 10.0}]).apply(x, range(8), seed=0, epoch=0)
    delta = out.astype(np.float64) - 128
    assert 8.5 < delta.std() < 11.5 and abs(delta.mean()) < 1.5
    clipped = build_augmenter([{"name": "noise", "std": 200}]).apply(x, range(8), seed=0, epoch=0)
    assert clipped.min() == 0 and clipped.max() == 255


def test_cpu_cost_burns_about_the_asked_cpu_time() -> None:
    augmenter = build_augmenter([{"name": "cpu_cost", "ms": 5}])
    x = _images(10)
    start = time.thread_time()
    out = augmenter.apply(x, range(10), seed=0, epoch=0)
    cpu_s = time.thread_time() - start
    assert 0.025 <= cpu_s < 0.5  # asked for 10 x 5 ms
    np.testing.assert_array_equal(out, x)


def test_no_ops_returns_input_and_specs_round_trip() -> None:
    x = _images(2)
    assert build_augmenter([]).apply(x, [0, 1], seed=0, epoch=0) is x
    augmenter = build_augmenter([{"name": "random_crop"}, {"name": "hflip", "p": 0.25}])
    assert augmenter.to_specs() == [
        {"name": "random_crop", "padding": 4},
        {"name": "hflip", "p": 0.25},
    ]
    assert build_augmenter(augmenter.to_specs()) == augmenter
    assert known_ops() == [
        "color_jitter", "cpu_cost", "hflip", "noise", "random_crop", "random_resized_crop",
        "resize",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([{"name": "rotate"}], r"'rotate' \(known: color_jitter, cpu_cost, hflip, noise, rand"),
        ([{"padding": 4}], "unknown op None"),
        ([{"name": "hflip", "prob": 0.5}], r"unknown parameter\(s\) \['prob'\]"),
        ([{"name": "hflip", "p": 1.5}], r"p=1.5 must be in \[0.0, 1.0\]"),
        ([{"name": "noise"}], "needs parameter 'std'"),
        ([{"name": "cpu_cost", "ms": "5"}], "ms must be a number"),
        ([{"name": "random_crop", "padding": 2.5}], "padding must be an integer"),
        ([{"name": "resize"}, {"name": "random_resized_crop"}], "at most one of resize"),
        ([{"name": "resize", "fit": "pad"}], "fit must be crop or stretch"),
        ([{"name": "random_resized_crop", "scale": [0.5, 0.2]}], r"scale=0.2 must be in"),
        ([{"name": "random_resized_crop", "ratio": 2}], r"ratio must be \[low, high\]"),
        ([{"name": "color_jitter", "hue": 0.7}], r"hue=0.7 must be in \[0.0, 0.5\]"),
    ],
)
def test_bad_specs(specs: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_augmenter(specs)


def test_bad_apply_arguments() -> None:
    augmenter = build_augmenter([{"name": "hflip"}])
    with pytest.raises(ValueError, match="2 images but 3 sample ids"):
        augmenter.apply(_images(2), [0, 1, 2], seed=0, epoch=0)
    with pytest.raises(ValueError, match="must be uint8"):
        augmenter.apply(_images(2).astype(np.float32), [0, 1], seed=0, epoch=0)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        augmenter.apply(_images(2), [0, 1], seed=0, epoch=-1)


# --- sizing and colour ops ------------------------------------------------------------------


def _sized_images(sizes: list[tuple[int, int]], channels: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    return [rng.integers(0, 256, (channels, h, w), dtype=np.uint8) for h, w in sizes]


def test_images_of_any_size_reach_the_output_size_deterministically() -> None:
    images = _sized_images([(40, 60), (17, 9), (32, 32), (8, 100)])
    ops: list[dict[str, Any]]
    ops = [{"name": "random_resized_crop", "scale": [0.3, 1.0]}, {"name": "hflip"},
           {"name": "color_jitter", "brightness": 0.4, "contrast": 0.4, "saturation": 0.4,
            "hue": 0.1}]  # fmt: skip
    augmenter = build_augmenter(ops, image_size=(16, 24))
    ids = np.array([7, 1, 90, 3])
    out = augmenter.apply(images, ids, seed=3, epoch=1)
    assert out.shape == (4, 3, 16, 24) and out.dtype == np.uint8
    # A redelivered shard, or the same sample in another batch, gives the same bytes.
    np.testing.assert_array_equal(augmenter.apply(images, ids, seed=3, epoch=1), out)
    np.testing.assert_array_equal(augmenter.apply(images[2:3], ids[2:3], seed=3, epoch=1), out[2:3])
    assert not np.array_equal(augmenter.apply(images, ids, seed=3, epoch=2), out)
    # Evaluation: deterministic, whatever the seed and epoch, equal to a plain resize (fit crop).
    evaluation = augmenter.for_eval()
    assert evaluation.to_specs() == [{"name": "resize", "fit": "crop"}]
    a = evaluation.apply(images, ids, seed=3, epoch=1)
    np.testing.assert_array_equal(a, evaluation.apply(images, ids, seed=9, epoch=5))
    resized = build_augmenter([], image_size=(16, 24)).apply(images, ids, seed=0, epoch=0)
    np.testing.assert_array_equal(a, resized)


def test_resize_fit_crop_keeps_the_centre_and_stretch_keeps_everything() -> None:
    image = np.zeros((1, 20, 40), dtype=np.uint8)
    image[:, :, :5] = 255  # a white left eighth
    crop = build_augmenter([{"name": "resize"}], image_size=(10, 10))
    centre = crop.apply([image], [0], seed=0, epoch=0)[0]
    assert centre.shape == (1, 10, 10) and int(centre.max()) == 0  # the centre is black
    stretch = build_augmenter([{"name": "resize", "fit": "stretch"}], image_size=(10, 20))
    whole = stretch.apply([image], [0], seed=0, epoch=0)[0]
    assert int(whole[0, 5, 0]) == 255 and int(whole[0, 5, -1]) == 0
    same = build_augmenter([{"name": "resize"}]).apply(_images(2), [0, 1], seed=0, epoch=0)
    np.testing.assert_array_equal(same, _images(2))  # already the size: untouched


def test_random_resized_crop_of_a_constant_image_is_constant() -> None:
    image = np.full((3, 50, 70), 77, dtype=np.uint8)
    augmenter = build_augmenter([{"name": "random_resized_crop"}], image_size=(8, 8))
    out = augmenter.apply([image] * 5, range(5), seed=0, epoch=0)
    assert out.shape == (5, 3, 8, 8) and set(np.unique(out).tolist()) == {77}


def test_color_jitter_factors() -> None:
    gray = np.full((3, 4, 4), 100, dtype=np.uint8)
    bright = build_augmenter([{"name": "color_jitter", "brightness": 0.5}])
    values = {int(bright.apply(gray[None], [i], seed=0, epoch=0)[0, 0, 0, 0]) for i in range(20)}
    assert min(values) >= 50 and max(values) <= 150 and len(values) > 5
    hue = build_augmenter([{"name": "color_jitter", "saturation": 1.0, "hue": 0.5}])
    np.testing.assert_array_equal(hue.apply(gray[None], [0], seed=0, epoch=0)[0], gray)  # no colour
    one_channel = np.full((1, 1, 4, 4), 100, dtype=np.uint8)
    np.testing.assert_array_equal(hue.apply(one_channel, [0], seed=0, epoch=0), one_channel)
    red = np.zeros((1, 3, 2, 2), dtype=np.uint8)
    red[:, 0] = 200
    turned = build_augmenter([{"name": "color_jitter", "hue": 0.5}]).apply(
        red, [1], seed=0, epoch=0
    )
    assert not np.array_equal(turned, red)


def test_images_of_several_sizes_need_an_output_size() -> None:
    images = _sized_images([(10, 12), (11, 12)])
    with pytest.raises(ValueError, match="need image_size"):
        build_augmenter([{"name": "hflip"}]).apply(images, [0, 1], seed=0, epoch=0)
    with pytest.raises(ValueError, match=r"image_size must be \[H, W\]"):
        build_augmenter([], image_size=(0, 5))


def test_the_eval_fit_box_stays_inside_images_where_floats_round_up() -> None:
    """A 392x392 image fitted to 64x64: height / (height / h) rounds to a hair over 392, and
    Pillow refused the box ("box offset can't be negative"), failing evaluation shards."""
    from conveyor.services.preprocessor.image_ops import center_fit_box

    for h, w in [(392, 392), (392, 400), (257, 391)]:
        left, top, right, bottom = center_fit_box((h, w), (64, 64))
        assert left >= 0 and top >= 0 and right <= w and bottom <= h
    image = np.random.default_rng(0).integers(0, 256, (4, 3, 392, 392), dtype=np.uint8)
    augment = [{"name": "random_resized_crop"}, {"name": "hflip"}]
    sized = build_augmenter(augment, image_size=(64, 64)).for_eval()
    assert sized.apply(list(image), range(4), seed=0, epoch=0).shape == (4, 3, 64, 64)
