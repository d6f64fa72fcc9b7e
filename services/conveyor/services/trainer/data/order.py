"""Deterministic mode's order of consumption (``distribution.deterministic``; pure: no torch, no
I/O).

A step's gradient is a floating-point sum over its micro-batches, so bit-exact training needs
every step to take the same micro-batches in the same order, whatever order the preprocessors
published them in and however often the job was killed and resumed. The rule: within an
epoch, the train batches are taken in *plan order* (shard index, then position in the shard:
the order of the epoch's permutation), each step takes the next ``micro_batches_per_step`` of
them (fewer only at the epoch's end), and a batch that has not arrived yet is waited for while
later ones queue behind it. Since shards are cut from the epoch's order in whole micro-batches
and only the last shard of a split may be short, the plan rank of a batch follows from its id
alone: ``shard_index * batches_per_shard + position``.

:class:`PlanQueue` is the trainer's train queue in that order (the arrival-order queue is
:class:`ArrivalQueue`); both serve :class:`~.batches.BatchBook`.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from conveyor.platform.messages import batch_id_for, shard_id_for
from conveyor.training.plan import parse_batch_id


class TrainItem(Protocol):
    @property
    def batch_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...


class AppliedLog(Protocol):
    """What the queues ask the control fold (:class:`~..plane.control.ControlState`)."""

    @property
    def current_epoch(self) -> int: ...
    def is_applied(self, batch_id: str, epoch: int) -> bool: ...


T = TypeVar("T", bound=TrainItem)


def batch_seed(seed: int, batch_id: str) -> int:
    """The torch seed of one micro-batch's forward/backward in deterministic mode: a stable
    63-bit hash of the job seed and the batch's place in the plan (epoch, split, shard,
    position; not the job id, so a second job of the same spec draws the same numbers), so
    dropout and any other randomness of the model is the same however the job was
    interrupted: nothing to restore from a checkpoint. ValueError for a malformed id."""
    ref = parse_batch_id(batch_id)
    key = f"{seed}:{ref.epoch}:{ref.split}:{ref.shard_index}:{ref.position}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PlanOrder:
    """Plan ranks of one job's train batches (module docstring)."""

    def __init__(self, *, job_id: str, batches_per_shard: int, train_batches: int) -> None:
        if batches_per_shard < 1 or train_batches < 1:
            raise ValueError(
                f"batches_per_shard and train_batches must be >= 1, got {batches_per_shard}, "
                f"{train_batches}"
            )
        self.job_id = job_id
        self.batches_per_shard = batches_per_shard
        self.train_batches = train_batches
        """Train micro-batches of one epoch (ranks ``0 .. train_batches - 1``)."""

    def rank(self, batch_id: str) -> int:
        """The position of a train batch in its epoch's plan order. ValueError for a batch id
        that is malformed, of another job, or not a train batch of the plan."""
        ref = parse_batch_id(batch_id)
        rank = ref.shard_index * self.batches_per_shard + ref.position
        if ref.job_id != self.job_id or ref.split != "train" or rank >= self.train_batches:
            raise ValueError(f"{batch_id!r} is not a train batch of job {self.job_id!r}")
        return rank

    def batch_id(self, epoch: int, rank: int) -> str:
        """The id of the train batch at ``rank`` of ``epoch``."""
        if not 0 <= rank < self.train_batches:
            raise ValueError(f"rank {rank} outside [0, {self.train_batches})")
        shard, position = divmod(rank, self.batches_per_shard)
        return batch_id_for(shard_id_for(self.job_id, epoch, "train", shard), position)


class ArrivalQueue(Generic[T]):
    """Train batches in the order they arrived (the default mode): the next is the oldest one
    not applied meanwhile."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def push(self, item: T) -> None:
        self._items.append(item)

    def push_front(self, item: T) -> None:
        self._items.appendleft(item)

    def pop(self, log: AppliedLog) -> tuple[T | None, list[T]]:
        """(the next batch or None, the queued ones found applied meanwhile — dropped)."""
        dropped: list[T] = []
        while self._items:
            item = self._items.popleft()
            if log.is_applied(item.batch_id, item.epoch):
                dropped.append(item)
                continue
            return item, dropped
        return None, dropped

    def done(self, batch_ids: set[str]) -> None:
        """Arrival order keeps no record of what it handed out."""

    def remove_if(self, predicate: Callable[[T], bool]) -> None:
        self._items = deque(item for item in self._items if not predicate(item))


class PlanQueue(Generic[T]):
    """Train batches taken in plan order (module docstring): the next is the lowest-ranked
    train batch of the current epoch that is neither applied nor handed out; None while that
    one has not arrived, even when later ones have."""

    def __init__(self, order: PlanOrder) -> None:
        self.order = order
        self._items: dict[str, T] = {}
        self._out: set[str] = set()
        """Handed out by :meth:`pop`, not applied or given back yet (this step's gathered
        batches, the outstanding contribution's)."""
        self._epoch = 0
        self._applied_below = 0
        """Ranks below it are applied in ``_epoch`` (where the scan starts)."""

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def push(self, item: T) -> None:
        self._items[item.batch_id] = item

    def push_front(self, item: T) -> None:
        """A batch given back (its contribution was rejected): its rank decides, not the end."""
        self._out.discard(item.batch_id)
        self._items[item.batch_id] = item

    def pop(self, log: AppliedLog) -> tuple[T | None, list[T]]:
        """(the next batch in plan order or None, queued batches found applied — dropped)."""
        dropped = self._move_to(log.current_epoch)
        epoch, order = self._epoch, self.order
        rank, contiguous = self._applied_below, True
        while rank < order.train_batches:
            batch_id = order.batch_id(epoch, rank)
            if log.is_applied(batch_id, epoch):
                if (item := self._items.pop(batch_id, None)) is not None:
                    dropped.append(item)
                self._out.discard(batch_id)
                if contiguous:
                    self._applied_below = rank + 1
            elif batch_id in self._out:
                contiguous = False
            else:
                item = self._items.pop(batch_id, None)
                if item is not None:
                    self._out.add(batch_id)
                return item, dropped
            rank += 1
        return None, dropped

    def done(self, batch_ids: set[str]) -> None:
        """These batches are applied (or dropped): no longer handed out."""
        self._out -= batch_ids

    def remove_if(self, predicate: Callable[[T], bool]) -> None:
        self._items = {k: item for k, item in self._items.items() if not predicate(item)}

    def _move_to(self, epoch: int) -> list[T]:
        """Start the scan over in a new epoch; batches of ended epochs are all applied."""
        if epoch == self._epoch:
            return []
        self._epoch, self._applied_below = epoch, 0
        self._out.clear()
        ended = [item for item in self._items.values() if item.epoch < epoch]
        self._items = {k: item for k, item in self._items.items() if item.epoch >= epoch}
        return ended
