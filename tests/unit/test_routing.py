"""Throughput-weighted routing: partition weights from the members, the weighted choice."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter

import pytest

from conveyor.training.routing import choose_partition, partition_weights


def test_weights_split_each_member_rate_over_its_partitions() -> None:
    # 3:1 throughput, two partitions each: 3/8 on each fast partition, 1/8 on each slow one.
    weights = partition_weights([(300.0, [0, 1]), (100.0, [2, 3])], 4)
    assert weights == pytest.approx([0.375, 0.375, 0.125, 0.125])
    # Uneven ownership: a member's rate is spread over what it owns (not per partition).
    weights = partition_weights([(100.0, [0, 1, 2]), (100.0, [3])], 4)
    assert weights == pytest.approx([1 / 6, 1 / 6, 1 / 6, 1 / 2])
    assert math.fsum(weights or []) == pytest.approx(1.0)


def test_unknown_rates_count_as_the_mean_and_all_unknown_as_equal() -> None:
    # The newcomer (no throughput yet) counts as the mean of 300 and 100.
    weights = partition_weights([(300.0, [0]), (100.0, [1]), (None, [2])], 3)
    assert weights == pytest.approx([0.5, 1 / 6, 1 / 3])
    for unknown in (None, 0.0, -1.0, math.nan, math.inf):
        assert partition_weights([(unknown, [0]), (None, [1, 2])], 3) == pytest.approx(
            [0.5, 0.25, 0.25]
        )


def test_unclaimed_and_foreign_partitions() -> None:
    # Nobody owns partition 1 (a rebalance in flight): it gets nothing; 7 is not a partition.
    assert partition_weights([(2.0, [0, 7]), (1.0, [2])], 3) == pytest.approx([2 / 3, 0, 1 / 3])
    # Two members claim partition 0 (one of them reported before the rebalance): claims add.
    assert partition_weights([(1.0, [0]), (1.0, [0, 1])], 2) == pytest.approx([0.75, 0.25])
    assert partition_weights([(1.0, []), (2.0, [5])], 3) is None
    assert partition_weights([], 3) is None
    with pytest.raises(ValueError, match="num_partitions"):
        partition_weights([(1.0, [0])], 0)


def test_choice_follows_the_weights_over_many_ids() -> None:
    weights = [0.375, 0.375, 0.125, 0.125, 0.0]
    ids = [f"job:e{i % 3}:train:{i // 8:05d}:b{i % 8:03d}" for i in range(10_000)]
    counts = Counter(choose_partition(batch_id, weights) for batch_id in ids)
    assert counts[4] == 0  # weight 0: never
    for partition, weight in enumerate(weights[:4]):
        assert abs(counts[partition] / len(ids) - weight) < 0.02, (partition, counts)
    # Weights need not be normalised: only their proportions count.
    scaled = [w * 8 for w in weights]
    assert all(choose_partition(b, scaled) == choose_partition(b, weights) for b in ids[:500])


def test_choice_is_deterministic_across_processes() -> None:
    weights = [0.1, 0.2, 0.3, 0.4]
    ids = [f"j:e0:train:{k:05d}:b000" for k in range(50)]
    here = [choose_partition(batch_id, weights) for batch_id in ids]
    assert here == [choose_partition(batch_id, weights) for batch_id in ids]
    # Another interpreter (its own str hash seed) picks the same partitions.
    code = (
        "from conveyor.training.routing import choose_partition;"
        f"print([choose_partition(b, {weights!r}) for b in {ids!r}])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == repr(here)
    assert len(set(here)) == 4  # and the ids do spread


def test_a_single_positive_weight_takes_every_batch() -> None:
    assert {choose_partition(f"b{i}", [0.0, 0.0, 1.0, 0.0]) for i in range(200)} == {2}
    with pytest.raises(ValueError, match="positive sum"):
        choose_partition("b", [0.0, 0.0])
