"""The sample ledger: how many times each sample went into an applied model update, per epoch.

The aggregator's coordinator builds it from what the trainers say they computed on: the
``sample_ids`` of every :class:`~conveyor.platform.messages.Contribution` a ``StepClose``
applies, counted under the contribution's ``epoch``. Nothing in it comes from the plan, so a
sample whose gradient went into the model twice counts 2 and one that never did is absent:
comparing the ledger with the plan (every train sample exactly once per epoch, no eval sample,
nothing else) checks the exactly-once effect instead of restating it.

A ledger has two lossless forms: the ``ledger.json`` document (:meth:`Ledger.to_json`,
:meth:`Ledger.from_json`) and two arrays for checkpoints (:meth:`Ledger.to_arrays`,
:meth:`Ledger.from_arrays`). Counts are dense ``int32`` arrays of the dataset's size, one per
epoch that has a count: 4 bytes per sample and epoch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

LEDGER_FORMAT = 2
"""Version of the ``ledger.json`` layout. 2: counts come from the trainers' computed sample
ids, and the document names ``num_samples`` (1: counts derived from the plan's batch ids)."""

Counts = NDArray[np.int32]


class Ledger:
    """Counts per (epoch, sample id) over a dataset of ``num_samples`` samples (ids in
    ``[0, num_samples)``). Not thread-safe."""

    def __init__(self, num_samples: int) -> None:
        """ValueError unless ``num_samples >= 1``."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self._counts: dict[int, Counts] = {}  # epoch -> int32 [num_samples]

    def add(self, epoch: int, sample_ids: NDArray[np.integer[Any]] | Sequence[int]) -> None:
        """Count one more update for each id (an id repeated in ``sample_ids`` counts each
        time). ValueError for a negative epoch or an id outside ``[0, num_samples)``; nothing
        is counted then."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        ids = np.asarray(sample_ids, dtype=np.int64)  # [S]
        if ids.ndim != 1:
            raise ValueError(f"sample ids must be one-dimensional, got shape {ids.shape}")
        if ids.size == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_samples:
            raise ValueError(f"sample ids must be in [0, {self.num_samples}), got {low}..{high}")
        counts = self._counts.get(epoch)
        if counts is None:
            counts = self._counts[epoch] = np.zeros(self.num_samples, dtype=np.int32)
        np.add.at(counts, ids, 1)

    def epochs(self) -> list[int]:
        """Epochs with counts, ascending."""
        return sorted(self._counts)

    def counts(self, epoch: int) -> dict[int, int]:
        """{sample id: count} of one epoch, non-zero counts only (empty for an epoch without
        counts)."""
        counts = self._counts.get(epoch)
        if counts is None:
            return {}
        nonzero = np.flatnonzero(counts)
        return dict(zip(nonzero.tolist(), counts[nonzero].tolist(), strict=True))

    def total(self, epoch: int) -> int:
        """Sum of the counts of one epoch: the samples of its applied updates."""
        counts = self._counts.get(epoch)
        return 0 if counts is None else int(counts.sum(dtype=np.int64))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        return (
            self.num_samples == other.num_samples
            and self.epochs() == other.epochs()
            and all(np.array_equal(self._counts[e], other._counts[e]) for e in self._counts)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        totals = {epoch: self.total(epoch) for epoch in self.epochs()}
        return f"Ledger(num_samples={self.num_samples}, totals={totals})"

    # -- the ledger.json document ----------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The ``ledger.json`` document: ``{"format": 2, "num_samples": N, "epochs":
        {"<epoch>": {"<sample id>": count}}}`` (non-zero counts only)."""
        return {
            "format": LEDGER_FORMAT,
            "num_samples": self.num_samples,
            "epochs": {
                str(epoch): {str(sample): n for sample, n in self.counts(epoch).items()}
                for epoch in self.epochs()
            },
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Ledger:
        """The ledger :meth:`to_json` wrote. ValueError for another format or a malformed
        document (keys that are not ids in range, counts that are not positive ints)."""
        if document.get("format") != LEDGER_FORMAT:
            raise ValueError(f"ledger format {document.get('format')!r}, supported: 2")
        num_samples, epochs = document.get("num_samples"), document.get("epochs")
        if type(num_samples) is not int or not isinstance(epochs, Mapping):
            raise ValueError("a ledger needs an int num_samples and an epochs mapping")
        ledger = cls(num_samples)
        for epoch_key, samples in epochs.items():
            if not isinstance(samples, Mapping):
                raise ValueError(f"epoch {epoch_key!r}: counts must be a mapping")
            counts = np.zeros(num_samples, dtype=np.int32)
            for sample_key, n in samples.items():
                sample = _index(sample_key, "sample id")
                if sample >= num_samples or type(n) is not int or not 0 < n < 2**31:
                    raise ValueError(f"epoch {epoch_key!r}: bad count {sample_key!r}: {n!r}")
                counts[sample] = n
            ledger._counts[_index(epoch_key, "epoch")] = counts
        return ledger

    # -- arrays, for checkpoints -----------------------------------------------------------

    def to_arrays(self) -> dict[str, Counts]:
        """``{"epochs": int32 [E], "counts": int32 [E, num_samples]}``: the epochs with counts
        (ascending) and each one's counts, copies. Lossless (:meth:`from_arrays`), also for
        an empty ledger (``counts`` is then ``[0, num_samples]``)."""
        epochs = self.epochs()
        counts = np.zeros((len(epochs), self.num_samples), dtype=np.int32)
        for row, epoch in enumerate(epochs):
            counts[row] = self._counts[epoch]
        return {"epochs": np.asarray(epochs, dtype=np.int32), "counts": counts}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, NDArray[Any]]) -> Ledger:
        """The ledger :meth:`to_arrays` gave (any integer dtypes; copied). ValueError when the
        shapes do not fit, an epoch repeats or is negative, or a count is negative."""
        epochs, counts = np.asarray(arrays["epochs"]), np.asarray(arrays["counts"])
        if epochs.ndim != 1 or counts.ndim != 2 or counts.shape[0] != epochs.shape[0]:
            raise ValueError(f"epochs [E] and counts [E, N] expected, got shapes "
                             f"{epochs.shape} and {counts.shape}")  # fmt: skip
        for name, array in (("epochs", epochs), ("counts", counts)):
            if not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"{name} must be integers, got {array.dtype}")
        if len(set(epochs.tolist())) != epochs.size or (epochs.size and int(epochs.min()) < 0):
            raise ValueError(f"epochs must be distinct and >= 0, got {epochs.tolist()}")
        if counts.size and not 0 <= int(counts.min()) <= int(counts.max()) < 2**31:
            raise ValueError("counts must be in [0, 2**31)")
        ledger = cls(int(counts.shape[1]))
        for epoch, row in zip(epochs.tolist(), counts, strict=True):
            ledger._counts[int(epoch)] = row.astype(np.int32, copy=True)
        return ledger


def _index(key: object, what: str) -> int:
    """A non-negative int from a JSON key (a decimal string); ValueError otherwise."""
    if not isinstance(key, str) or not (key.isascii() and key.isdigit()):
        raise ValueError(f"{what} {key!r} is not a non-negative integer")
    return int(key)
