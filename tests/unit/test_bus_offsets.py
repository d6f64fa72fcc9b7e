"""Pure logic of the bus: the commit point after out-of-order acks, and metric label kinds."""

from __future__ import annotations

import pytest

from conveyor.platform.bus.metrics import topic_kind
from conveyor.platform.bus.offsets import InFlight, PartitionOffsets
from conveyor.platform.messages import Topics


def test_commit_point_is_the_contiguous_acked_prefix() -> None:
    offsets = PartitionOffsets()
    for offset in (10, 11, 12, 15):  # gaps (compaction, control records) are allowed
        offsets.delivered(offset)
    assert offsets.commit_offset is None and offsets.unacked == 4

    assert offsets.ack(12)
    assert offsets.commit_offset is None  # 10 and 11 still pending
    assert offsets.ack(10)
    assert offsets.commit_offset == 11
    assert offsets.ack(11)
    assert offsets.commit_offset == 13  # through 12, which was acked earlier
    assert offsets.needs_commit
    offsets.committed_offset = 13
    assert not offsets.needs_commit

    assert offsets.ack(15)
    assert offsets.commit_offset == 16
    assert offsets.unacked == 0
    assert offsets.next_offset == 16


def test_unknown_and_repeated_acks_change_nothing() -> None:
    offsets = PartitionOffsets()
    offsets.delivered(0)
    assert not offsets.ack(1)
    assert offsets.ack(0)
    assert not offsets.ack(0)
    assert offsets.commit_offset == 1 and offsets.unacked == 0


def test_offsets_must_increase() -> None:
    offsets = PartitionOffsets()
    offsets.delivered(5)
    with pytest.raises(ValueError, match="offset 4"):
        offsets.delivered(4)


def test_topic_kinds_are_bounded() -> None:
    topics = Topics("conveyor.")
    assert topic_kind(topics.jobs, "conveyor.") == "jobs"
    assert topic_kind(topics.shards, "conveyor.") == "shards"
    assert topic_kind(topics.dlq, "conveyor.") == "dlq"
    for kind in ("batches", "grads", "params", "control"):
        assert topic_kind(getattr(topics, kind)("job-42"), "conveyor.") == kind
    assert topic_kind("conveyor.job.x.weird", "conveyor.") == "other"
    assert topic_kind("elsewhere.jobs", "conveyor.") == "other"


class Record:
    """The fields of an aiokafka ConsumerRecord that the bookkeeping reads."""

    def __init__(self, topic: str, partition: int, offset: int, timestamp: int = 0) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset
        self.timestamp = timestamp


def test_in_flight_bounds_delivery_and_forgets_revoked_partitions() -> None:
    in_flight = InFlight(max_in_flight=2)
    in_flight.assign([("t", 0), ("t", 1)])
    in_flight.add_fetched([Record("t", 0, 0), Record("t", 1, 7), Record("t", 0, 1)])
    assert in_flight.positions() == {("t", 0): 0, ("t", 1): 7}

    delivered = []
    while (item := in_flight.next_fetched()) is not None:
        record, offsets = item
        in_flight.deliver(offsets, record.offset)
        delivered.append((record.partition, record.offset, offsets))
    assert [(p, o) for p, o, _ in delivered] == [(0, 0), (1, 7)]  # the third waits: full
    assert in_flight.full and in_flight.fetched == 1 and in_flight.fetch_budget() == 1

    old_p1 = delivered[1][2]
    in_flight.revoke([("t", 1)])
    assert in_flight.unacked == 1 and not in_flight.full
    in_flight.assign([("t", 1)])
    assert not in_flight.ack(("t", 1), old_p1, 7)  # stale: from the revoked assignment
    assert in_flight.ack(("t", 0), delivered[0][2], 0)
    assert in_flight.offsets_to_commit([("t", 0), ("t", 1)]) == {("t", 0): 1}
    in_flight.committed({("t", 0): 1})
    assert in_flight.offsets_to_commit([("t", 0)]) == {}
    assert in_flight.positions() == {("t", 0): 1, ("t", 1): None}


def test_a_revocation_in_grace_keeps_the_records_in_hand_and_drops_those_not_started() -> None:
    in_flight = InFlight(max_in_flight=4)
    in_flight.assign([("t", 0), ("t", 1)])
    in_flight.add_fetched([Record("t", 0, 0), Record("t", 1, 3)])
    for _ in range(2):
        item = in_flight.next_fetched()
        assert item is not None
        in_flight.deliver(item[1], item[0].offset)
    in_flight.add_fetched([Record("t", 0, 1), Record("t", 1, 4)])
    assert in_flight.unacked_in([("t", 0)]) == 1 and in_flight.unacked_in([("t", 9)]) == 0

    in_flight.drop_fetched([("t", 0)])  # partition 0 is being revoked: offset 1 not started
    assert in_flight.unacked_in([("t", 0)]) == 1  # offset 0 is still in hand
    item = in_flight.next_fetched()
    assert item is not None and (item[0].partition, item[0].offset) == (1, 4)
    assert in_flight.next_fetched() is None


def test_oldest_first_picks_the_oldest_partition_head_and_keeps_offset_order() -> None:
    in_flight = InFlight(max_in_flight=8, oldest_first=True)
    in_flight.assign([("t", 0), ("t", 1), ("t", 2)])
    # Partition 0's later record is older than partition 1's head: offset order still wins
    # within a partition. Equal timestamps go in fetch order.
    in_flight.add_fetched(
        [Record("t", 0, 0, 30), Record("t", 0, 1, 10), Record("t", 1, 5, 20),
         Record("t", 2, 9, 20), Record("t", 1, 6, 40), Record("t", 9, 0, 1)]
    )  # fmt: skip
    in_flight.revoke([("t", 9)])  # a revoked partition's record is never delivered
    assert in_flight.partitions_fetched() == {("t", 0), ("t", 1), ("t", 2)}
    order = []
    while (item := in_flight.next_fetched()) is not None:
        in_flight.deliver(item[1], item[0].offset)
        order.append((item[0].partition, item[0].offset))
    assert order == [(1, 5), (2, 9), (0, 0), (0, 1), (1, 6)]
    assert in_flight.partitions_fetched() == set()
