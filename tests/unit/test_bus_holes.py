"""A reader that meets a hole in a partition's offsets delivers up to it, reads it again while
it stays open (the embedded broker shows n+1 before a concurrent n), and accepts it after the
hold (compacted or transactional topics have real holes)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from conveyor.platform.bus.holes import HoleGuard

TP = ("grads", 0)


@dataclass(frozen=True)
class Record:
    offset: int


def records(*offsets: int) -> list[Record]:
    return [Record(o) for o in offsets]


def offsets(admitted: list[Record]) -> list[int]:
    return [r.offset for r in admitted]


def test_contiguous_records_pass_and_the_first_fetch_sets_the_start() -> None:
    guard = HoleGuard()
    admitted, hole = guard.admit(TP, records(40, 41, 42), now_s=0.0)
    assert offsets(admitted) == [40, 41, 42] and hole is None
    admitted, hole = guard.admit(TP, records(43), now_s=0.1)
    assert offsets(admitted) == [43] and hole is None


def test_a_hole_stops_delivery_until_it_fills() -> None:
    guard = HoleGuard(hold_s=5.0)
    guard.admit(TP, records(115, 116, 117), now_s=0.0)
    # 119 is readable before 118 (written at the same time by another producer)
    admitted, hole = guard.admit(TP, records(119), now_s=1.0)
    assert admitted == [] and hole == 118
    admitted, hole = guard.admit(TP, records(119), now_s=1.01)  # still open: read again
    assert admitted == [] and hole == 118
    admitted, hole = guard.admit(TP, records(118, 119, 120), now_s=1.02)  # filled
    assert offsets(admitted) == [118, 119, 120] and hole is None
    # Within one fetch, the records before the hole are delivered.
    admitted, hole = guard.admit(TP, records(121, 123), now_s=2.0)
    assert offsets(admitted) == [121] and hole == 122


def test_a_hole_open_past_the_hold_is_accepted() -> None:
    guard = HoleGuard(hold_s=5.0)
    guard.admit(TP, records(9), now_s=0.0)
    assert guard.admit(TP, records(12, 13), now_s=10.0) == ([], 10)
    assert guard.admit(TP, records(12, 13), now_s=14.9) == ([], 10)
    admitted, hole = guard.admit(TP, records(12, 13), now_s=15.0)
    assert offsets(admitted) == [12, 13] and hole is None
    # A later hole gets its own hold.
    assert guard.admit(TP, records(15), now_s=15.1) == ([], 14)


def test_records_already_delivered_are_dropped_and_forget_restarts() -> None:
    guard = HoleGuard()
    guard.admit(TP, records(5, 6), now_s=0.0)
    admitted, hole = guard.admit(TP, records(6, 7), now_s=0.1)
    assert offsets(admitted) == [7] and hole is None
    guard.forget(TP)  # e.g. a new assignment from the committed offset
    admitted, hole = guard.admit(TP, records(3, 4), now_s=0.2)
    assert offsets(admitted) == [3, 4] and hole is None
    # Partitions are independent.
    other = ("grads", 1)
    assert offsets(guard.admit(other, records(100), now_s=0.3)[0]) == [100]
    assert guard.admit(TP, records(6), now_s=0.3) == ([], 5)
    with pytest.raises(ValueError):
        HoleGuard(hold_s=-1)


def test_a_hole_at_the_known_position_is_read_again_before_any_record() -> None:
    # A reader at the end of an idle partition (offset 7) whose first fetch with records
    # shows 8 before 7: without the position it would start at 8 and 7 would be lost.
    guard = HoleGuard(hold_s=5.0)
    other = ("grads", 1)
    positions = {TP: 7, other: None}  # the other partition's position is not known yet
    guard.expect_positions(positions, positions.get)
    seeks: list[tuple[tuple[str, int], int]] = []
    fetched = {TP: records(8), other: records(30, 31)}
    admitted, holes = guard.admit_fetched(fetched, 0.0, lambda tp, at: seeks.append((tp, at)))
    assert holes and seeks == [(TP, 7)]
    assert admitted[TP] == [] and offsets(admitted[other]) == [30, 31]  # its first record sets it
    guard.expect_positions([TP], lambda _: 99)  # known already: a later position changes nothing
    admitted, holes = guard.admit_fetched({TP: records(7, 8)}, 0.01, lambda tp, at: None)
    assert offsets(admitted[TP]) == [7, 8] and not holes
    # Records before the position were delivered before it: dropped.
    guard.expect(TP, 20)
    assert offsets(guard.admit(TP, records(19, 20), now_s=0.1)[0]) == [20]
    guard.forget(TP)  # unknown again: the first record sets the start
    assert offsets(guard.admit(TP, records(3), now_s=0.2)[0]) == [3]
    with pytest.raises(ValueError):
        guard.expect(TP, -1)
