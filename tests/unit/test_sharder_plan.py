"""The sharder's pure logic: the deterministic plan, the flow-control bound, the job fold."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import numpy as np
import pytest
from job_events import job_event
from opentelemetry.context import Context

from conveyor.platform.bus import Received
from conveyor.platform.bus.offsets import PartitionOffsets
from conveyor.platform.messages import Topics
from conveyor.services.sharder.flow import FlowControl
from conveyor.services.sharder.jobs import JobTable
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import JobPlan, epoch_order, split_ids


def make_plan(**overrides: object) -> JobPlan:
    args: dict[str, object] = dict(
        job_id="job1", num_samples=1797, eval_fraction=0.2, seed=7, epochs=3,
        micro_batch_size=32, shard_size=256,
    )  # fmt: skip
    args.update(overrides)
    return JobPlan(**args)  # type: ignore[arg-type]


def test_split_is_deterministic_disjoint_and_complete() -> None:
    train, evaluation = split_ids(1000, 0.2, seed=3)
    again_train, again_eval = split_ids(1000, 0.2, seed=3)
    assert np.array_equal(train, again_train) and np.array_equal(evaluation, again_eval)
    assert evaluation.size == 200 and train.size == 800
    assert not set(train.tolist()) & set(evaluation.tolist())
    assert sorted([*train.tolist(), *evaluation.tolist()]) == list(range(1000))
    other_train, _ = split_ids(1000, 0.2, seed=4)
    assert not np.array_equal(train, other_train)


def test_split_always_keeps_training_data() -> None:
    train, evaluation = split_ids(1, 0.99, seed=0)
    assert train.tolist() == [0] and evaluation.size == 0
    with pytest.raises(ValueError):
        split_ids(0, 0.2, seed=0)
    with pytest.raises(ValueError):
        split_ids(10, 1.0, seed=0)


def test_epoch_order_same_seed_same_order_and_epochs_differ() -> None:
    train, _ = split_ids(500, 0.1, seed=1)
    assert np.array_equal(epoch_order(train, 1, 0), epoch_order(train, 1, 0))
    assert not np.array_equal(epoch_order(train, 1, 0), epoch_order(train, 1, 1))
    assert not np.array_equal(epoch_order(train, 1, 0), epoch_order(train, 2, 0))
    assert sorted(epoch_order(train, 1, 5).tolist()) == train.tolist()


def test_plan_sizes_and_ids() -> None:
    plan = make_plan()
    assert (plan.num_train, plan.num_eval) == (1438, 359)
    assert plan.train_shards_per_epoch == math.ceil(1438 / 256) == 6
    assert plan.tasks_per_epoch == 6 + 2
    assert plan.train_batches_per_epoch == 5 * 8 + math.ceil((1438 - 5 * 256) / 32)
    assert plan.eval_batches_per_epoch == 8 + math.ceil((359 - 256) / 32)
    assert plan.num_tasks == 3 * 8
    assert plan.steps_per_epoch(2) == math.ceil(plan.train_batches_per_epoch / 2)
    shards = plan.epoch_shards(1)
    assert [s.shard_id for s in shards] == [
        *(f"job1:e1:train:{i:05d}" for i in range(6)),
        "job1:e1:eval:00000",
        "job1:e1:eval:00001",
    ]
    assert all(re.fullmatch(r"job1:e1:(train|eval):\d{5}", s.shard_id) for s in shards)
    assert [s.index for s in shards] == [0, 1, 2, 3, 4, 5, 0, 1]
    assert all(s.epoch == 1 for s in shards)
    assert sum(s.num_batches for s in shards) == plan.batches_per_epoch
    assert all(s.num_batches == math.ceil(len(s.sample_ids) / 32) for s in shards)
    # Whole micro-batches: only the last shard of a split is short.
    assert [len(s.sample_ids) for s in shards[:5]] == [256] * 5


def test_same_arguments_same_plan_and_epochs_differ() -> None:
    first, second = make_plan(), make_plan()
    for k in range(first.num_tasks):
        assert first.task(k) == second.task(k)
    e0, e1 = first.epoch_shards(0), first.epoch_shards(1)
    assert e0[0].sample_ids != e1[0].sample_ids
    # Eval shards are the same samples every epoch.
    assert [s.sample_ids for s in e0 if s.split == "eval"] == [
        s.sample_ids for s in e1 if s.split == "eval"
    ]
    assert make_plan(seed=8).task(0).sample_ids != first.task(0).sample_ids


def test_shards_cover_each_train_id_once_per_epoch_and_eval_disjoint() -> None:
    plan = make_plan()
    for epoch in range(plan.epochs):
        shards = plan.epoch_shards(epoch)
        train = Counter(i for s in shards if s.split == "train" for i in s.sample_ids)
        evaluation = Counter(i for s in shards if s.split == "eval" for i in s.sample_ids)
        assert set(train.values()) == {1} and set(evaluation.values()) == {1}
        assert sorted(train) == plan.train_ids.tolist()
        assert sorted(evaluation) == plan.eval_ids.tolist()
        assert not set(train) & set(evaluation)
        assert sorted([*train, *evaluation]) == list(range(1797))


def test_release_sequence_order_and_batch_counts() -> None:
    plan = make_plan()
    sequence = [plan.task(k) for k in range(plan.num_tasks)]
    assert [(s.epoch, s.split) for s in sequence[:9]] == [
        *((0, "train") for _ in range(6)), (0, "eval"), (0, "eval"), (1, "train"),
    ]  # fmt: skip
    total = 0
    for k, shard in enumerate(sequence):
        assert plan.batches_before(k) == total
        total += shard.num_batches
    assert plan.batches_before(plan.num_tasks) == total == 3 * plan.batches_per_epoch


def test_first_unconsumed_task_matches_brute_force() -> None:
    plan = make_plan(epochs=2)
    ends = [plan.batches_before(k + 1) for k in range(plan.num_tasks)]
    for consumed in range(0, plan.batches_before(plan.num_tasks) + 3):
        expected = next((k for k, end in enumerate(ends) if end > consumed), plan.num_tasks)
        assert plan.first_unconsumed_task(consumed) == expected, consumed


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple"):
        make_plan(shard_size=100)
    with pytest.raises(ValueError, match="epochs"):
        make_plan(epochs=0)
    with pytest.raises(ValueError, match="outside"):
        make_plan().task(10_000)


def test_from_spec_uses_default_shard_size() -> None:
    spec = JobSpec.from_dict({
        "name": "d", "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.1},
        "training": {"epochs": 2, "global_batch_size": 64, "micro_batch_size": 16,
                     "optimizer": {"name": "sgd", "lr": 0.1}, "seed": 5},
    })  # fmt: skip
    plan = JobPlan.from_spec("j", spec, 1797)
    assert plan.shard_size == 8 * 16 and plan.seed == 5 and plan.epochs == 2  # lead 512
    assert plan.num_eval == 179


# ----------------------------------------------------------------------------- flow control


def backlog_bound(plan: JobPlan, lead: int) -> int:
    return lead - 1 + plan.max_shard_batches


def test_flow_releases_up_to_the_lead_before_progress() -> None:
    plan = make_plan()
    flow = FlowControl(plan, max_lead_batches=20)
    tasks = flow.releasable(consumed=0)
    # Tasks start while fewer than 20 batches are out: 0 (0 out), 1 (8), 2 (16); not 3 (24).
    assert tasks == range(0, 3)
    flow.mark_released(tasks)
    assert flow.released_batches == 24 <= backlog_bound(plan, 20)
    assert flow.releasable(consumed=0) == range(3, 3)
    assert flow.releasable(consumed=4) == range(3, 3)  # 24 - 4 = 20, not < 20
    assert flow.releasable(consumed=5) == range(3, 4)


def test_flow_backlog_bound_holds_under_random_progress() -> None:
    rng = random.Random(0)
    for lead in (1, 7, 8, 30, 100):
        plan = make_plan(shard_size=64, micro_batch_size=16, epochs=4)
        flow = FlowControl(plan, max_lead_batches=lead)
        consumed = 0
        while not flow.finished:
            tasks = flow.releasable(consumed)
            flow.mark_released(tasks)
            backlog = flow.released_batches - consumed
            assert backlog <= backlog_bound(plan, lead), (lead, consumed, backlog)
            if tasks:
                # The last released task started under the lead.
                assert plan.batches_before(tasks.stop - 1) - consumed < lead
            # Trainers consume some of what is out (never more than released).
            consumed = min(flow.released_batches, consumed + rng.randint(0, lead + 4))
        assert flow.released_batches == plan.batches_before(plan.num_tasks)


def test_flow_restart_resumes_from_the_consumed_cursor() -> None:
    plan = make_plan(shard_size=64, micro_batch_size=16)
    flow = FlowControl(plan, max_lead_batches=12)
    # A fresh sharder whose trainer already consumed 41 batches (tasks of 4 batches each):
    # tasks 0..9 (40 batches) were all released before; task 10 holds batch 41.
    tasks = flow.releasable(consumed=41)
    assert tasks.start == 10
    assert all(plan.batches_before(k) - 41 < 12 for k in tasks)
    assert plan.batches_before(tasks.stop) - 41 >= 12 or tasks.stop == plan.num_tasks
    flow.mark_released(tasks)
    assert flow.next_task == tasks.stop
    assert flow.releasable(consumed=41) == range(tasks.stop, tasks.stop)


def test_flow_finishes_and_rejects_bad_lead() -> None:
    plan = make_plan(epochs=1)
    flow = FlowControl(plan, max_lead_batches=1_000_000)
    flow.mark_released(flow.releasable(0))
    assert flow.finished and flow.lead_batches(0) == plan.batches_per_epoch
    assert flow.releasable(0) == range(plan.num_tasks, plan.num_tasks)
    with pytest.raises(ValueError):
        FlowControl(plan, max_lead_batches=0)


# ------------------------------------------------------------------------------- job table


def received(job_id: str, event: str, offset: int, **data: object) -> Received:
    message = job_event(job_id, event, at=1.0, **data)
    return Received(
        topic="p.jobs", partition=0, offset=offset, key=job_id.encode(), message=message,
        headers={}, timestamp_ms=0, size_bytes=0, context=Context(), _offsets=PartitionOffsets(),
    )  # fmt: skip


def test_job_table_holds_submitted_and_folds_events() -> None:
    table = JobTable(Topics("p."))
    spec = {
        "name": "d", "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {"epochs": 1, "global_batch_size": 32, "micro_batch_size": 32,
                     "optimizer": {"name": "sgd", "lr": 0.1}},
    }  # fmt: skip
    assert table.apply(received("j", "submitted", 0, spec=spec)) is False  # held
    assert table.apply(received("j", "submitted", 5, spec=spec)) is True  # a repeat
    assert table.apply(received("j", "submitted", 0, spec=spec)) is False  # redelivered
    job = table.get("j")
    assert job is not None and job.spec is not None and job.spec_error is None
    assert table.apply(received("j", "planned", 1)) and job.planned_seen
    assert table.apply(received("j", "progress", 2, consumed_batches=7, routing=[0.25, 0.75]))
    assert table.apply(received("j", "progress", 3, worker_id="w", samples_trained=50))
    assert (job.consumed, job.routing) == (7, [0.25, 0.75])  # only the coordinator's counts
    assert table.apply(received("j", "progress", 4, consumed_batches=9))
    assert (job.consumed, job.routing) == (9, [])  # latest wins, routing cleared
    assert table.apply(received("j", "cancel_requested", 6)) and job.cancel_requested
    assert not job.terminal
    assert table.apply(received("j", "cancelled", 7)) and job.terminal
    assert table.apply(received("other", "progress", 8, consumed_batches=1))  # unknown job
    assert table.get("other") is None and len(table) == 1


def test_job_table_counts_distinct_skipped_samples_against_the_limit() -> None:
    table = JobTable(Topics("p."))
    spec = {
        "name": "d", "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits", "max_bad_samples": 3},
        "training": {"epochs": 1, "global_batch_size": 32, "micro_batch_size": 32,
                     "optimizer": {"name": "sgd", "lr": 0.1}},
    }  # fmt: skip
    table.apply(received("j", "submitted", 0, spec=spec))
    job = table.get("j")
    assert job is not None and job.too_many_bad_samples() is None

    def skipped(offset: int, shard: str, ids: list[int]) -> Received:
        reasons = [f"file:///d/{i}.png: corrupt image" for i in ids]
        return received("j", "samples_skipped", offset, shard_id=shard, sample_ids=ids,
                        reasons=reasons)  # fmt: skip

    assert table.apply(skipped(1, "j:e0:train:00000", [4, 9]))
    assert table.apply(skipped(2, "j:e0:train:00000", [4, 9]))  # the shard redelivered
    assert table.apply(skipped(3, "j:e1:train:00002", [9, 12]))  # the same file next epoch
    assert job.skipped == {4, 9, 12} and job.too_many_bad_samples() is None  # 3 <= 3
    assert table.apply(skipped(4, "j:e1:train:00003", [30]))
    reason = job.too_many_bad_samples()
    assert reason is not None and reason.startswith(
        "4 samples failed validation, more than dataset.max_bad_samples=3: "
        "file:///d/4.png: corrupt image; file:///d/9.png: corrupt image"
    )


def test_job_table_records_spec_errors() -> None:
    table = JobTable(Topics("p."))
    table.apply(received("j1", "submitted", 0, spec={"name": "x"}))
    table.apply(received("bad.id", "submitted", 1, spec={}))
    errors = {job.job_id: job.spec_error for job in table.records()}
    assert errors["j1"] is not None and errors["j1"].startswith("invalid job spec")
    assert errors["bad.id"] is not None and "invalid job id" in errors["bad.id"]
