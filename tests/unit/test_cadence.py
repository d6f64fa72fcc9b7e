"""How often progress goes to the jobs topic (cadence.py): the least interval while a job is
young, a 60th of its age later, capped; the coordinator's never longer than a quarter of the
flow-control lead takes to consume."""

from __future__ import annotations

import pytest

from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.training.cadence import (
    ConsumptionRate,
    check_progress_intervals,
    coordinator_progress_interval_s,
    progress_interval_s,
)


def test_the_interval_grows_with_the_jobs_age_within_its_bounds() -> None:
    at = [progress_interval_s(age, least_s=0.5, most_s=5.0) for age in (0, 30, 60, 120, 600, 1e6)]
    assert at == [0.5, 0.5, 1.0, 2.0, 5.0, 5.0]
    # Events in the job's first hour at a step every 0.1 s: ~700 instead of 7,200.
    events, last, age = 0, -1e9, 0.0
    while age < 3600.0:
        if age - last >= progress_interval_s(age, least_s=0.5, most_s=5.0):
            events, last = events + 1, age
        age = round(age + 0.1, 1)
    assert 650 <= events <= 950, events


def test_the_coordinators_interval_keeps_the_sharder_a_quarter_lead_ahead() -> None:
    def interval(age_s: float, rate: float) -> float:
        return coordinator_progress_interval_s(
            age_s, least_s=0.5, most_s=5.0, lead_batches=64, batches_per_s=rate
        )

    assert interval(3600.0, 0.0) == 5.0  # no rate known yet: the age decides
    assert interval(3600.0, 1.0) == 5.0  # 64 batches last 64 s: a quarter is 16 s, capped
    assert interval(3600.0, 8.0) == 2.0  # a quarter of the lead takes 2 s
    assert interval(3600.0, 1000.0) == 0.5  # never under the least
    assert interval(10.0, 8.0) == 0.5  # a young job: the least, whatever the rate


def test_the_rate_is_the_highest_recent_one_that_consumed_anything() -> None:
    rate = ConsumptionRate(window=3)
    assert rate.batches_per_s == 0.0  # nothing known yet
    rate.published(100.0, 0)
    rate.published(101.0, 20)  # 20 a second
    rate.published(102.0, 30)  # 10
    assert rate.batches_per_s == 20.0
    for t in range(103, 120):
        rate.published(float(t), 30)  # a long pause: versions without consumption
    assert rate.batches_per_s == 20.0  # the pause does not stretch the interval
    rate.published(121.0, 35)
    rate.published(122.0, 40)
    rate.published(123.0, 45)  # the window holds only the last three: 5 a second
    assert rate.batches_per_s == 5.0


def test_the_most_interval_may_not_be_under_the_least() -> None:
    check_progress_intervals(0.5, 0.5)
    with pytest.raises(ValueError, match="progress_max_interval_s"):
        check_progress_intervals(1.0, 0.5)
    with pytest.raises(ValueError, match="progress_max_interval_s"):
        AggregatorSettings(progress_interval_s=10.0, progress_max_interval_s=5.0)
