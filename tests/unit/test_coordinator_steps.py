"""The coordinator's pure decisions on steps: sync closing, membership timeout, dedup, ssp
staleness and momentum, local windows, the lr schedule, epochs and eval sums, and closes read
back from the log."""

from __future__ import annotations

import random
from typing import Any

import pytest
from coordinator_cases import JOB, SAMPLES, T0, batch, beat, contrib, coordinator, echo, spec

from conveyor.platform.messages import EvalResult, Rejection, StepClose
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig, Decisions


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
