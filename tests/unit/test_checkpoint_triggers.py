"""Which versions are checkpointed and why (the coordinator's fold), and what the checkpointer
makes of the control log (its book): readiness, failures, the data cursor, the timer; and that
a final checkpoint committed from its slice files alone says what the book would have said."""

from __future__ import annotations

from typing import Any

import pytest
from coordinator_cases import JOB, SAMPLES, T0, batch, beat, contrib, echo

from conveyor.platform.messages import CheckpointRequest, SliceSaved, StepClose
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig
from conveyor.services.checkpointer.book import CheckpointBook, final_checkpointed
from conveyor.training.jobspec import JobSpec

TRAIN = 12  # batches per epoch: 3 steps of 4


def job_spec(**checkpoint: Any) -> JobSpec:
    return JobSpec.from_dict({
        "name": "c", "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {"epochs": 2, "global_batch_size": 4, "micro_batch_size": 1,
                     "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                     "max_steps": checkpoint.pop("max_steps", None)},
        "distribution": {"trainers": 1, "aggregator_shards": 2},
        "checkpoint": checkpoint,
    })  # fmt: skip


def run(
    coordinator: Coordinator, steps: int, requests: dict[int, str] | None = None
) -> list[StepClose]:
    """One trainer, four fresh batches a step; ``requests``: version -> a CheckpointRequest
    folded before that version is decided."""
    closes: list[StepClose] = []
    coordinator.fold(beat("a", T0))
    for version in range(steps):
        if requests and version + 1 in requests:
            coordinator.fold(CheckpointRequest(job_id=JOB, reason=requests[version + 1],
                                               requested_at=T0))  # fmt: skip
        epoch, first = divmod(4 * version, TRAIN)
        coordinator.fold(contrib("a", version, [batch(epoch, first + i) for i in range(4)]))
        decisions = coordinator.decide(T0)
        assert decisions.close is not None
        echo(coordinator, decisions)
        closes.append(decisions.close)
    return closes


def coordinator_for(spec: JobSpec) -> Coordinator:
    config = CoordinatorConfig(
        job_id=JOB,
        spec=spec,
        train_batches_per_epoch=TRAIN,
        eval_batches_per_epoch=0,
        dataset_samples=SAMPLES,
    )
    return Coordinator(config)


def test_steps_epoch_ends_and_the_job_end_are_checkpointed_in_that_precedence() -> None:
    closes = run(coordinator_for(job_spec(every_steps=2)), 6)
    assert [c.checkpoint for c in closes] == [
        None, "every_steps", "epoch_end", "every_steps", None, "job_end",
    ]  # fmt: skip


def test_without_every_steps_only_epoch_and_job_ends_are_checkpointed() -> None:
    closes = run(coordinator_for(job_spec()), 6)
    assert [c.checkpoint for c in closes] == [None, None, "epoch_end", None, None, "job_end"]


def test_max_steps_ends_the_job_with_a_checkpoint() -> None:
    closes = run(coordinator_for(job_spec(max_steps=2)), 2)
    assert [c.checkpoint for c in closes] == [None, "job_end"]


def test_a_request_marks_the_next_close_once() -> None:
    coordinator = coordinator_for(job_spec())
    closes = run(coordinator, 5, requests={2: "request", 5: "every_s"})
    assert [c.checkpoint for c in closes] == [None, "request", "epoch_end", None, "every_s"]


def saved(version: int, index: int, error: str | None = None) -> SliceSaved:
    ok = error is None
    return SliceSaved(
        job_id=JOB,
        version=version,
        slice_index=index,
        key=f"k{version}-{index}" if ok else "",
        size_bytes=10 if ok else 0,
        sha256="0" * 64 if ok else "",
        grads_offset=7 * index,
        error=error,
    )


def test_the_book_commits_a_version_once_every_slice_is_saved() -> None:
    closes = run(coordinator_for(job_spec(every_steps=2)), 6)
    book = CheckpointBook(job_id=JOB, num_slices=2, train_batches_per_epoch=TRAIN, started_at=T0)
    for close in closes:
        book.fold(close)
    assert sorted(book.requested) == [2, 3, 4, 6]
    book.fold(saved(2, 0))
    assert book.ready() == []
    book.fold(saved(2, 1))
    book.fold(saved(3, 0))
    book.fold(saved(3, 1, error="bucket unreachable"))
    assert book.ready() == [2] and book.failed() == [3]
    assert book.errors(3) == ["slice 1: bucket unreachable"]
    assert [(f.slice_index, f.key, f.grads_offset) for f in book.files(2)] == [
        (0, "k2-0", 0), (1, "k2-1", 7),
    ]  # fmt: skip
    # The data cursor: after v2, 8 of epoch 0's 12 train batches are in; after v3, none of 1.
    cursor, steps = book.cursors[2]
    assert (cursor.epoch, len(cursor.applied_batches), cursor.samples_trained, steps) == (
        0,
        8,
        8,
        2,
    )
    assert cursor.applied_batches == [batch(0, i) for i in range(8)]
    cursor, steps = book.cursors[3]
    assert (cursor.epoch, cursor.applied_batches, steps) == (1, [], 3)
    book.done.add(2)
    assert book.ready() == [] and book.last_unfinished() == 6
    book.floor = 3  # a restarted checkpointer found v3 committed: v3 and older are settled
    assert book.failed() == [] and book.last_unfinished() == 6


@pytest.mark.parametrize("every_s", [None, 30.0])
def test_the_timer_is_due_every_s_after_the_last_checkpoint(every_s: float | None) -> None:
    book = CheckpointBook(job_id=JOB, num_slices=1, train_batches_per_epoch=TRAIN, started_at=T0)
    assert not book.timer_due(every_s, T0 + 29)
    assert book.timer_due(every_s, T0 + 30) is (every_s is not None)
    book.timer_sent()
    assert not book.timer_due(every_s, T0 + 60)  # one request at a time
    closes = run(coordinator_for(job_spec()), 3)
    for close in closes:  # the epoch-end close at v3 is a checkpoint: the timer restarts there
        book.fold(close)
    assert not book.timer_due(every_s, closes[-1].closed_at + 29)
    assert book.timer_due(every_s, closes[-1].closed_at + 30) is (every_s is not None)


@pytest.mark.parametrize("max_steps", [None, 5])
def test_the_final_checkpoint_from_slice_0s_progress_matches_the_books(
    max_steps: int | None,
) -> None:
    """Without the control log (no checkpointer hosted the job at its end), the manifest of the
    final version comes from the job progress in its slice 0 file: the same step, trigger and
    data cursor as the fold gives; the job ends at an epoch's end, or mid-epoch by max_steps."""
    coordinator = coordinator_for(job_spec(max_steps=max_steps))
    closes = run(coordinator, max_steps or 6)
    assert coordinator.training_finished
    final = closes[-1].version
    book = CheckpointBook(job_id=JOB, num_slices=2, train_batches_per_epoch=TRAIN, started_at=T0)
    for close in closes:
        book.fold(close)
    expected = book.checkpointed(final)
    # What slice 0 saves at the final version (the coordinator's snapshot at its close).
    found = final_checkpointed(coordinator.progress_at[final], completed_at=T0 + 60)
    assert (found.version, found.step, found.trigger) == (final, expected.step, "job_end")
    assert expected.trigger == "job_end"
    assert found.data_cursor == expected.data_cursor
    assert found.asked_at == T0 + 60  # the StepClose's time is not in the file
    cursor = found.data_cursor
    if max_steps is None:
        assert (cursor.epoch, cursor.applied_batches, found.step) == (2, [], 6)
    else:  # 5 steps of 4: epoch 0's 12 batches, then 8 of epoch 1
        assert (cursor.epoch, cursor.applied_batches) == (1, [batch(1, i) for i in range(8)])
        assert (cursor.samples_trained, found.step) == (20, 5)
