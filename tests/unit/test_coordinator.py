"""The coordinator's pure decisions: sync closing, membership timeout, dedup, ssp staleness,
allocation, epochs and eval sums."""

from __future__ import annotations

import random
from typing import Any

import pytest
from heartbeats import heartbeat

from conveyor.platform.messages import (
    AppliedContribution,
    Contribution,
    EvalResult,
    Heartbeat,
    Rejection,
    StepClose,
    sample_ids_tensor,
)
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig, Decisions
from conveyor.services.aggregator.membership import allocate
from conveyor.services.aggregator.metrics import rejection_label
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import parse_batch_id

JOB = "job1"
T0 = 1_000.0
SAMPLES = 1_000
"""Samples of the dataset; batch(epoch, index) holds the one sample ``index``."""


def spec(optimizer: dict[str, Any] | None = None, **distribution: Any) -> JobSpec:
    return JobSpec.from_dict({
        "name": "c",
        "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {
            "epochs": 2, "global_batch_size": 4, "micro_batch_size": 1,
            "optimizer": optimizer or {"name": "sgd", "lr": 0.5},
            "lr_schedule": {"name": "step", "step_size": 2, "gamma": 0.5},
        },
        "distribution": {"trainers": 2, **distribution},
    })  # fmt: skip


def coordinator(
    train: int = 8, evals: int = 2, partitions: int | None = None, **distribution: Any
) -> Coordinator:
    config = CoordinatorConfig(
        job_id=JOB,
        spec=spec(**distribution),
        train_batches_per_epoch=train,
        eval_batches_per_epoch=evals,
        dataset_samples=SAMPLES,
        member_timeout_s=10.0,
        batches_partitions=partitions,
    )
    return Coordinator(config)


def batch(epoch: int, index: int, split: str = "train") -> str:
    return f"{JOB}:e{epoch}:{split}:{index // 4:05d}:b{index % 4:03d}"


def beat(worker: str, at: float, sps: float | None = None, **state: Any) -> Heartbeat:
    if sps is not None:
        state["samples_per_second"] = sps
    return heartbeat(JOB, worker, at=at, **state)


_seq = iter(range(1_000_000))


def sample_of(batch_id: str) -> int:
    """The one sample of ``batch(epoch, index)``: ``index``."""
    ref = parse_batch_id(batch_id)
    return ref.shard_index * 4 + ref.position


def contrib(worker: str, base: int, batches: list[str], at: float = T0, cid: str | None = None,
            loss: float = 1.0, samples: list[int] | None = None,
            epoch: int | None = None) -> Contribution:  # fmt: skip
    """A contribution computed on ``batches``: the samples of each (``samples``: what it says
    it computed on instead), of the first batch's epoch (or ``epoch``)."""
    if samples is None:
        samples = [sample_of(b) for b in batches]
    if epoch is None:
        epoch = parse_batch_id(batches[0]).epoch if batches else 0
    return Contribution(
        job_id=JOB,
        contribution_id=cid or f"{worker}:{next(_seq)}",
        worker_id=worker,
        base_version=base,
        num_samples=len(samples),
        batch_ids=batches,
        epoch=epoch,
        sample_ids=sample_ids_tensor(samples),
        loss_sum=loss * len(samples),
        grad_bytes=100,
        sent_at=at,
    )


def echo(c: Coordinator, decisions: Decisions) -> None:
    """What the log does: the published decisions come back and are folded."""
    for rejection in decisions.rejections:
        c.fold(rejection)
    if decisions.close is not None:
        c.fold(decisions.close)


def test_sync_closes_only_when_every_live_member_contributed() -> None:
    c = coordinator()
    c.fold(beat("a", T0, 100.0))
    c.fold(beat("b", T0, 300.0))
    a = contrib("a", 0, [batch(0, 0)])
    c.fold(a)
    assert c.decide(T0 + 1) == Decisions()
    b = contrib("b", 0, [batch(0, 1), batch(0, 2), batch(0, 3)])
    c.fold(b)
    decisions = c.decide(T0 + 1)
    close = decisions.close
    assert close is not None and decisions.rejections == []
    assert close.version == 1 and close.num_samples == 4 and close.epoch == 0
    assert close.batch_ids == [batch(0, 0), batch(0, 1), batch(0, 2), batch(0, 3)]
    assert [e.contribution_id for e in close.contributions] == [
        a.contribution_id,
        b.contribution_id,
    ]
    assert all(e.staleness == 0 for e in close.contributions)
    assert close.allocation == {"a": 1, "b": 3}  # proportional to throughput, sums to 4
    assert close.lr == 0.5
    # nothing more is decided until the close comes back through the log
    assert c.decide(T0 + 1) == Decisions()
    echo(c, decisions)
    assert c.version == 1 and c.steps == 1 and c.samples_trained == 4
    assert c.last_loss == pytest.approx(1.0)


def test_dead_member_is_dropped_after_the_timeout_and_the_step_closes() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(beat("b", T0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)], at=T0 + 1))
    c.fold(beat("a", T0 + 9))
    assert c.decide(T0 + 9.5).close is None  # b is still within its 10 s
    assert c.decide(T0 + 10.0).close is None
    decisions = c.decide(T0 + 10.5)  # b silent for more than 10 s: dropped
    assert decisions.close is not None and decisions.close.version == 1
    assert decisions.close.allocation == {"a": 4}
    assert [m.worker_id for m in c.members.live(T0 + 10.5)] == ["a"]


def test_leaving_member_is_dropped_at_once() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(beat("b", T0))
    c.fold(contrib("a", 0, [batch(0, 0)]))
    assert c.decide(T0 + 1).close is None
    c.fold(beat("b", T0 + 1, leaving=True))
    assert c.decide(T0 + 1).close is not None


def test_duplicates_are_ignored_or_rejected() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    first = contrib("a", 0, [batch(0, 0), batch(0, 1)], cid="a:1")
    c.fold(first)
    c.fold(contrib("a", 0, [batch(0, 2)], cid="a:1"))  # same contribution id: ignored
    decisions = c.decide(T0)
    assert decisions.close is not None and decisions.close.batch_ids == first.batch_ids
    echo(c, decisions)
    # a contribution carrying an applied batch is rejected
    again = contrib("a", 1, [batch(0, 1), batch(0, 2)])
    c.fold(again)
    decisions = c.decide(T0)
    assert decisions.close is None
    assert [(r.contribution_id, r.reason) for r in decisions.rejections] == [
        (again.contribution_id, "duplicate batches")
    ]
    echo(c, decisions)
    assert c.rejected == 1
    # two trainers got the same redelivered batch in one step: the later one is rejected
    c.fold(beat("b", T0))
    x = contrib("a", 1, [batch(0, 2)])
    y = contrib("b", 1, [batch(0, 2), batch(0, 3)])
    c.fold(x)
    c.fold(y)
    decisions = c.decide(T0)
    assert decisions.close is not None and decisions.close.batch_ids == [batch(0, 2)]
    assert [r.contribution_id for r in decisions.rejections] == [y.contribution_id]
    echo(c, decisions)
    assert c.applied_train_batches == 3  # every batch applied once
    assert c.ledger.counts(0) == {0: 1, 1: 1, 2: 1}  # the repeated id and rejections: nothing


def test_sync_rejects_stale_contributions() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(contrib("a", 0, [batch(0, 0)]))
    echo(c, c.decide(T0))
    late = contrib("a", 0, [batch(0, 1)])
    c.fold(late)
    decisions = c.decide(T0)
    assert decisions.close is None
    assert decisions.rejections[0].reason == "stale: base 0, current 1"
    assert decisions.rejections[0].current_version == 1


def test_empty_step_makes_a_version_without_a_step() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(contrib("a", 0, []))
    decisions = c.decide(T0)
    assert decisions.close is not None and decisions.close.num_samples == 0
    echo(c, decisions)
    assert (c.version, c.steps, c.samples_trained) == (1, 0, 0)


def test_ssp_applies_within_the_bound_and_rejects_beyond() -> None:
    s = 2
    c = coordinator(train=200, mode="ssp", staleness=s)
    rng = random.Random(5)
    applied: list[int] = []
    rejected: list[int] = []
    for index in range(60):
        worker = rng.choice(["a", "b", "c"])
        c.fold(beat(worker, T0))
        base = rng.randint(max(0, c.version - 4), c.version)
        c.fold(contrib(worker, base, [batch(0, index)]))
        decisions = c.decide(T0)
        for r in decisions.rejections:
            assert r.reason == f"stale: base {base}, current {c.version}"
            rejected.append(c.version - base)
        if decisions.close is not None:
            assert len(decisions.close.contributions) == 1  # one contribution per version
            assert decisions.close.version == c.version + 1
            applied.append(decisions.close.contributions[0].staleness)
        echo(c, decisions)
    assert sorted(set(applied)) == [0, 1, 2] and c.max_staleness == s
    assert rejected and min(rejected) == s + 1
    assert c.version == len(applied) and c.rejected == len(rejected)
    assert len(applied) + len(rejected) == 60


@pytest.mark.parametrize(
    ("optimizer", "compression", "expected"),
    [
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"kind": "none"}, [None, 0.45, 0.3]),
        ({"name": "sgd", "lr": 0.1}, {"kind": "none"}, [None, None, None]),
        ({"name": "adam", "lr": 0.01}, {"kind": "none"}, [None, None, None]),
        # momentum correction: the trainers keep the momentum, the aggregator has none
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"kind": "topk", "ratio": 0.1},
         [None, None, None]),
    ],
)  # fmt: skip
def test_ssp_damps_sgd_momentum_by_the_staleness(
    optimizer: dict[str, Any], compression: dict[str, Any], expected: list[float | None]
) -> None:
    c = coordinator(train=20, mode="ssp", staleness=2, optimizer=optimizer,
                    compression=compression)  # fmt: skip
    c.fold(beat("a", T0))
    c.fold(beat("b", T0))
    c.fold(beat("c", T0))
    momenta = []
    for index, worker in enumerate(["a", "b", "c"]):  # all on version 0: staleness 0, 1, 2
        c.fold(contrib(worker, 0, [batch(0, index)]))
        decisions = c.decide(T0)
        assert decisions.close is not None and not decisions.rejections
        assert decisions.close.contributions[0].staleness == index
        momenta.append(decisions.close.momentum)
        echo(c, decisions)
    assert momenta == pytest.approx(expected)


def test_sync_keeps_the_job_momentum() -> None:
    c = coordinator(optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9})
    for worker in ["a", "b"]:
        c.fold(beat(worker, T0))
        c.fold(contrib(worker, 0, [batch(0, ord(worker))]))
    decisions = c.decide(T0)
    assert decisions.close is not None and decisions.close.momentum is None


def test_local_mode_closes_windows_like_sync_steps_at_the_outer_lr() -> None:
    c = coordinator(mode="local", sync_every_steps=2, outer_optimizer={"name": "sgd", "lr": 0.6})
    c.fold(beat("a", T0))
    c.fold(beat("b", T0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)]))
    assert c.decide(T0) == Decisions()  # b's window is not in yet
    c.fold(contrib("b", 0, [batch(0, 2), batch(0, 3)]))
    decisions = c.decide(T0)
    assert decisions.close is not None and decisions.close.num_samples == 4
    assert decisions.close.lr == 0.6  # the outer lr; the schedule is the inner optimizer's
    assert decisions.close.momentum is None
    echo(c, decisions)
    c.fold(contrib("a", 0, [batch(0, 4)]))  # computed on a version that is gone
    assert [r.reason for r in c.decide(T0).rejections] == ["stale: base 0, current 1"]


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


def test_lr_schedule_follows_the_steps() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    lrs = []
    for step in range(5):
        c.fold(contrib("a", step, [batch(0, step)]))
        decisions = c.decide(T0)
        assert decisions.close is not None
        lrs.append(decisions.close.lr)
        echo(c, decisions)
    assert lrs == [0.5, 0.5, 0.25, 0.25, 0.125]


def run_epoch(c: Coordinator, epoch: int, train: int) -> None:
    for i in range(0, train, 4):
        c.fold(contrib("a", c.version, [batch(epoch, j) for j in range(i, min(i + 4, train))]))
        decisions = c.decide(T0)
        assert decisions.close is not None
        echo(c, decisions)


def evaluate(c: Coordinator, epoch: int, index: int, loss: float, correct: int) -> None:
    c.fold(EvalResult(job_id=JOB, worker_id="a", epoch=epoch, version=c.epochs.end_version[epoch],
                      batch_ids=[batch(epoch, index, "eval")], loss_sum=loss, correct=correct,
                      num_samples=4))  # fmt: skip


def test_epoch_end_and_eval_sums() -> None:
    c = coordinator(train=6, evals=2)
    c.fold(beat("a", T0))
    assert c.current_epoch == 0
    run_epoch(c, 0, 6)
    assert c.epochs.end_version == {0: 2} and c.current_epoch == 1
    assert c.epochs.result(0) is None  # eval not covered yet
    evaluate(c, 0, 0, loss=2.0, correct=3)
    evaluate(c, 0, 0, loss=2.0, correct=3)  # the same batch again: counted once
    assert c.epochs.result(0) is None
    assert c.consumed_batches == 7
    evaluate(c, 0, 1, loss=6.0, correct=1)
    result = c.epochs.result(0)
    assert result is not None
    assert (result.epoch, result.version) == (0, 2)
    assert result.eval_loss == pytest.approx(1.0) and result.eval_accuracy == pytest.approx(0.5)
    assert result.train_loss == pytest.approx(1.0)
    assert not c.training_finished and not c.finished
    run_epoch(c, 1, 6)
    assert c.training_finished and not c.finished
    late = contrib("a", c.version, [batch(1, 0)])
    c.fold(late)
    decisions = c.decide(T0)  # training is over: nothing more is closed, all is answered
    assert decisions.close is None
    assert [(r.contribution_id, r.reason) for r in decisions.rejections] == [
        (late.contribution_id, "training finished")
    ]
    assert c.decide(T0) == Decisions()  # answered once
    echo(c, decisions)
    evaluate(c, 1, 0, 1.0, 4)
    evaluate(c, 1, 1, 1.0, 4)
    assert c.finished
    assert [r.epoch for r in c.epochs.results()] == [0, 1]
    assert c.consumed_batches == 16


def test_max_steps_finishes_training() -> None:
    base = spec()
    training = base.training.model_copy(update={"max_steps": 2})
    c = Coordinator(CoordinatorConfig(
        job_id=JOB,
        spec=base.model_copy(update={"training": training}),
        train_batches_per_epoch=12, eval_batches_per_epoch=2, dataset_samples=SAMPLES,
    ))  # fmt: skip
    c.fold(beat("a", T0))
    run_epoch(c, 0, 8)
    assert c.steps == 2 and c.training_finished and c.finished  # no epoch ended: nothing to eval


def test_duplicate_close_versions_first_wins() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(contrib("a", 0, [batch(0, 0)]))
    decisions = c.decide(T0)
    assert decisions.close is not None
    echo(c, decisions)
    other = StepClose(job_id=JOB, version=1, contributions=[], batch_ids=[batch(0, 5)],
                      num_samples=1, epoch=0, lr=1.0, allocation={}, closed_at=T0)  # fmt: skip
    c.fold(other)
    assert c.version == 1 and c.applied_train_batches == 1
    applied_id = decisions.close.contributions[0].contribution_id
    c.fold(Rejection(job_id=JOB, contribution_id=applied_id, worker_id="a", current_version=1,
                     reason="late"))  # fmt: skip
    assert c.rejected == 0


def test_a_close_folded_as_published_is_not_folded_again_when_read_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)]))
    decisions = c.decide(T0)
    assert decisions.close is not None
    c.fold(decisions.close)  # the leader folds its own close (nothing unread before it)
    c.fold(contrib("a", 1, [batch(0, 2)]))  # later on the log, read before the close comes back
    with caplog.at_level("WARNING"):
        c.fold(decodes_to_equal(decisions.close))  # the same close, read back from the log
    assert caplog.records == []
    assert c.version == 1 and c.steps == 1 and c.samples_trained == 2
    assert c.applied_train_batches == 2 and len(c.undecided()) == 1
    assert c.ledger.counts(0) == {0: 1, 1: 1}  # counted once
    assert c.decide(T0).close is not None  # the second contribution closes version 2


def decodes_to_equal(close: StepClose) -> StepClose:
    """``close`` as a reader gets it from the log: encoded and decoded (a new, equal object)."""
    from conveyor.platform.codec import decode, encode

    copy = decode(encode(close))
    assert isinstance(copy, StepClose) and copy is not close and copy == close
    return copy


def test_the_ledger_counts_what_applied_contributions_computed_on() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(beat("b", T0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)]))
    # b ran its micro-batch twice and says so: its batch ids are distinct, so nothing but the
    # sample ids shows it, and the ledger counts what was computed.
    c.fold(contrib("b", 0, [batch(0, 2)], samples=[2, 2]))
    assert c.ledger.epochs() == []  # nothing is counted before a close applies it
    echo(c, c.decide(T0))
    assert c.ledger.counts(0) == {0: 1, 1: 1, 2: 2}
    assert c.ledger.total(0) == c.samples_trained == 4
    # Neither a rejected contribution nor one still waiting for its step counts.
    c.fold(contrib("a", 0, [batch(0, 3)]))
    echo(c, c.decide(T0))
    assert c.rejected == 1
    c.fold(contrib("a", 1, [batch(1, 0)]))
    assert c.decide(T0).close is None  # b's is missing
    assert c.ledger.epochs() == [0] and c.ledger.total(0) == 4
    # Each contribution counts under its own epoch.
    c.fold(contrib("b", 1, [batch(1, 1)]))
    echo(c, c.decide(T0))
    assert c.ledger.counts(1) == {0: 1, 1: 1} and c.ledger.counts(0) == {0: 1, 1: 1, 2: 2}


def applying(version: int, contribution: Contribution) -> StepClose:
    """A StepClose of ``version`` that applies ``contribution`` (as another coordinator
    might have decided it)."""
    return StepClose(
        job_id=JOB, version=version,
        contributions=[AppliedContribution(
            contribution_id=contribution.contribution_id, worker_id=contribution.worker_id,
            base_version=contribution.base_version, num_samples=contribution.num_samples,
            staleness=version - 1 - contribution.base_version,
        )],
        batch_ids=contribution.batch_ids, num_samples=contribution.num_samples, epoch=0, lr=0.5,
        allocation={}, closed_at=T0,
    )  # fmt: skip


def test_a_contribution_rejected_then_applied_counts_while_a_close_may_apply_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = coordinator(mode="ssp", staleness=1)
    c.fold(beat("a", T0))
    x, y = contrib("a", 0, [batch(0, 0)]), contrib("a", 0, [batch(0, 1)])
    for contribution in (x, y):
        c.fold(contribution)
        # During a handover one coordinator rejects it, the other (which has not read the
        # rejection) applies it: the slice owners apply the close, so the ledger counts it.
        c.fold(Rejection(job_id=JOB, contribution_id=contribution.contribution_id,
                         worker_id="a", current_version=0, reason="handover"))  # fmt: skip
    assert c.rejected == 2 and c.undecided() == []
    c.fold(applying(1, x))
    assert c.ledger.counts(0) == {0: 1} and c.last_loss == pytest.approx(1.0)
    # Two versions on, no close may take y (base 0) within the staleness bound of 1: forgotten.
    fresh = contrib("a", 1, [batch(0, 2)])
    c.fold(fresh)
    c.fold(applying(2, fresh))
    assert c.ledger.counts(0) == {0: 1, 2: 1}
    with caplog.at_level("ERROR"):
        c.fold(applying(3, y))
    assert "missing from the ledger" in caplog.text
    assert c.ledger.counts(0) == {0: 1, 2: 1}


def test_contributions_the_ledger_cannot_account_for_are_rejected() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    outside = contrib("a", 0, [batch(0, 0)], samples=[SAMPLES])  # no such sample
    mixed = contrib("a", 0, [batch(0, 1), batch(1, 2)])  # says epoch 0, a batch of epoch 1
    mislabelled = contrib("a", 0, [batch(0, 3)], epoch=1)
    for contribution in (outside, mixed, mislabelled):
        c.fold(contribution)
    decisions = c.decide(T0)
    assert decisions.close is None
    assert [(r.contribution_id, r.reason) for r in decisions.rejections] == [
        (outside.contribution_id, "invalid sample ids"),
        (mixed.contribution_id, "invalid batch ids"),
        (mislabelled.contribution_id, "invalid batch ids"),
    ]
    echo(c, decisions)
    assert c.ledger.epochs() == [] and c.rejected == 3


def test_the_summary_counts_samples_per_second_from_the_first_step_begun() -> None:
    """A local-mode window's samples count with its time: the window opens when the first
    step began (``started_at``), not when its contribution was sent after it."""
    from dataclasses import replace

    from conveyor.services.aggregator.finish import summarise

    c = coordinator()
    c.fold(beat("a", T0, 100.0))
    c.fold(beat("b", T0, 100.0))
    c.fold(replace(contrib("a", 0, [batch(0, 0), batch(0, 1)], at=T0), started_at=T0 - 2.0))
    c.fold(replace(contrib("b", 0, [batch(0, 2), batch(0, 3)], at=T0 + 0.5), started_at=T0 - 1.0))
    echo(c, c.decide(T0 + 1.0))
    assert c.first_started_at == T0 - 2.0
    assert summarise(c, "file:///m")["samples_per_second"] == pytest.approx(4 / 3.0)
    empty = coordinator()  # no stamps (an empty contribution, an older trainer): sent_at
    empty.fold(contrib("a", 0, [], at=T0 + 3.0))
    assert empty.first_started_at == T0 + 3.0


def test_each_rejection_reason_counts_under_its_own_label() -> None:
    reasons = ["stale: base 1, current 4", "duplicate batches", "invalid batch ids",
               "invalid sample ids", "over the global batch", "training finished"]  # fmt: skip
    assert [rejection_label(r) for r in reasons] == [r.split(":")[0] for r in reasons]
    assert rejection_label("a reason added later") == "other"
