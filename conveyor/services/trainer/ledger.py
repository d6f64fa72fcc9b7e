"""The sample ledger: per epoch, how many times each sample went into a model update.

The exactly-once proof of a job: after it, every train sample's count is 1 in every epoch.
Kept as one int32 count vector per epoch (compact in checkpoints), written at job end as
``{"epochs": {"<epoch>": {"<sample_id>": count}}}`` with only the non-zero counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

_TENSOR_PREFIX = "ledger."


class Ledger:
    """Counts per (epoch, sample id); ids are the dataset's global ids (>= 0)."""

    def __init__(self, num_samples: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self._size = num_samples
        self._counts: dict[int, NDArray[np.int32]] = {}

    @property
    def size(self) -> int:
        """The announced number of samples (ids beyond it grow the counts)."""
        return self._size

    def add(self, epoch: int, sample_ids: Iterable[int]) -> None:
        """Count one update contribution of each id (ids may repeat)."""
        ids = np.fromiter(sample_ids, dtype=np.int64)  # [B]
        if ids.size == 0:
            return
        if int(ids.min()) < 0:
            raise ValueError(f"sample ids must be >= 0, got {int(ids.min())}")
        counts = self._counts.get(epoch)
        needed = max(self._size, int(ids.max()) + 1)
        if counts is None or counts.size < needed:
            grown = np.zeros(needed, dtype=np.int32)
            if counts is not None:
                grown[: counts.size] = counts
            counts = self._counts[epoch] = grown
        np.add.at(counts, ids, 1)

    def counts(self, epoch: int) -> dict[int, int]:
        """{sample id: count} of one epoch, non-zero counts only."""
        counts = self._counts.get(epoch)
        if counts is None:
            return {}
        nonzero = np.flatnonzero(counts)
        return dict(zip(nonzero.tolist(), counts[nonzero].tolist(), strict=True))

    def epochs(self) -> list[int]:
        return sorted(self._counts)

    def to_json(self) -> dict[str, Any]:
        """The ledger.json document."""
        return {
            "epochs": {
                str(epoch): {str(sample): n for sample, n in self.counts(epoch).items()}
                for epoch in self.epochs()
            }
        }

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """``ledger.<epoch>`` -> int32 [num_samples] copies, for a checkpoint."""
        return {
            f"{_TENSOR_PREFIX}{epoch}": torch.from_numpy(counts.copy())
            for epoch, counts in self._counts.items()
        }

    @classmethod
    def from_tensors(cls, num_samples: int, tensors: dict[str, torch.Tensor]) -> Ledger:
        """Rebuild from a checkpoint's tensors (other keys are ignored)."""
        ledger = cls(num_samples)
        for key, tensor in tensors.items():
            if key.startswith(_TENSOR_PREFIX):
                epoch = int(key.removeprefix(_TENSOR_PREFIX))
                ledger._counts[epoch] = tensor.numpy().astype(np.int32, copy=True)
        return ledger
