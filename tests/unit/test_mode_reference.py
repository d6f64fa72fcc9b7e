"""The harder real-image task (distorted digits) and the in-process references of the modes
that bench_mode_accuracy.py compares on it: deterministic data, and references that agree
where the modes must (sync = plain torch; ssp with one trainer = sync with one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from conveyor.training.plan import split_ids
from loadtests.bench_mode_accuracy import job_spec, summary
from loadtests.distorted_digits import distorted_digits
from loadtests.mode_reference import Arrays, reference_accuracy


@pytest.fixture(scope="module")
def data() -> Arrays:
    """640 of the plain 8x8 digits: a tiny model learns them in a few dozen steps."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.round(digits.images[:640] * (255.0 / 16.0)).astype(np.uint8)  # [N, 8, 8]
    return Arrays(x[:, None], digits.target[:640].astype(np.int64))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reproducible float sums
    yield
    torch.set_num_threads(threads)


def tiny(system: str, **distribution: Any) -> dict[str, Any]:
    spec = job_spec(1, 2, system)
    spec["model"]["channels"] = [8, 16]
    spec["training"].update(global_batch_size=16, micro_batch_size=8)  # 32 steps an epoch
    spec["distribution"].update(distribution)
    return spec


def test_distorted_digits_are_reproducible_and_cover_every_class_in_both_splits() -> None:
    x, y = distorted_digits(200, size=16, seed=3, eval_fraction=0.25)
    again, labels = distorted_digits(200, size=16, seed=3, eval_fraction=0.25)
    assert x.shape == (200, 16, 16) and x.dtype == np.uint8 and y.dtype == np.int64
    assert np.array_equal(x, again) and np.array_equal(y, labels)
    other, _ = distorted_digits(200, size=16, seed=4, eval_fraction=0.25)
    assert not np.array_equal(x, other)
    train_ids, eval_ids = split_ids(200, 0.25, 3)
    assert set(y[train_ids].tolist()) == set(range(10))
    assert set(y[eval_ids].tolist()) == set(range(10))
    with pytest.raises(ValueError, match="size must be >= 8"):
        distorted_digits(10, size=7, seed=0, eval_fraction=0.2)


def test_the_sync_reference_trains_as_plain_torch(data: Arrays) -> None:
    plain = reference_accuracy(tiny("plain"), data, plain=True)
    sync = reference_accuracy(tiny("sync"), data)
    assert sync == pytest.approx(plain, abs=1 / 128)  # at most one of the 128 eval samples
    assert plain > 0.2  # it learned (0.29 here): 10 classes, chance is 0.1


def test_ssp_with_one_trainer_is_sync_with_one(data: Arrays) -> None:
    # One trainer never computes on an old version: every ssp step is fresh and whole.
    sync = reference_accuracy(tiny("sync", trainers=1), data)
    ssp = reference_accuracy(tiny("ssp", trainers=1), data, speeds=(1.0,))
    assert ssp == sync


def test_summary_gives_each_mode_its_points_behind_sync() -> None:
    line = summary({"sync": [0.90, 0.92], "plain": [0.91], "ssp": [0.87, 0.89]})
    assert line["sync"] == 0.91 and line["ssp"] == 0.88
    assert line["ssp_delta_vs_sync"] == 3.0
    assert "plain_delta_vs_sync" not in line
