"""The sample ledger: counting, and its two lossless forms (ledger.json, checkpoint arrays)."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest

from conveyor.training.ledger import LEDGER_FORMAT, Ledger


def sample_ledger() -> Ledger:
    ledger = Ledger(10)
    ledger.add(0, [3, 1, 4])
    ledger.add(0, np.array([1, 5], dtype=np.int32))  # 1 again: counted twice
    ledger.add(2, [9, 9, 0])  # an id repeated within one update counts each time
    return ledger


def test_counts_each_id_each_time_per_epoch() -> None:
    ledger = sample_ledger()
    assert ledger.epochs() == [0, 2]
    assert ledger.counts(0) == {1: 2, 3: 1, 4: 1, 5: 1}
    assert ledger.counts(2) == {0: 1, 9: 2}
    assert ledger.counts(1) == {} and ledger.total(1) == 0
    assert (ledger.total(0), ledger.total(2)) == (5, 3)
    ledger.add(1, [])  # nothing computed: no epoch appears
    assert ledger.epochs() == [0, 2]


@pytest.mark.parametrize(
    ("epoch", "ids", "reason"),
    [
        (0, [0, 10], r"in \[0, 10\), got 0\.\.10"),
        (0, [-1], r"in \[0, 10\)"),
        (-1, [0], "epoch must be >= 0"),
        (0, [[1, 2]], "one-dimensional"),
    ],
)
def test_out_of_range_adds_count_nothing(epoch: int, ids: Any, reason: str) -> None:
    ledger = sample_ledger()
    before = ledger.to_json()
    with pytest.raises(ValueError, match=reason):
        ledger.add(epoch, ids)
    assert ledger.to_json() == before
    with pytest.raises(ValueError, match="num_samples"):
        Ledger(0)


def test_json_document_is_lossless() -> None:
    ledger = sample_ledger()
    document = ledger.to_json()
    assert document == {
        "format": LEDGER_FORMAT,
        "num_samples": 10,
        "epochs": {
            "0": {"1": 2, "3": 1, "4": 1, "5": 1},
            "2": {"0": 1, "9": 2},
        },
    }
    restored = Ledger.from_json(json.loads(json.dumps(document)))  # through real JSON text
    assert restored == ledger and restored.to_json() == document
    assert Ledger.from_json(Ledger(3).to_json()) == Ledger(3)
    assert restored != Ledger(10) and Ledger(10) != Ledger(11)
    restored.add(2, [9])
    assert restored != ledger  # a count differs


@pytest.mark.parametrize(
    "document",
    [
        {"epochs": {}},  # the plan-derived format 1 had no format key
        {"format": 2, "num_samples": "10", "epochs": {}},
        {"format": 2, "num_samples": 10, "epochs": []},
        {"format": 2, "num_samples": 10, "epochs": {"0": {"10": 1}}},  # id out of range
        {"format": 2, "num_samples": 10, "epochs": {"0": {"1": 0}}},  # zero counts are absent
        {"format": 2, "num_samples": 10, "epochs": {"0": {"1": 1.5}}},
        {"format": 2, "num_samples": 10, "epochs": {"-1": {"1": 1}}},
        {"format": 2, "num_samples": 10, "epochs": {"0": {"x": 1}}},
        {"format": 2, "num_samples": 10, "epochs": {"0": [1]}},
    ],
)
def test_malformed_json_documents_are_refused(document: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Ledger.from_json(document)


def test_arrays_are_lossless_and_copies() -> None:
    ledger = sample_ledger()
    arrays = ledger.to_arrays()
    assert arrays["epochs"].tolist() == [0, 2] and arrays["epochs"].dtype == np.int32
    assert arrays["counts"].shape == (2, 10) and arrays["counts"].dtype == np.int32
    assert arrays["counts"][0].tolist() == [0, 2, 0, 1, 1, 1, 0, 0, 0, 0]
    restored = Ledger.from_arrays(arrays)
    assert restored == ledger
    arrays["counts"][0, 1] = 7  # the snapshot is a copy, and so is the restored ledger
    assert ledger.counts(0)[1] == 2 and restored.counts(0)[1] == 2
    ledger.add(0, [1])
    assert restored.counts(0)[1] == 2
    # Through an .npz file, as a checkpoint might store it.
    buffer = io.BytesIO()
    saved = ledger.to_arrays()
    np.savez(buffer, epochs=saved["epochs"], counts=saved["counts"])
    buffer.seek(0)
    with np.load(buffer) as stored:
        assert Ledger.from_arrays(stored) == ledger
    # An empty ledger keeps its size; wider dtypes are accepted.
    empty = Ledger(4).to_arrays()
    assert empty["counts"].shape == (0, 4)
    assert Ledger.from_arrays(empty) == Ledger(4)
    wide = {"epochs": np.array([3], dtype=np.int64), "counts": np.ones((1, 4), dtype=np.int64)}
    assert Ledger.from_arrays(wide).counts(3) == {0: 1, 1: 1, 2: 1, 3: 1}


@pytest.mark.parametrize(
    ("epochs", "counts", "reason"),
    [
        ([0, 1], np.zeros((1, 4)), "shapes"),
        ([0], np.zeros(4), "shapes"),
        ([0], np.zeros((1, 4), dtype=np.float32), "integers"),
        ([0, 0], np.zeros((2, 4)), "distinct"),
        ([-1], np.zeros((1, 4)), "distinct"),
        ([0], np.full((1, 4), -1), r"counts must be in"),
    ],
)
def test_malformed_arrays_are_refused(epochs: list[int], counts: Any, reason: str) -> None:
    arrays = {"epochs": np.asarray(epochs), "counts": np.asarray(counts)}
    if arrays["counts"].dtype.kind == "f" and reason != "integers":
        arrays["counts"] = arrays["counts"].astype(np.int64)
    with pytest.raises(ValueError, match=reason):
        Ledger.from_arrays(arrays)
