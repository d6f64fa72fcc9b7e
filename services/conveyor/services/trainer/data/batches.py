"""Where each delivered batch stands in one trainer (pure bookkeeping: no torch, no I/O).

Batches arrive in any order and possibly more than once (at-least-once transport, group
rebalances). Against the control log (:class:`ControlState`) a delivered batch is:

- done: applied (train) or covered (eval) already -> acknowledge it, drop it;
- a copy: the same batch id is in memory here already -> keep only its delivery, acknowledged
  together with the first one when the batch is done;
- train of the current epoch -> queued to be trained (in arrival order, or in plan order in
  deterministic mode: :mod:`.order`);
- train of a later epoch, or eval of an epoch that has not ended -> held until it has;
- eval of an ended epoch -> queued to be evaluated on that epoch's end-of-epoch parameters;
- outside the job (an epoch beyond it) -> acknowledged and dropped.

A record is acknowledged only once the control log shows its effect (see :class:`AckBook`),
so a trainer that dies loses nothing: its unacknowledged batches are redelivered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Generic, Protocol, TypeVar

from conveyor.services.trainer.data.order import ArrivalQueue, PlanOrder, PlanQueue
from conveyor.services.trainer.plane.control import ControlState


class BatchLike(Protocol):
    @property
    def batch_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def split(self) -> str: ...


T = TypeVar("T", bound=BatchLike)
R = TypeVar("R")


class Disposition(Enum):
    """What became of a delivered batch."""

    TRAIN = "train"
    EVAL = "eval"
    HOLD = "hold"
    DONE = "done"
    COPY = "copy"
    INVALID = "invalid"


class BatchBook(Generic[T]):
    """Batches in memory: queued to train, held, or queued to evaluate. ``order``: train
    batches are taken in that plan order (deterministic mode), else as they arrived."""

    def __init__(self, *, epochs: int, order: PlanOrder | None = None) -> None:
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.epochs = epochs
        self._known: set[str] = set()
        self._train: ArrivalQueue[T] | PlanQueue[T] = (
            ArrivalQueue() if order is None else PlanQueue(order)
        )
        self._eval: deque[T] = deque()
        self._held: dict[str, T] = {}

    @property
    def queued_train(self) -> int:
        return len(self._train)

    @property
    def queued_eval(self) -> int:
        return len(self._eval)

    @property
    def held(self) -> int:
        return len(self._held)

    def admit(self, item: T, control: ControlState) -> Disposition:
        """Place a delivered batch (see the module docstring)."""
        if not 0 <= item.epoch < self.epochs or item.split not in ("train", "eval"):
            return Disposition.INVALID
        if control.is_done(item.batch_id, item.epoch, item.split):
            return Disposition.DONE
        if item.batch_id in self._known:
            return Disposition.COPY
        self._known.add(item.batch_id)
        return self._place(item, control)

    def _place(self, item: T, control: ControlState) -> Disposition:
        if item.split == "train":
            if item.epoch == control.current_epoch:
                self._train.push(item)
                return Disposition.TRAIN
        elif control.epoch_ended(item.epoch):
            self._eval.append(item)
            return Disposition.EVAL
        self._held[item.batch_id] = item
        return Disposition.HOLD

    def release(self, control: ControlState) -> None:
        """Queue held batches whose wait is over (call after the log moved on)."""
        held, self._held = self._held, {}
        for item in held.values():
            self._place(item, control)

    def next_train(self, control: ControlState) -> tuple[T | None, list[T]]:
        """(the next batch to train or None, the queued ones found done meanwhile — dropped).
        In plan order, None also while the next batch in that order has not arrived."""
        item, dropped = self._train.pop(control)
        self._known.difference_update(d.batch_id for d in dropped)
        return item, dropped

    def next_eval(self, control: ControlState) -> tuple[T | None, list[T]]:
        """(the next batch to evaluate or None, the queued ones found covered — dropped)."""
        dropped: list[T] = []
        while self._eval:
            item = self._eval.popleft()
            if control.is_covered(item.batch_id, item.epoch):
                self._known.discard(item.batch_id)
                dropped.append(item)
                continue
            return item, dropped
        return None, dropped

    def requeue(self, items: Iterable[T], control: ControlState) -> list[T]:
        """Put a rejected contribution's batches back at the front of the train queue; returns
        the ones that are done meanwhile (dropped)."""
        dropped: list[T] = []
        for item in reversed(list(items)):
            if control.is_done(item.batch_id, item.epoch, item.split):
                self._known.discard(item.batch_id)
                dropped.append(item)
            elif item.epoch == control.current_epoch:
                self._train.push_front(item)
            else:
                self._held[item.batch_id] = item
        return dropped

    def forget_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Drop every queued or held batch for which ``predicate`` is true (e.g. its partition
        moved to another trainer, which gets it again); returns them."""
        dropped = [item for item in (*self._train, *self._eval, *self._held.values())
                   if predicate(item)]  # fmt: skip
        if dropped:
            ids = {item.batch_id for item in dropped}
            self._train.remove_if(lambda item: item.batch_id in ids)
            self._train.done(ids)
            self._eval = deque(item for item in self._eval if item.batch_id not in ids)
            self._held = {k: v for k, v in self._held.items() if k not in ids}
            self._known -= ids
        return dropped

    def finish(self, batch_ids: Iterable[str]) -> None:
        """Forget batches whose effect is on the log (applied or evaluated)."""
        ids = set(batch_ids)
        self._known -= ids
        self._train.done(ids)


class AckBook(Generic[R]):
    """Deliveries (records) per batch id, acknowledged when the log shows the batch done."""

    def __init__(self, ack: Callable[[R], None]) -> None:
        self._ack = ack
        self._records: dict[str, list[R]] = {}

    def __len__(self) -> int:
        return sum(len(records) for records in self._records.values())

    def add(self, batch_id: str, record: R) -> None:
        self._records.setdefault(batch_id, []).append(record)

    def discard(self, batch_ids: Iterable[str]) -> None:
        """Forget the deliveries of ``batch_ids`` without acknowledging them."""
        for batch_id in batch_ids:
            self._records.pop(batch_id, None)

    def done(self, batch_ids: Iterable[str]) -> int:
        """Acknowledge every delivery of ``batch_ids``; returns how many records."""
        count = 0
        for batch_id in batch_ids:
            for record in self._records.pop(batch_id, ()):
                self._ack(record)
                count += 1
        return count
