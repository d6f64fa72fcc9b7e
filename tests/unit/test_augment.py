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
    assert known_ops() == ["cpu_cost", "hflip", "noise", "random_crop"]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([{"name": "rotate"}], r"'rotate' \(known: cpu_cost, hflip, noise, random_crop\)"),
        ([{"padding": 4}], "unknown op None"),
        ([{"name": "hflip", "prob": 0.5}], r"unknown parameter\(s\) \['prob'\]"),
        ([{"name": "hflip", "p": 1.5}], r"p=1.5 must be in \[0.0, 1.0\]"),
        ([{"name": "noise"}], "needs parameter 'std'"),
        ([{"name": "cpu_cost", "ms": "5"}], "ms must be a number"),
        ([{"name": "random_crop", "padding": 2.5}], "padding must be an integer"),
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
