"""Epoch ordering, the holding buffer and deduplication of the trainer's schedule."""

from __future__ import annotations

import pytest

from conveyor.services.trainer.loop import Disposition, Schedule, ScheduleState

D = Disposition


def schedule(epochs: int = 2, train: int = 3, evals: int = 2) -> Schedule[str]:
    return Schedule(epochs=epochs, train_batches_per_epoch=train, eval_batches_per_epoch=evals)


def test_current_epoch_trains_and_later_epochs_wait() -> None:
    s = schedule()
    assert s.classify("e0:t0", 0, "train") is D.TRAIN
    assert s.classify("e1:t0", 1, "train") is D.HOLD
    assert s.classify("e0:v0", 0, "eval") is D.HOLD  # its epoch has not finished training
    assert s.classify("e2:t0", 2, "train") is D.INVALID  # the job has two epochs
    assert s.classify("x", -1, "train") is D.INVALID


def test_applied_batches_and_closed_parts_are_duplicates() -> None:
    s = schedule()
    s.mark_trained("e0:t0")
    assert s.classify("e0:t0", 0, "train") is D.DUPLICATE
    s.hold("e1:t0", 1, "train", "item")
    assert s.classify("e1:t0", 1, "train") is D.DUPLICATE  # already waiting
    s.mark_trained("e0:t1")
    assert s.mark_trained("e0:t2") is True
    assert s.close_train_epoch() == 0
    assert s.classify("e0:t9", 0, "train") is D.DUPLICATE  # the epoch's train part is closed
    assert s.classify("e0:v0", 0, "eval") is D.EVAL
    s.mark_evaluated(0, "e0:v0")
    assert s.classify("e0:v0", 0, "eval") is D.DUPLICATE
    assert s.mark_evaluated(0, "e0:v1") is True
    assert s.classify("e0:v2", 0, "eval") is D.DUPLICATE  # the epoch's eval is closed


def test_held_batches_come_back_in_arrival_order_once_their_epoch_opens() -> None:
    s = schedule()
    for batch_id, epoch, split in [
        ("e1:t1", 1, "train"),
        ("e0:v1", 0, "eval"),
        ("e1:t0", 1, "train"),
        ("e1:v0", 1, "eval"),
        ("e0:v0", 0, "eval"),
    ]:
        assert s.classify(batch_id, epoch, split) is D.HOLD
        s.hold(batch_id, epoch, split, batch_id)
    assert s.take_ready() == []
    for batch_id in ("e0:t0", "e0:t1", "e0:t2"):
        s.mark_trained(batch_id)
    s.close_train_epoch()
    assert s.take_ready() == ["e1:t1", "e0:v1", "e1:t0", "e0:v0"]
    assert s.held == 1  # epoch 1's eval waits for epoch 1's training


def test_done_after_every_epoch_is_trained_and_evaluated() -> None:
    s = schedule(epochs=1, train=1, evals=1)
    s.mark_trained("t")
    s.close_train_epoch()
    assert s.train_done and not s.done and s.epochs_completed == 0
    assert s.mark_evaluated(0, "v")
    assert s.done and s.epochs_completed == 1


def test_an_epoch_without_eval_batches_completes_at_once() -> None:
    s = schedule(epochs=1, train=1, evals=0)
    s.mark_trained("t")
    s.close_train_epoch()
    assert s.done and s.state.eval_open == {}


def test_state_round_trips_through_json() -> None:
    s = schedule()
    for batch_id in ("e0:t0", "e0:t1", "e0:t2"):
        s.mark_trained(batch_id)
    s.close_train_epoch()
    s.mark_evaluated(0, "e0:v0")
    s.mark_trained("e1:t0")
    restored = Schedule[str](
        epochs=2,
        train_batches_per_epoch=3,
        eval_batches_per_epoch=2,
        state=ScheduleState.from_json(s.state.to_json()),
    )
    assert restored.state == s.state
    assert restored.classify("e1:t0", 1, "train") is D.DUPLICATE
    assert restored.classify("e0:v0", 0, "eval") is D.DUPLICATE
    assert restored.classify("e0:v1", 0, "eval") is D.EVAL


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        schedule(train=0)
