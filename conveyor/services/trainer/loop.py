"""Epoch ordering and deduplication of a job's batches (pure bookkeeping, no torch, no I/O).

Batches arrive in any order, possibly twice (at-least-once transport, restarts). The rules:

- Epoch ``e``'s train batches are applied before any of epoch ``e + 1``: a later epoch's
  batches wait in a holding buffer (bounded by the sharder's lead).
- When all of epoch ``e``'s train batches are applied, its train part closes and its eval part
  opens: the eval batches of ``e`` are evaluated (on a snapshot of the parameters taken at that
  moment) while epoch ``e + 1`` trains. Eval batches of ``e`` that arrive earlier wait.
- A batch id seen before (applied, evaluated, or waiting) is a duplicate; so is any batch of a
  part that is closed. Only ids of open parts are remembered, so the state stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Disposition(Enum):
    """What to do with a batch now."""

    TRAIN = "train"
    """Apply it: it belongs to the epoch being trained and was never applied."""
    EVAL = "eval"
    """Evaluate it on its epoch's snapshot."""
    HOLD = "hold"
    """Keep it until its epoch (or its epoch's eval) opens."""
    DUPLICATE = "duplicate"
    """Its effect is already in the state (or it already waits): drop it."""
    INVALID = "invalid"
    """Its epoch is outside the job: drop it."""


@dataclass(kw_only=True, slots=True)
class ScheduleState:
    """What a checkpoint must keep of the schedule to resume it."""

    train_epoch: int = 0
    """The epoch whose train batches are being applied (== epochs once all are)."""
    trained: set[str] = field(default_factory=set)
    """Ids of the train batches of ``train_epoch`` applied so far."""
    eval_open: dict[int, set[str]] = field(default_factory=dict)
    """Epochs whose train part closed but whose eval did not -> eval batch ids done."""

    def to_json(self) -> dict[str, Any]:
        return {
            "train_epoch": self.train_epoch,
            "trained": sorted(self.trained),
            "eval_open": {str(e): sorted(ids) for e, ids in self.eval_open.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScheduleState:
        return cls(
            train_epoch=int(data["train_epoch"]),
            trained=set(data["trained"]),
            eval_open={int(e): set(ids) for e, ids in data["eval_open"].items()},
        )


class Schedule(Generic[T]):
    """The ordering and dedup rules over one job; items of type ``T`` wait in the buffer."""

    def __init__(
        self,
        *,
        epochs: int,
        train_batches_per_epoch: int,
        eval_batches_per_epoch: int,
        state: ScheduleState | None = None,
    ) -> None:
        if epochs < 1 or train_batches_per_epoch < 1 or eval_batches_per_epoch < 0:
            raise ValueError("epochs and train batches per epoch must be >= 1, eval >= 0")
        self.epochs = epochs
        self.train_batches_per_epoch = train_batches_per_epoch
        self.eval_batches_per_epoch = eval_batches_per_epoch
        self.state = state or ScheduleState()
        self._held: dict[str, tuple[int, str, T]] = {}

    @property
    def train_epoch(self) -> int:
        return self.state.train_epoch

    @property
    def held(self) -> int:
        """Batches waiting in the holding buffer."""
        return len(self._held)

    @property
    def train_done(self) -> bool:
        """Every epoch's train batches are applied."""
        return self.state.train_epoch >= self.epochs

    @property
    def done(self) -> bool:
        """Every epoch is trained and evaluated."""
        return self.train_done and not self.state.eval_open

    @property
    def epochs_completed(self) -> int:
        """Epochs trained and evaluated."""
        return self.state.train_epoch - len(self.state.eval_open)

    def classify(self, batch_id: str, epoch: int, split: str) -> Disposition:
        """The disposition of a batch arriving now."""
        if batch_id in self._held:
            return Disposition.DUPLICATE
        return self._classify(batch_id, epoch, split)

    def _classify(self, batch_id: str, epoch: int, split: str) -> Disposition:
        state = self.state
        if not 0 <= epoch < self.epochs or split not in ("train", "eval"):
            return Disposition.INVALID
        if split == "train":
            if epoch > state.train_epoch:
                return Disposition.HOLD
            if epoch < state.train_epoch or batch_id in state.trained:
                return Disposition.DUPLICATE
            return Disposition.TRAIN
        if epoch >= state.train_epoch:
            return Disposition.HOLD
        evaluated = state.eval_open.get(epoch)
        if evaluated is None or batch_id in evaluated:
            return Disposition.DUPLICATE
        return Disposition.EVAL

    def hold(self, batch_id: str, epoch: int, split: str, item: T) -> None:
        """Keep ``item`` until :meth:`take_ready` hands it back."""
        self._held[batch_id] = (epoch, split, item)

    def take_ready(self) -> list[T]:
        """Held items that no longer have to wait, in arrival order (removed from the buffer)."""
        ready = [
            batch_id
            for batch_id, (epoch, split, _) in self._held.items()
            if self._classify(batch_id, epoch, split) is not Disposition.HOLD
        ]
        return [self._held.pop(batch_id)[2] for batch_id in ready]

    def mark_trained(self, batch_id: str) -> bool:
        """Record a train batch of ``train_epoch`` as applied; True when it was the epoch's last."""
        self.state.trained.add(batch_id)
        return len(self.state.trained) >= self.train_batches_per_epoch

    def close_train_epoch(self) -> int:
        """Close ``train_epoch``'s train part, open its eval part; returns that epoch.

        An epoch without eval batches is complete at once (its eval part never opens).
        """
        state = self.state
        epoch = state.train_epoch
        if self.eval_batches_per_epoch > 0:
            state.eval_open[epoch] = set()
        state.train_epoch += 1
        state.trained = set()
        return epoch

    def mark_evaluated(self, epoch: int, batch_id: str) -> bool:
        """Record an eval batch of an open epoch; True (and the part closes) when it was the
        epoch's last."""
        evaluated = self.state.eval_open[epoch]
        evaluated.add(batch_id)
        if len(evaluated) < self.eval_batches_per_epoch:
            return False
        del self.state.eval_open[epoch]
        return True
