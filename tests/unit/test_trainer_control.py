"""The trainer's fold of the control log, its outstanding contributions, its batch book and
the assembly of parameter versions (pure logic)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from heartbeats import heartbeat as trainer_heartbeat

from conveyor.platform.bus import Tailed
from conveyor.platform.messages import (
    AppliedContribution,
    Contribution,
    EvalResult,
    Heartbeat,
    ParamSlice,
    Rejection,
    StepClose,
    sample_ids_tensor,
)
from conveyor.services.trainer.data.batches import AckBook, BatchBook, Disposition
from conveyor.services.trainer.plane.control import Applied, ControlState, Rejected
from conveyor.services.trainer.plane.outstanding import Outstanding, Pending
from conveyor.services.trainer.plane.params import ParamAssembler, _scan, _search

JOB = "j1"
ME = "w-a"


def train(epoch: int, k: int) -> str:
    return f"{JOB}:e{epoch}:train:00000:b{k:03d}"


def evaluation(epoch: int, k: int) -> str:
    return f"{JOB}:e{epoch}:eval:00000:b{k:03d}"


def state(*, train_batches: int = 3, eval_batches: int = 2, epochs: int = 2) -> ControlState:
    return ControlState(
        worker_id=ME,
        epochs=epochs,
        train_batches_per_epoch=train_batches,
        eval_batches_per_epoch=eval_batches,
        member_timeout_s=10.0,
    )


def close(
    version: int,
    batch_ids: list[str],
    contributions: list[tuple[str, str]] = (),  # type: ignore[assignment]
    allocation: dict[str, int] | None = None,
) -> StepClose:
    return StepClose(
        job_id=JOB,
        version=version,
        contributions=[
            AppliedContribution(
                contribution_id=c, worker_id=w, base_version=version - 1, num_samples=1, staleness=0
            )
            for c, w in contributions
        ],
        batch_ids=batch_ids,
        num_samples=len(batch_ids),
        epoch=0,
        lr=0.1,
        allocation=allocation or {},
        closed_at=0.0,
    )


def heartbeat(worker: str, at: float, *, leaving: bool = False) -> Heartbeat:
    return trainer_heartbeat(JOB, worker, at=at, leaving=leaving)


# -- ControlState ---------------------------------------------------------------------------


def test_epochs_end_when_all_their_train_batches_are_applied() -> None:
    control = state()
    control.apply(close(1, [train(0, 0), train(0, 1)]))
    assert control.current_epoch == 0 and not control.epoch_ended(0)
    assert control.is_applied(train(0, 1), 0) and not control.is_applied(train(0, 2), 0)
    control.apply(close(2, [train(0, 1)]))  # a repeated id does not count twice
    assert control.current_epoch == 0 and control.applied_train_batches == 2
    control.apply(close(3, [train(0, 2)]))
    assert control.epoch_end == {0: 3} and control.current_epoch == 1
    assert control.is_applied(train(0, 0), 0)  # an ended epoch: every id is applied
    control.apply(close(4, []))  # an empty step
    assert control.version == 4 and control.steps == 3
    control.apply(close(4, [train(1, 0)]))  # a republished version is folded once
    assert not control.is_applied(train(1, 0), 1)
    control.apply(close(5, [train(1, k) for k in range(3)]))
    assert control.train_done and control.current_epoch == 2 and control.epoch_end[1] == 5


def test_eval_coverage_and_done_batches() -> None:
    control = state()
    control.apply(close(1, [train(0, k) for k in range(3)]))
    result = EvalResult(
        job_id=JOB, worker_id="w-b", epoch=0, version=1, batch_ids=[evaluation(0, 0)],
        loss_sum=1.0, correct=1, num_samples=1,
    )  # fmt: skip
    control.apply(result)
    assert control.is_done(evaluation(0, 0), 0, "eval") and not control.eval_done(0)
    assert not control.is_done(evaluation(0, 1), 0, "eval")
    control.apply(dataclasses.replace(result, batch_ids=[evaluation(0, 1)]))
    assert control.eval_done(0) and control.is_covered(evaluation(0, 5), 0)
    no_eval = state(eval_batches=0)
    no_eval.apply(close(1, [train(0, k) for k in range(3)]))
    assert no_eval.eval_done(0)


def test_outcomes_sequences_and_step_counts() -> None:
    control = state(train_batches=10)
    control.apply(
        Contribution(
            job_id=JOB, contribution_id=f"{ME}:7", worker_id=ME, base_version=0, num_samples=1,
            batch_ids=[train(0, 0)], epoch=0, sample_ids=sample_ids_tensor([0]), loss_sum=1.0,
            grad_bytes=4, sent_at=0.0,
        )
    )  # fmt: skip
    assert control.last_sequence == 7  # a restarted trainer continues at 8
    control.apply(close(1, [train(0, 0), train(0, 1)], [(f"{ME}:7", ME), ("w-b:0", "w-b")]))
    assert control.outcome(f"{ME}:7") == Applied(1) and control.outcome("w-b:0") is None
    control.apply(
        Rejection(job_id=JOB, contribution_id=f"{ME}:8", worker_id=ME, current_version=1,
                  reason="stale")
    )  # fmt: skip
    assert control.outcome(f"{ME}:8") == Rejected("stale")
    control.forget(f"{ME}:8")
    assert control.outcome(f"{ME}:8") is None
    for v in range(2, 6):
        control.apply(close(v, [train(0, v)]))
    assert (control.steps, control.applied_train_batches) == (5, 6)


def test_allocation_and_the_equal_split_before_it() -> None:
    control = state()
    now = 1000.0
    assert control.micro_batches_for(4, now) == 4  # alone
    control.apply(heartbeat("w-b", now - 1))
    control.apply(heartbeat("w-c", now - 1))
    control.apply(heartbeat("w-dead", now - 30))
    assert control.live_trainers(now) == {ME, "w-b", "w-c"}
    assert control.micro_batches_for(4, now) == 2  # 4 = 2 + 1 + 1; w-a sorts first
    control.apply(heartbeat("w-b", now, leaving=True))
    assert control.live_trainers(now) == {ME, "w-c"}
    control.apply(close(1, [], allocation={ME: 3, "w-c": 1}))
    assert control.micro_batches_for(4, now) == 3
    control.apply(close(2, [], allocation={ME: 0, "w-c": 4}))
    assert control.micro_batches_for(4, now) == 0  # its turn comes in a later allocation
    control.apply(close(3, [], allocation={"w-c": 4}))
    assert control.micro_batches_for(4, now) == 0  # a newcomer waits to be allocated


def test_the_split_before_the_first_allocation_counts_the_placed_trainers() -> None:
    control = state()
    now = 1000.0
    # The schedule placed w-b and w-c on the job; no heartbeat of theirs has come yet.
    assert control.micro_batches_for(4, now, placed=[ME, "w-b", "w-c"]) == 2  # ME sorts first
    assert control.micro_batches_for(4, now, placed=["w-b"]) == 2  # itself always counts
    control.apply(heartbeat("w-b", now - 1))
    assert control.micro_batches_for(4, now, placed=["w-c"]) == 2
    assert control.micro_batches_for(4, now) == 2  # w-b is live
    control.apply(close(1, [], allocation={ME: 3, "w-b": 1}))
    # An allocation decides alone: placed trainers it leaves out do not change the share.
    assert control.micro_batches_for(4, now, placed=[ME, "w-b", "w-c", "w-d"]) == 3


def test_more_trainers_than_micro_batches_split_before_any_allocation() -> None:
    control = state()
    now = 1000.0
    for worker in ("w-0", "w-1", "w-2"):
        control.apply(heartbeat(worker, now))
    assert control.micro_batches_for(2, now) == 0  # w-0, w-1 take the two; w-a sorts after


# -- Outstanding: the step state machine ----------------------------------------------------


def pending(cid: str, base: int, batches: list[str]) -> Pending[str]:
    return Pending(
        contribution_id=cid, base_version=base, batches=batches, num_samples=len(batches),
        loss_sum=0.0, grad_bytes=0, sent_at=0.0,
    )  # fmt: skip


def test_sync_waits_for_the_decision_then_rejects_what_the_next_version_left_out() -> None:
    control = state(train_batches=10)
    outstanding: Outstanding[str] = Outstanding(mode="sync", staleness=0)
    assert outstanding.can_start
    outstanding.add(pending(f"{ME}:0", 0, [train(0, 0)]))
    assert not outstanding.can_start and outstanding.resolve(control) == []
    control.apply(close(1, [train(0, 0)], [(f"{ME}:0", ME)]))
    [(decided, outcome)] = outstanding.resolve(control)
    assert decided.contribution_id == f"{ME}:0" and outcome == Applied(1)
    assert outstanding.can_start and control.outcome(f"{ME}:0") is None  # forgotten
    outstanding.add(pending(f"{ME}:1", 1, [train(0, 1)]))
    control.apply(close(2, [train(0, 2)], [("w-b:0", "w-b")]))  # closed without it
    [(decided, outcome)] = outstanding.resolve(control)
    assert isinstance(outcome, Rejected) and "closed without it" in outcome.reason
    with pytest.raises(ValueError, match="already outstanding"):
        outstanding.add(pending("x", 0, []))
        outstanding.add(pending("x", 0, []))


def test_ssp_allows_up_to_the_staleness_bound_outstanding() -> None:
    control = state(train_batches=10)
    outstanding: Outstanding[str] = Outstanding(mode="ssp", staleness=2)
    for k in range(3):
        assert outstanding.can_start
        outstanding.add(pending(f"{ME}:{k}", 0, [train(0, k)]))
    assert not outstanding.can_start and len(outstanding) == 3
    # A version closed with someone else's contribution decides nothing in ssp.
    control.apply(close(1, [train(0, 9)], [("w-b:0", "w-b")]))
    assert outstanding.resolve(control) == []
    control.apply(close(2, [train(0, 0)], [(f"{ME}:0", ME)]))
    control.apply(
        Rejection(job_id=JOB, contribution_id=f"{ME}:2", worker_id=ME, current_version=2,
                  reason="stale: base 0, current 3")
    )  # fmt: skip
    decided = outstanding.resolve(control)
    assert [(p.contribution_id, type(o).__name__) for p, o in decided] == [
        (f"{ME}:0", "Applied"), (f"{ME}:2", "Rejected"),
    ]  # fmt: skip
    assert outstanding.can_start and [p.contribution_id for p in outstanding] == [f"{ME}:1"]


# -- BatchBook and AckBook ------------------------------------------------------------------


@dataclass
class Item:
    batch_id: str
    epoch: int
    split: str


def item(batch_id: str) -> Item:
    _, epoch, split, _, _ = batch_id.split(":")
    return Item(batch_id, int(epoch[1:]), split)


def test_batches_are_trained_held_evaluated_or_dropped_by_the_log() -> None:
    control, book = state(), BatchBook[Item](epochs=2)
    assert book.admit(item(train(0, 0)), control) is Disposition.TRAIN
    assert book.admit(item(train(0, 0)), control) is Disposition.COPY  # redelivered
    assert book.admit(item(train(1, 0)), control) is Disposition.HOLD  # a later epoch
    assert book.admit(item(evaluation(0, 0)), control) is Disposition.HOLD  # epoch 0 not ended
    assert book.admit(item(train(2, 0)), control) is Disposition.INVALID
    assert book.admit(item(train(0, 1)), control) is Disposition.TRAIN
    control.apply(close(1, [train(0, 1)]))  # someone else applied it meanwhile
    assert book.admit(item(train(0, 1)), control) is Disposition.DONE
    first, dropped = book.next_train(control)
    assert first is not None and first.batch_id == train(0, 0) and dropped == []
    second, dropped = book.next_train(control)
    assert second is None and [d.batch_id for d in dropped] == [train(0, 1)]
    # Rejected: back to the front of the queue, minus what is applied meanwhile.
    assert book.requeue([first], control) == [] and book.queued_train == 1
    control.apply(close(2, [train(0, 0), train(0, 2)]))  # epoch 0 ends
    book.release(control)
    assert book.held == 0 and book.queued_eval == 1
    ready, dropped = book.next_train(control)
    assert ready is not None and ready.batch_id == train(1, 0)
    assert [d.batch_id for d in dropped] == [train(0, 0)]
    evaluate, _ = book.next_eval(control)
    assert evaluate is not None and evaluate.batch_id == evaluation(0, 0)


def test_batches_can_be_forgotten_by_a_predicate() -> None:
    control, book = state(), BatchBook[Item](epochs=2)
    for batch_id in (train(0, 0), train(0, 1), train(1, 0), evaluation(0, 0)):
        book.admit(item(batch_id), control)
    dropped = book.forget_if(lambda i: i.batch_id.endswith("b000"))
    assert sorted(i.batch_id for i in dropped) == sorted(
        [train(0, 0), train(1, 0), evaluation(0, 0)]
    )
    assert (book.queued_train, book.held) == (1, 0)
    # Forgotten: a later delivery of the same batch is new, not a copy.
    assert book.admit(item(train(0, 0)), control) is Disposition.TRAIN


def test_acks_wait_for_the_log() -> None:
    acked: list[str] = []
    acks: AckBook[str] = AckBook(acked.append)
    acks.add("b1", "record-1")
    acks.add("b1", "record-1-again")  # a redelivery of the same batch
    acks.add("b2", "record-2")
    assert len(acks) == 3
    assert acks.done(["b1", "unknown"]) == 2 and acked == ["record-1", "record-1-again"]
    assert acks.done(["b1"]) == 0 and len(acks) == 1
    acks.discard(["b2"])
    assert len(acks) == 0 and acked == ["record-1", "record-1-again"]


# -- ParamAssembler -------------------------------------------------------------------------


def part(index: int, version: int, values: list[float], published_at: float = 0.0) -> ParamSlice:
    return ParamSlice(
        job_id=JOB, slice_index=index, version=version,
        values=torch.tensor(values, dtype=torch.float32), published_at=published_at,
    )  # fmt: skip


def test_a_version_is_complete_once_every_slice_is_in() -> None:
    params = ParamAssembler([(0, 2), (2, 5)])
    assert params.add(part(1, 0, [3, 4, 5], 7.0), received_at=10.0) is False
    assert (params.version, params.received_at) == (None, None)
    assert params.add(part(0, 1, [9, 9], 9.0), received_at=11.0) is False
    assert params.add(part(0, 0, [1, 2], 5.0), received_at=12.0) is True
    assert params.version == 0 and params.flat is not None
    assert params.flat.tolist() == [1, 2, 3, 4, 5]
    # The stamps of the hop from the slice owners: the last publish, the completing arrival.
    assert (params.published_at, params.received_at) == (7.0, 12.0)
    assert params.add(part(1, 1, [8, 8, 8], 8.0), received_at=13.0) is True
    assert params.version == 1 and (params.published_at, params.received_at) == (9.0, 13.0)
    assert params.add(part(0, 0, [0, 0]), received_at=14.0) is False  # older: ignored
    assert params.version == 1 and params.received_at == 13.0
    with pytest.raises(ValueError, match="has 3 values"):
        params.add(part(0, 2, [1, 2, 3]), received_at=0.0)
    with pytest.raises(ValueError, match="outside"):
        params.add(part(2, 2, [1]), received_at=0.0)


class HistoryTail:
    """A params partition's history as ``TopicTail.read_at`` serves it."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = versions
        self.reads = 0

    async def read_at(self, partition: int, offset: int, timeout_s: float) -> Tailed | None:
        self.reads += 1
        if not 0 <= offset < len(self.versions):
            return None
        message = part(partition, self.versions[offset], [float(offset)])
        return Tailed(topic="p", partition=partition, offset=offset, message=message,
                      timestamp_ms=0, size_bytes=0)  # fmt: skip


@pytest.mark.parametrize(
    ("versions", "wanted", "offset"),
    [
        (list(range(40)), 27, 27),  # one record per version: the first guess
        ([0, *range(40)], 27, 28),  # version 0 published twice (two owners at the start)
        ([0, 1, 2, 3, 2, 3, 4, 5, 6], 5, 7),  # a second owner republished 2 and 3
        ([0, 1, 5, 2, 3, 4], 3, 4),  # out of order: the search misses, the scan finds it
    ],
)
async def test_a_version_is_found_in_the_params_history(
    versions: list[int], wanted: int, offset: int
) -> None:
    tail = HistoryTail(versions)
    found = await _search(tail, 0, wanted, len(versions), 1.0)  # type: ignore[arg-type]
    if found is None:
        found = await _scan(tail, 0, wanted, len(versions), 1.0)  # type: ignore[arg-type]
    assert found is not None and found.version == wanted and found.values.tolist() == [offset]
    assert await _scan(tail, 0, 99, len(versions), 1.0) is None  # type: ignore[arg-type]


def test_train_left_counts_the_epochs_batches_not_applied_yet() -> None:
    s = state(train_batches=3)
    assert (s.train_left(0), s.train_left(1)) == (3, 3)
    s.apply(close(1, [train(0, 0), train(0, 1)]))
    s.apply(close(2, [train(0, 1)]))  # a duplicate counts once
    assert (s.train_left(0), s.train_left(1)) == (1, 3)
    s.apply(close(3, [train(0, 2), train(1, 0)]))
    assert s.epoch_ended(0)
    assert (s.train_left(0), s.train_left(1)) == (0, 2)
