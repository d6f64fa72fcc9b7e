"""loadtests/plane_hops.py: a sync step's hops from the Contributions' and StepCloses' stamps."""

from __future__ import annotations

import pytest

from loadtests.plane_hops import Stamped, median_hops, step_hops


def stamped(
    base: int, sent: float, published: float, received: float, started: float, computed: float
) -> Stamped:
    return Stamped(
        base_version=base, sent_at=sent, params_published_at=published,
        params_received_at=received, started_at=started, computed_at=computed,
    )  # fmt: skip


def test_the_hops_of_a_step_follow_the_last_contribution_and_add_up_to_the_step() -> None:
    closes = {1: (100.0, ["a:0", "b:0"]), 2: (100.100, ["a:1", "b:1"])}
    contributions = {
        "a:1": stamped(1, 100.060, 100.010, 100.012, 100.014, 100.050),
        # b came last: the step waited for it; a's contribution waited 30 ms (the barrier).
        "b:1": stamped(1, 100.090, 100.012, 100.020, 100.025, 100.080),
    }
    (found,) = step_hops(closes, contributions)
    assert found.version == 2
    assert found.hops == pytest.approx({
        "apply": 0.012, "delivery": 0.008, "load": 0.005, "compute": 0.055, "grad_send": 0.010,
        "close": 0.010,
    })  # fmt: skip
    assert found.barrier == pytest.approx(0.030)
    assert found.step == pytest.approx(100.100 - 100.0)


def test_steps_without_a_previous_close_or_stamps_are_left_out() -> None:
    closes = {
        1: (10.0, ["a:0"]),  # no close 0: nothing to start from
        2: (11.0, ["a:1"]),  # its contribution is unknown (read before the watcher started)
        3: (12.0, ["a:2"]),  # empty: no stamps
        4: (13.0, ["a:3"]),  # computed on version 2, not 3
        5: (14.0, ["a:4"]),
    }
    contributions = {
        "a:2": Stamped(base_version=2, sent_at=11.9),
        "a:3": stamped(2, 12.9, 12.1, 12.2, 12.3, 12.8),
        "a:4": stamped(4, 13.9, 13.1, 13.2, 13.3, 13.8),
    }
    assert [s.version for s in step_hops(closes, contributions)] == [5]


def test_medians_cover_each_hop_the_plane_the_barrier_and_the_step() -> None:
    closes = {1: (0.0, []), 2: (1.0, ["a:1"]), 3: (3.0, ["a:2"]), 4: (6.0, ["a:3"])}
    contributions = {
        "a:1": stamped(1, 0.9, 0.1, 0.2, 0.3, 0.8),
        "a:2": stamped(2, 2.9, 1.1, 1.2, 1.3, 1.8),
        "a:3": stamped(3, 5.9, 3.1, 3.2, 3.3, 3.8),
    }
    found = median_hops(step_hops(closes, contributions))
    assert found["compute"] == pytest.approx(0.5)
    assert found["grad_send"] == pytest.approx(1.1)  # of 0.1, 1.1, 2.1
    assert found["plane"] == pytest.approx(1.5)  # of 0.5, 1.5, 2.5
    assert found["barrier"] == 0.0 and found["step"] == pytest.approx(2.0)
    assert median_hops([]) == {}
