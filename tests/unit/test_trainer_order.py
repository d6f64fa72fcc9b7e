"""Deterministic mode's order of consumption (pure folds): whatever order the batches arrive
in, each step takes the same micro-batches in plan order, also after a resume or a rejection;
the default mode keeps arrival order."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from conveyor.platform.messages import AppliedContribution, ResumePoint, StepClose
from conveyor.services.trainer.data.batches import BatchBook
from conveyor.services.trainer.data.order import PlanOrder, batch_seed
from conveyor.services.trainer.plane.control import ControlState

JOB = "j1"
PER_SHARD = 3
TRAIN = 8  # shards of 3, 3 and 2 batches: only the last shard is short
STEP = 3  # micro-batches per step: steps of 3, 3 and the epoch's last 2
EPOCHS = 2


@dataclass(frozen=True)
class Item:
    batch_id: str
    epoch: int
    split: str = "train"


def order() -> PlanOrder:
    return PlanOrder(job_id=JOB, batches_per_shard=PER_SHARD, train_batches=TRAIN)


def epoch_items(epoch: int) -> list[Item]:
    """The epoch's train batches in plan order."""
    return [Item(order().batch_id(epoch, rank), epoch) for rank in range(TRAIN)]


def control() -> ControlState:
    return ControlState(worker_id="w", epochs=EPOCHS, train_batches_per_epoch=TRAIN,
                        eval_batches_per_epoch=0, member_timeout_s=10.0)  # fmt: skip


def close(version: int, batch_ids: list[str]) -> StepClose:
    return StepClose(
        job_id=JOB, version=version, batch_ids=batch_ids, num_samples=len(batch_ids), epoch=0,
        lr=0.1, allocation={}, closed_at=0.0,
        contributions=[AppliedContribution(contribution_id=f"w:{version}", worker_id="w",
                                           base_version=version - 1, num_samples=1, staleness=0)],
    )  # fmt: skip


def next_train(book: BatchBook[Item], log: ControlState) -> Item:
    """The next batch to train, which the test has put in the book."""
    item, _ = book.next_train(log)
    assert item is not None
    return item


def train(arrivals: list[Item], log: ControlState, book: BatchBook[Item]) -> list[list[str]]:
    """A one-trainer sync run: batches are delivered one at a time in ``arrivals`` order; each
    step gathers up to STEP batches from the book (fewer once the rest of the epoch is in
    hand: the runner's rule) and its close is folded. Returns each step's batch ids."""
    steps: list[list[str]] = []
    pending = list(arrivals)
    gathered: list[str] = []
    while not log.train_done:
        item, _ = book.next_train(log)
        if item is not None:
            gathered.append(item.batch_id)
        elif pending:
            book.admit(pending.pop(0), log)
            continue
        in_hand = bool(gathered) and log.train_left(log.current_epoch) <= len(gathered)
        if len(gathered) == STEP or in_hand:
            log.apply(close(log.version + 1, gathered))
            book.finish(gathered)
            book.release(log)
            steps.append(gathered)
            gathered = []
        elif item is None:
            raise AssertionError(f"stuck: {steps}, gathered {gathered}")
    return steps


def plan_steps(epochs: range) -> list[list[str]]:
    ids = [[item.batch_id for item in epoch_items(e)] for e in epochs]
    return [batch[i : i + STEP] for batch in ids for i in range(0, TRAIN, STEP)]


@pytest.mark.parametrize("seed", range(20))
def test_steps_take_the_same_batches_in_plan_order_whatever_the_arrival_order(seed: int) -> None:
    arrivals = epoch_items(0) + epoch_items(1)
    random.Random(seed).shuffle(arrivals)  # the next epoch's batches too: held, then ordered
    steps = train(arrivals, control(), BatchBook(epochs=EPOCHS, order=order()))
    assert steps == plan_steps(range(EPOCHS))


def test_the_default_mode_keeps_arrival_order() -> None:
    arrivals = list(reversed(epoch_items(0)))
    log, book = control(), BatchBook[Item](epochs=EPOCHS)
    for item in arrivals:
        book.admit(item, log)
    taken = [book.next_train(log)[0] for _ in range(TRAIN)]
    assert taken == arrivals


def test_a_resumed_trainer_starts_at_the_first_batch_not_applied() -> None:
    """The applied prefix comes from the ResumePoint; the sharder sends only what is left, and
    the steps after it are those of the straight run."""
    applied = [item.batch_id for item in epoch_items(0)[:STEP]]
    log = control()
    log.apply(ResumePoint(job_id=JOB, version=1, steps=1, samples_trained=STEP,
                          ended_epochs=[], applied_batches=applied))  # fmt: skip
    rest = epoch_items(0)[STEP:] + epoch_items(1)
    random.Random(7).shuffle(rest)
    steps = train(rest, log, BatchBook(epochs=EPOCHS, order=order()))
    assert steps == plan_steps(range(EPOCHS))[1:]


def test_a_rejected_steps_batches_are_taken_again_first() -> None:
    log, book = control(), BatchBook[Item](epochs=EPOCHS, order=order())
    items = epoch_items(0)
    for item in reversed(items):
        book.admit(item, log)
    first = [next_train(book, log) for _ in range(STEP)]
    assert first == items[:STEP]
    book.requeue(first, log)  # the contribution was rejected: recomputed on newer parameters
    assert [book.next_train(log)[0] for _ in range(STEP)] == items[:STEP]


def test_a_missing_batch_is_waited_for_while_later_ones_queue() -> None:
    log, book = control(), BatchBook[Item](epochs=EPOCHS, order=order())
    items = epoch_items(0)
    for item in items[1:]:
        book.admit(item, log)
    assert book.next_train(log) == (None, [])
    assert book.queued_train == TRAIN - 1
    book.admit(items[0], log)
    assert [book.next_train(log)[0] for _ in range(2)] == items[:2]


def test_plan_ranks_follow_shard_then_position() -> None:
    plan = order()
    assert [plan.rank(plan.batch_id(0, r)) for r in range(TRAIN)] == list(range(TRAIN))
    assert plan.batch_id(1, 4) == f"{JOB}:e1:train:00001:b001"
    for bad in ("other:e0:train:00000:b000", f"{JOB}:e0:eval:00000:b000",
                f"{JOB}:e0:train:00002:b002", "nonsense"):  # fmt: skip
        with pytest.raises(ValueError):
            plan.rank(bad)


def test_batch_seeds_depend_on_the_seed_and_plan_place_not_the_job() -> None:
    seeds = {batch_seed(0, f"{JOB}:e{e}:train:00000:b00{p}") for e in range(2) for p in range(3)}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert batch_seed(0, "a:e0:train:00000:b001") == batch_seed(0, "b:e0:train:00000:b001")
    assert batch_seed(0, "a:e0:train:00000:b001") != batch_seed(1, "a:e0:train:00000:b001")
