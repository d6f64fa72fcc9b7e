"""Routing by the trainers' shares: partition weights from the members, the evenly spread
sequence of partitions over an epoch's batches."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from conveyor.training.routing import claims_complete, partition_weights, shard_partitions, spread


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


def test_claims_are_complete_when_every_partition_has_one_owner() -> None:
    assert claims_complete([[0, 2], [1, 3]], 4)
    assert claims_complete([[0, 1, 2], []], 3)  # more members than partitions: one holds none
    assert not claims_complete([[1, 3], []], 4)  # a member has not reported its assignment
    assert not claims_complete([[0, 1], [1, 2]], 3)  # a stale claim after a rebalance
    assert not claims_complete([[0, 1, 4]], 3)  # a partition out of range
    assert not claims_complete([], 2)


def test_equal_weights_take_the_partitions_in_turn() -> None:
    assert spread((0.25,) * 4) == (0, 1, 2, 3)
    assert shard_partitions(6, 5, None, 4) == [2, 3, 0, 1, 2]  # no routing yet: equal
    assert shard_partitions(6, 5, [0.25] * 4, 4) == [2, 3, 0, 1, 2]


def test_every_run_of_the_sequence_holds_each_share_to_one_batch() -> None:
    weights = (0.375, 0.375, 0.125, 0.125, 0.0)
    cycle = spread(weights)
    assert Counter(cycle) == {0: 3, 1: 3, 2: 1, 3: 1}  # weight 0: never
    assert spread(tuple(w * 8 for w in weights)) == cycle  # only the proportions count
    sequence = shard_partitions(0, 10 * len(cycle), list(weights), 5)
    for start in range(len(cycle)):
        for length in range(1, 3 * len(cycle)):
            counts = Counter(sequence[start : start + length])
            for partition, weight in enumerate(weights):
                assert abs(counts[partition] - weight * length) < 1.0 + 1e-9, (start, length)


def test_shards_continue_one_sequence_over_the_epoch() -> None:
    """The digits demo's epoch: 45 batches in shards of 8, 4 partitions that the group's
    round robin gives 2 trainers as {0, 2} and {1, 3}: the trainers alternate, batch by
    batch, and end the epoch one batch apart (a hash left them 5-10 apart)."""
    shards = [(index * 8, min(8, 45 - index * 8)) for index in range(6)]
    routed = [p for first, count in shards for p in shard_partitions(first, count, None, 4)]
    assert routed == shard_partitions(0, 45, None, 4)
    trainers = ["a" if p in (0, 2) else "b" for p in routed]
    assert trainers[:6] == ["a", "b", "a", "b", "a", "b"]
    assert Counter(trainers) == {"a": 23, "b": 22}
    # A 3:1 allocation (fast "a"): three of every four batches, spread out.
    weights = partition_weights([(3.0, [0, 2]), (1.0, [1, 3])], 4)
    assert weights is not None
    fast = ["a" if p in (0, 2) else "b" for p in shard_partitions(0, 45, weights, 4)]
    assert Counter(fast) == {"a": 34, "b": 11}
    assert all(fast[i : i + 4].count("b") <= 2 for i in range(41))


def test_rounding_keeps_a_sliver_of_a_share_and_bad_weights_are_refused() -> None:
    assert 3 in spread((0.999, 0.0, 0.0, 0.001))
    assert set(spread((0.0, 0.0, 1.0, 0.0))) == {2}
    with pytest.raises(ValueError, match="positive sum"):
        spread((0.0, 0.0))
    with pytest.raises(ValueError, match="positive sum"):
        spread((1.0, math.nan))
    with pytest.raises(ValueError, match="3 routing weights for 4 partitions"):
        shard_partitions(0, 8, [0.5, 0.25, 0.25], 4)
    with pytest.raises(ValueError, match="num_partitions"):
        shard_partitions(0, 8, None, 0)
