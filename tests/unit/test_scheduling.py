"""The scheduling fold: counts, queue order, priorities, elastic growth and shrink, sticky
placement, the pool's liveness on the log's clock, and the schedule folded from job events."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from job_events import job_event

from conveyor.platform.messages import TrainerPresence
from conveyor.training.jobview import JobsView
from conveyor.training.scheduling import Demand, Schedule, TrainerPool, schedule


def demand(job_id: str, wanted: int = 1, *, at: float = 0.0, **fields: int) -> Demand:
    fewest, most = fields.pop("fewest", wanted), fields.pop("most", wanted)
    return Demand(
        job_id=job_id,
        priority=fields.pop("priority", 0),
        submitted_at=at,
        fewest=fewest,
        wanted=wanted,
        most=most,
    )


def idle(count: int) -> dict[str, str | None]:
    return {f"t{index}": None for index in range(count)}


def counts(result: Schedule) -> dict[str, int]:
    placed: dict[str, int] = {}
    for job in result.placement.values():
        placed[job] = placed.get(job, 0) + 1
    return placed


def test_three_jobs_asking_2_1_1_on_3_trainers_run_two_and_queue_the_third() -> None:
    jobs = [demand("a", 2, at=1.0), demand("b", 1, at=2.0), demand("c", 1, at=3.0)]
    result = schedule(jobs, frozenset(), idle(3))
    assert result.placement == {"t0": "a", "t1": "a", "t2": "b"}
    assert result.queue == ("c",) and result.position("c") == 1 and result.position("a") is None


def test_the_queue_head_blocks_later_jobs_that_would_fit() -> None:
    # FIFO within a priority: c (1 trainer) does not overtake b (3 trainers).
    jobs = [demand("a", 2, at=1.0), demand("b", 3, at=2.0), demand("c", 1, at=3.0)]
    result = schedule(jobs, frozenset({"a"}), idle(3))
    assert counts(result) == {"a": 2}
    assert result.queue == ("b", "c")


def test_priority_orders_the_queue_before_submission_time() -> None:
    jobs = [
        demand("low", 1, at=1.0),
        demand("high", 1, at=3.0, priority=5),
        demand("mid", 1, at=2.0, priority=1),
    ]
    result = schedule(jobs, frozenset(), idle(1))
    assert counts(result) == {"high": 1}
    assert result.queue == ("mid", "low")


def test_a_started_job_keeps_its_minimum_against_a_higher_priority() -> None:
    jobs = [demand("running", 2, at=1.0), demand("urgent", 2, at=2.0, priority=9)]
    pool = {"t0": "running", "t1": "running", "t2": None}
    result = schedule(jobs, frozenset({"running"}), pool)
    assert counts(result) == {"running": 2} and result.queue == ("urgent",)


def test_an_elastic_job_grows_into_spare_trainers_up_to_its_most() -> None:
    result = schedule([demand("e", 2, fewest=1, most=3)], frozenset({"e"}), idle(5))
    assert counts(result) == {"e": 3}


def test_an_elastic_job_shrinks_to_its_minimum_for_a_higher_priority_job() -> None:
    pool: dict[str, str | None] = {"t0": "e", "t1": "e", "t2": "e"}
    elastic = demand("e", 2, fewest=1, most=3, at=1.0)
    before = schedule([elastic], frozenset({"e"}), pool)
    assert counts(before) == {"e": 3}
    after = schedule([elastic, demand("h", 2, at=2.0, priority=1)], frozenset({"e"}), pool)
    # e keeps its lowest-id trainer; the two others move to h.
    assert after.placement == {"t0": "e", "t1": "h", "t2": "h"}
    assert after.queue == ()


def test_an_elastic_job_keeps_its_extras_against_the_same_or_a_lower_priority() -> None:
    pool: dict[str, str | None] = {"t0": "e", "t1": "e", "t2": "e"}
    elastic = demand("e", 1, fewest=1, most=3, at=1.0)
    for priority in (0, -1):
        waiting = demand("w", 1, at=2.0, priority=priority)
        result = schedule([elastic, waiting], frozenset({"e"}), pool)
        assert counts(result) == {"e": 3} and result.queue == ("w",)
    # A trainer frees up (e's third left): the waiting job takes it, e keeps its two.
    pool["t2"] = None
    result = schedule([elastic, demand("w", 1, at=2.0)], frozenset({"e"}), pool)
    assert counts(result) == {"e": 2, "w": 1} and result.queue == ()
    # Not started yet, e holds nothing to keep: the next in line gets its minimum first.
    result = schedule([elastic, demand("w", 2, at=2.0)], frozenset(), idle(3))
    assert counts(result) == {"e": 1, "w": 2}


def test_a_higher_priority_takes_extras_from_the_lowest_ranked_holder_first() -> None:
    pool: dict[str, str | None] = {"t0": "a", "t1": "a", "t2": "b", "t3": "b", "t4": "c"}
    jobs = [
        demand("a", 1, fewest=1, most=2, at=1.0, priority=1),
        demand("b", 1, fewest=1, most=2, at=2.0),
        demand("c", 1, at=3.0),
        demand("h", 2, at=4.0, priority=2),
    ]
    result = schedule(jobs, frozenset({"a", "b", "c"}), pool)
    # h needs 2: b's extra (priority 0, ranked last of the holders) then a's (priority 1).
    assert counts(result) == {"a": 1, "b": 1, "c": 1, "h": 2}
    assert result.placement["t0"] == "a" and result.placement["t2"] == "b"
    # Started and short of what it asks (a trainer died), h takes b's extra again.
    jobs[3] = demand("h", 3, fewest=1, at=4.0, priority=2)
    pool = {"t0": "a", "t1": "a", "t2": "b", "t3": "b", "t4": "h"}
    result = schedule(jobs, frozenset({"a", "b", "h"}), pool)
    assert counts(result) == {"a": 1, "b": 1, "h": 3} and result.queue == ("c",)


def test_growth_goes_to_wanted_first_then_to_most_in_rank_order() -> None:
    jobs = [demand("a", 2, fewest=1, most=4, at=1.0), demand("b", 2, fewest=1, most=4, at=2.0)]
    assert counts(schedule(jobs, frozenset(), idle(4))) == {"a": 2, "b": 2}
    assert counts(schedule(jobs, frozenset(), idle(5))) == {"a": 3, "b": 2}


def test_placement_is_sticky_when_a_job_ahead_ends() -> None:
    # a ended: b keeps t2 although t0 (a lower id) is free now; c takes t0.
    pool: dict[str, str | None] = {"t0": "a", "t1": "a", "t2": "b"}
    result = schedule([demand("b", 1, at=2.0), demand("c", 1, at=3.0)], frozenset({"b"}), pool)
    assert result.placement == {"t2": "b", "t0": "c"}


def test_the_schedule_does_not_depend_on_the_order_jobs_are_given() -> None:
    jobs = [
        demand("a", 2, at=1.0, fewest=1, most=3),
        demand("b", 1, at=2.0, priority=2),
        demand("c", 2, at=3.0),
        demand("d", 1, at=3.0),
    ]
    results = {
        (tuple(sorted(r.placement.items())), r.queue)
        for r in (
            schedule(order, frozenset({"a"}), idle(4)) for order in itertools.permutations(jobs)
        )
    }
    assert len(results) == 1


def test_an_empty_pool_queues_every_job() -> None:
    result = schedule([demand("a", at=1.0), demand("b", at=2.0)], frozenset(), {})
    assert result.placement == {} and result.queue == ("a", "b") and result.pool_size == 0


def presence(worker: str, at: float, job: str | None = None, **fields: Any) -> TrainerPresence:
    return TrainerPresence(worker_id=worker, job_id=job, ttl_s=10.0, at=at, **fields)


def test_the_pool_drops_a_leaving_trainer_at_once_and_a_silent_one_after_its_ttl() -> None:
    pool = TrainerPool()
    pool.apply(presence("t0", 100.0, "a"))
    pool.apply(presence("t1", 100.0))
    pool.apply(presence("t2", 100.0))
    pool.apply(presence("t2", 101.0, leaving=True))
    assert pool.live() == {"t0": "a", "t1": None}
    pool.observe(110.0)
    assert set(pool.live()) == {"t0", "t1"}  # exactly at the ttl: still there
    pool.apply(presence("t1", 110.5))
    assert pool.live() == {"t1": None}  # t0 said nothing for 10.5 s of the log's clock


def test_an_older_presence_read_late_does_not_undo_a_newer_one() -> None:
    pool = TrainerPool()
    pool.apply(presence("t0", 5.0, leaving=True))
    pool.apply(presence("t0", 4.0, "a"))
    assert pool.live() == {}


SPEC: dict[str, Any] = {"name": "j", "training": {"epochs": 1}}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, (0, 1, 1, 1)),
        ({"priority": 3, "distribution": {"trainers": 2}}, (3, 2, 2, 2)),
        ({"distribution": {"trainers": 2, "min_trainers": 1, "max_trainers": 4}}, (0, 1, 2, 4)),
    ],
)
def test_a_demand_reads_its_spec(spec: dict[str, Any], expected: tuple[int, ...]) -> None:
    got = Demand.of_spec("j", {**SPEC, **spec}, 1.0)
    assert (got.priority, got.fewest, got.wanted, got.most) == expected


def test_the_view_schedules_servable_jobs_on_the_live_pool() -> None:
    view = JobsView()
    for job_id, at, trainers in (("a", 1.0, 2), ("b", 2.0, 1), ("c", 3.0, 1), ("d", 4.0, 1)):
        view.apply(job_event(job_id, "submitted", at=at, spec={
            **SPEC, "distribution": {"trainers": trainers}}, idempotency_key=None))  # fmt: skip
        if job_id != "d":  # d is not planned yet: not servable, not queued
            view.apply(job_event(job_id, "planned", at=at))
    for worker in ("t0", "t1", "t2"):
        view.apply_presence(presence(worker, 5.0))
    result = view.schedule()
    assert counts(result) == {"a": 2, "b": 1} and result.queue == ("c",)
    view.apply(job_event("a", "completed", at=6.0, summary={}))
    view.apply_presence(presence("t0", 6.0, "a"))  # still letting a go: free for the schedule
    assert view.schedule().queue == () and counts(view.schedule()) == {"b": 1, "c": 1}


def test_a_job_counts_as_started_once_a_trainer_joined_not_on_coordinator_progress() -> None:
    view = JobsView()
    for job_id, at, trainers in (("first", 1.0, 1), ("too-big", 2.0, 4)):
        view.apply(job_event(job_id, "submitted", at=at, spec={
            **SPEC, "distribution": {"trainers": trainers}}, idempotency_key=None))  # fmt: skip
        view.apply(job_event(job_id, "planned", at=at))
    view.apply(job_event("too-big", "progress", at=3.0))  # its coordinator, no trainer
    for worker in ("t0", "t1", "t2"):
        view.apply_presence(presence(worker, 3.0))
    result = view.schedule()
    assert counts(result) == {"first": 1} and result.queue == ("too-big",)
    view.apply(job_event("too-big", "running", at=4.0, worker_id="t9"))  # a trainer joined
    started = view.schedule()  # started: it keeps what it can get, before any waiting job
    assert counts(started) == {"too-big": 3} and started.queue == ("first",)
