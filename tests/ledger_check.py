"""The exactly-once check: a job's sample ledger against its plan, the plan computed here.

The ledger (``jobs/<id>/ledger.json``) counts the sample ids the trainers computed on in every
applied contribution; nothing in it comes from the plan. The plan's train split is written
here from the job contract, not imported from the sharder, so a wrong plan fails too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

LEDGER_FORMAT = 2
"""The ledger.json layout whose counts come from the trainers' computed sample ids."""


def train_split(num_samples: int, eval_fraction: float, seed: int) -> set[int]:
    """The train ids the job contract promises: the first ``floor(N * eval_fraction)`` ids of
    ``default_rng(seed).permutation(N)`` are the eval set, the rest are trained."""
    permutation = np.random.default_rng(seed).permutation(num_samples)
    return {int(i) for i in permutation[int(num_samples * eval_fraction) :]}


def assert_exactly_once(ledger: Mapping[str, Any], train_ids: set[int], epochs: int) -> None:
    """Every train sample went into exactly one applied update in each of ``epochs`` epochs,
    and nothing else did (no eval sample, no other id). The AssertionError names the first
    epoch that fails and its sample ids: missing ones, then ones outside the train split, then
    repeated ones as ``{sample: count}`` in id order."""
    assert ledger.get("format") == LEDGER_FORMAT, f"not a ledger of computed samples: {ledger}"
    assert sorted(ledger["epochs"], key=int) == [str(e) for e in range(epochs)], (
        f"epochs {sorted(ledger['epochs'], key=int)}, expected 0..{epochs - 1}"
    )
    for epoch in range(epochs):
        counts = {int(sample): n for sample, n in ledger["epochs"][str(epoch)].items()}
        missing = sorted(train_ids - counts.keys())
        extra = sorted(counts.keys() - train_ids)
        repeated = {sample: n for sample, n in sorted(counts.items()) if n != 1}
        assert not missing, (
            f"epoch {epoch}: {len(missing)} train samples never trained: {missing[:10]}"
        )
        assert not extra, f"epoch {epoch}: samples outside the train split trained: {extra[:10]}"
        assert not repeated, f"epoch {epoch}: samples trained more than once: {repeated}"
