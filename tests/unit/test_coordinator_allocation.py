"""The coordinator's pure decisions on membership and allocation: what the members' heartbeats
say (throughput, data wait, batches partitions), the step's allocation and the routing weights of
the batches group."""

from __future__ import annotations

import pytest
from coordinator_cases import T0, batch, beat, contrib, coordinator

from conveyor.services.aggregator.membership import allocate


def test_membership_reads_throughput_and_data_wait() -> None:
    c = coordinator()
    c.fold(beat("a", T0, 50.0, step_time_s={"data_wait": 0.1, "compute": 0.3}))
    c.fold(beat("b", T0, data_wait_ratio=0.5))
    c.fold(beat("a", T0 - 5, 999.0))  # an older heartbeat changes nothing
    (a, b) = c.members.live(T0)
    assert a.samples_per_second == 50.0 and a.data_wait_ratio == pytest.approx(0.25)
    assert b.samples_per_second is None and b.data_wait_ratio == 0.5
    assert c.members.data_wait_ratio() == pytest.approx(0.375)


def test_allocation_is_proportional_and_sums_to_the_step() -> None:
    assert allocate({"a": 100.0, "b": 300.0}, 4) == {"a": 1, "b": 3}
    assert allocate({"a": 1.0, "b": 1.0, "c": 1.0}, 8) == {"a": 2, "b": 3, "c": 3}
    slowpoke = allocate({"a": 1000.0, "b": 1.0}, 8)
    assert slowpoke == {"a": 7, "b": 1}  # at least one each
    assert allocate({"a": None, "b": 200.0}, 4) == {"a": 2, "b": 2}  # unknown: the mean
    assert allocate({"a": 5.0, "b": 9.0, "c": 1.0}, 2) == {"a": 1, "b": 1, "c": 0}
    for total in range(3, 40):
        counts = allocate({"a": 3.3, "b": 7.1, "c": 0.2}, total)
        assert sum(counts.values()) == total and min(counts.values()) >= 1


def test_routing_gives_each_trainer_the_share_it_consumes() -> None:
    c = coordinator(partitions=4)
    assert c.routing(T0) is None  # nobody known yet: unweighted
    c.fold(beat("fast", T0, batches_partitions=[0, 1]))
    c.fold(beat("slow", T0, batches_partitions=[3, 2]))
    assert c.routing(T0) == pytest.approx([0.25] * 4)  # no throughput yet: equal per member
    c.fold(beat("fast", T0 + 1, 300.0, batches_partitions=[0, 1]))
    c.fold(beat("slow", T0 + 1, 100.0, batches_partitions=[2, 3]))
    # Sync: the allocation (3 + 1 of 4 micro-batches per step) is what each one consumes.
    assert c.allocation(T0 + 1) == {"fast": 3, "slow": 1}
    assert c.routing(T0 + 1) == pytest.approx([0.375, 0.375, 0.125, 0.125])
    c.fold(beat("slow", T0 + 2, 1.0, batches_partitions=[2, 3]))
    # 300:1, but a trainer takes at least one micro-batch per step: 3:1 still.
    assert c.routing(T0 + 2) == pytest.approx([0.375, 0.375, 0.125, 0.125])
    # The slow one dies: its partitions move to the fast one, which reports them.
    c.fold(beat("fast", T0 + 13, 300.0, batches_partitions=[0, 1, 2, 3]))
    assert c.routing(T0 + 13) == pytest.approx([0.25] * 4)
    # A StepClose allocates as the routing weights.
    c.fold(beat("slow", T0 + 13, 100.0, batches_partitions=[2, 3]))
    c.fold(contrib("fast", 0, [batch(0, 0)], at=T0 + 13))
    c.fold(contrib("slow", 0, [batch(0, 1)], at=T0 + 13))
    close = c.decide(T0 + 13).close
    assert close is not None and close.allocation == {"fast": 3, "slow": 1}


def test_routing_weights_only_a_consistent_view_of_the_batches_group() -> None:
    c = coordinator(partitions=4)
    # The first step: one trainer's heartbeat already lists its partitions, the other's was
    # sent before its assignment. Weights from that view would route every batch to 1 and 3.
    c.fold(beat("a", T0, batches_partitions=[1, 3]))
    c.fold(beat("b", T0, batches_partitions=[]))
    assert c.routing(T0) is None  # unweighted: the partitions in turn
    c.fold(beat("b", T0 + 1, batches_partitions=[0, 2]))
    assert c.routing(T0 + 1) == pytest.approx([0.25] * 4)
    c.fold(beat("a", T0 + 2, 300.0, batches_partitions=[1, 3]))
    c.fold(beat("b", T0 + 2, 100.0, batches_partitions=[0, 2]))
    assert c.routing(T0 + 2) == pytest.approx([0.125, 0.375, 0.125, 0.375])
    # A rebalance: "a" reports its new partitions before "b" reports losing 2; partition 2 is
    # claimed twice, so the last consistent weights stand.
    c.fold(beat("a", T0 + 3, 300.0, batches_partitions=[1, 2, 3]))
    assert c.routing(T0 + 3) == pytest.approx([0.125, 0.375, 0.125, 0.375])
    c.fold(beat("b", T0 + 3, 100.0, batches_partitions=[0]))
    assert c.routing(T0 + 3) == pytest.approx([0.25, 0.25, 0.25, 0.25])


def test_ssp_routing_follows_throughput() -> None:
    c = coordinator(partitions=3, mode="ssp")
    c.fold(beat("a", T0, 500.0, batches_partitions=[0]))
    c.fold(beat("b", T0, 100.0, batches_partitions=[1, 2]))
    c.fold(beat("c", T0, batches_partitions=[]))  # no partition (more trainers than them)
    assert c.routing(T0) == pytest.approx([5 / 6, 1 / 12, 1 / 12])


def test_equal_allocation_splits_evenly_and_routes_nothing() -> None:
    c = coordinator(partitions=4, allocation="equal")
    c.fold(beat("fast", T0, 300.0, batches_partitions=[0, 1]))
    c.fold(beat("slow", T0, 100.0, batches_partitions=[2, 3]))
    assert c.allocation(T0) == {"fast": 2, "slow": 2}
    assert c.routing(T0) is None
    c.fold(contrib("fast", 0, [batch(0, 0), batch(0, 1)]))
    c.fold(contrib("slow", 0, [batch(0, 2), batch(0, 3)]))
    close = c.decide(T0).close
    assert close is not None and close.allocation == {"fast": 2, "slow": 2}
    # Without the plan's partition count there is nothing to route either.
    assert coordinator().routing(T0) is None


def test_membership_reads_batches_partitions() -> None:
    c = coordinator(partitions=4)
    c.fold(beat("a", T0, 1.0, batches_partitions=[3, 1, 1]))
    c.fold(beat("d", T0, 1.0))
    a, d = c.members.live(T0)
    assert a.batches_partitions == (1, 3)  # sorted, each once
    assert d.batches_partitions == ()
