"""Pure planning of a job's data: train/eval split, per-epoch order, shards, release sequence.

Everything here is a function of (number of samples, eval fraction, seed, epochs, micro-batch
size, shard size), so a restarted sharder computes exactly the same plan:

- Split: ``np.random.default_rng(seed).permutation(num_samples)``; the first
  ``floor(num_samples * eval_fraction)`` ids are the eval set, the rest the train set (each
  kept in ascending id order).
- Train order of epoch ``e``: the train ids permuted by ``np.random.default_rng([seed, e])``.
  Eval order: ascending ids, the same every epoch.
- Shards: consecutive runs of ``shard_size`` samples of a split's order (``shard_size`` is a
  multiple of the micro-batch size, so a shard holds whole micro-batches; only the last shard
  of a split may be short, and only its last micro-batch).
- Release sequence: for each epoch, its train shards in order, then its eval shards. Task ``k``
  of the sequence is ``epoch = k // tasks_per_epoch`` and position ``k % tasks_per_epoch``.
- Batch ids (``<job>:e<epoch>:<split>:<shard index>:b<position>``) name their samples:
  :func:`parse_batch_id` and :meth:`JobPlan.batch_sample_ids` map one back without a lookup
  table (the epoch bookkeeping of trainers and coordinator; the job's sample ledger is
  counted from the sample ids the trainers computed on, not from these).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.messages import SPLITS, shard_id_for
from conveyor.training.jobspec import JobSpec

Ids = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard task of the release sequence."""

    shard_id: str
    """``<job_id>:e<epoch>:<split>:<index:05d>``."""
    epoch: int
    """Epoch number, from 0."""
    split: str
    """``"train"`` or ``"eval"``."""
    index: int
    """Position within the split of the epoch, from 0."""
    sample_ids: list[int]
    """Global sample ids in batching order."""
    num_batches: int
    """Micro-batches the shard makes (the last one may be short)."""


@dataclass(frozen=True, slots=True)
class BatchRef:
    """The parts of a batch id."""

    job_id: str
    epoch: int
    split: str
    """``"train"`` or ``"eval"``."""
    shard_index: int
    """Index of the shard within the split of the epoch."""
    position: int
    """Position of the batch within its shard."""


def parse_batch_id(batch_id: str) -> BatchRef:
    """Split ``<job>:e<epoch>:<split>:<index:05d>:b<position:03d>``; ValueError otherwise."""
    parts = batch_id.rsplit(":", 4)
    if len(parts) != 5:
        raise ValueError(f"not a batch id: {batch_id!r}")
    job_id, epoch, split, index, position = parts
    if (
        not job_id
        or split not in SPLITS
        or epoch[:1] != "e"
        or position[:1] != "b"
        or not (epoch[1:].isdigit() and index.isdigit() and position[1:].isdigit())
    ):
        raise ValueError(f"not a batch id: {batch_id!r}")
    return BatchRef(
        job_id=job_id,
        epoch=int(epoch[1:]),
        split=split,
        shard_index=int(index),
        position=int(position[1:]),
    )


def split_ids(num_samples: int, eval_fraction: float, seed: int) -> tuple[Ids, Ids]:
    """(train ids, eval ids), each ascending; see the module docstring. ValueError for
    arguments out of range."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    permutation = np.random.default_rng(seed).permutation(num_samples)  # [N]
    num_eval = int(num_samples * eval_fraction)  # < num_samples: training data never empty
    eval_ids = np.sort(permutation[:num_eval]).astype(np.int64)
    train_ids = np.sort(permutation[num_eval:]).astype(np.int64)
    return train_ids, eval_ids


def epoch_order(train_ids: Ids, seed: int, epoch: int) -> Ids:
    """The train ids in epoch ``epoch``'s order (``default_rng([seed, epoch])`` permutation)."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return train_ids[np.random.default_rng([seed, epoch]).permutation(train_ids.size)]


def _shard_batches(num_ids: int, shard_size: int, micro_batch_size: int) -> list[int]:
    """Micro-batches of each shard of a split of ``num_ids`` samples."""
    sizes = [shard_size] * (num_ids // shard_size)
    if num_ids % shard_size:
        sizes.append(num_ids % shard_size)
    return [math.ceil(size / micro_batch_size) for size in sizes]


class JobPlan:
    """The deterministic data plan of one job (see the module docstring).

    Raises ValueError for inconsistent arguments (a shard size that is not a multiple of the
    micro-batch size, epochs < 1, no samples).
    """

    __slots__ = (
        "_epoch_cache",
        "_prefix",
        "epochs",
        "eval_ids",
        "job_id",
        "micro_batch_size",
        "seed",
        "shard_size",
        "train_ids",
        "train_shards_per_epoch",
    )

    def __init__(
        self,
        *,
        job_id: str,
        num_samples: int,
        eval_fraction: float,
        seed: int,
        epochs: int,
        micro_batch_size: int,
        shard_size: int,
    ) -> None:
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if micro_batch_size < 1 or shard_size < 1 or shard_size % micro_batch_size:
            raise ValueError(
                f"shard_size ({shard_size}) must be a positive multiple of "
                f"micro_batch_size ({micro_batch_size})"
            )
        self.job_id = job_id
        self.seed = seed
        self.epochs = epochs
        self.micro_batch_size = micro_batch_size
        self.shard_size = shard_size
        self.train_ids, self.eval_ids = split_ids(num_samples, eval_fraction, seed)
        train = _shard_batches(self.train_ids.size, shard_size, micro_batch_size)
        evaluation = _shard_batches(self.eval_ids.size, shard_size, micro_batch_size)
        self.train_shards_per_epoch = len(train)
        # _prefix[j] = batches in the epoch's tasks 0..j-1 (train shards, then eval shards).
        self._prefix: list[int] = [0]
        for batches in train + evaluation:
            self._prefix.append(self._prefix[-1] + batches)
        self._epoch_cache: tuple[int, Ids] | None = None

    @classmethod
    def from_spec(cls, job_id: str, spec: JobSpec, num_samples: int) -> JobPlan:
        """The plan of ``spec`` over a dataset of ``num_samples`` samples."""
        return cls(
            job_id=job_id,
            num_samples=num_samples,
            eval_fraction=spec.dataset.eval_fraction,
            seed=spec.training.seed,
            epochs=spec.training.epochs,
            micro_batch_size=spec.training.micro_batch_size,
            shard_size=spec.shard_size,
        )

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_train(self) -> int:
        return int(self.train_ids.size)

    @property
    def num_eval(self) -> int:
        return int(self.eval_ids.size)

    @property
    def tasks_per_epoch(self) -> int:
        """Train shards plus eval shards of one epoch."""
        return len(self._prefix) - 1

    @property
    def eval_shards_per_epoch(self) -> int:
        return self.tasks_per_epoch - self.train_shards_per_epoch

    @property
    def train_batches_per_epoch(self) -> int:
        return self._prefix[self.train_shards_per_epoch]

    @property
    def eval_batches_per_epoch(self) -> int:
        return self._prefix[-1] - self.train_batches_per_epoch

    @property
    def batches_per_epoch(self) -> int:
        return self._prefix[-1]

    @property
    def max_shard_batches(self) -> int:
        """Micro-batches of the largest shard (``shard_size / micro_batch_size``)."""
        return self.shard_size // self.micro_batch_size

    @property
    def num_tasks(self) -> int:
        """Length of the release sequence (every epoch)."""
        return self.epochs * self.tasks_per_epoch

    def steps_per_epoch(self, micro_batches_per_step: int) -> int:
        """Optimizer steps per epoch; a trailing partial step counts as one."""
        return math.ceil(self.train_batches_per_epoch / micro_batches_per_step)

    # -- release sequence ----------------------------------------------------------------

    def batches_before(self, task_index: int) -> int:
        """Batches in tasks ``0..task_index-1`` of the release sequence (0 <= index <= num)."""
        if not 0 <= task_index <= self.num_tasks:
            raise ValueError(f"task index {task_index} outside [0, {self.num_tasks}]")
        epoch, position = divmod(task_index, self.tasks_per_epoch)
        return epoch * self.batches_per_epoch + self._prefix[position]

    def first_unconsumed_task(self, consumed_batches: int) -> int:
        """The first task ``k`` with ``batches_before(k + 1) > consumed_batches``: the tasks
        before it hold no more batches than were consumed, so they were all released
        (``num_tasks`` when every batch was consumed)."""
        if consumed_batches <= 0:
            return 0
        epoch, within = divmod(consumed_batches, self.batches_per_epoch)
        if epoch >= self.epochs:
            return self.num_tasks
        # bisect_right: the first position whose end (prefix[j + 1]) exceeds `within`.
        low, high = 0, self.tasks_per_epoch
        while low < high:
            middle = (low + high) // 2
            if self._prefix[middle + 1] > within:
                high = middle
            else:
                low = middle + 1
        return epoch * self.tasks_per_epoch + low

    def task(self, task_index: int) -> Shard:
        """Task ``task_index`` of the release sequence."""
        if not 0 <= task_index < self.num_tasks:
            raise ValueError(f"task index {task_index} outside [0, {self.num_tasks})")
        epoch, position = divmod(task_index, self.tasks_per_epoch)
        if position < self.train_shards_per_epoch:
            split, index, order = "train", position, self.train_order(epoch)
        else:
            split, index, order = "eval", position - self.train_shards_per_epoch, self.eval_ids
        ids = order[index * self.shard_size : (index + 1) * self.shard_size]
        return Shard(
            shard_id=shard_id_for(self.job_id, epoch, split, index),
            epoch=epoch,
            split=split,
            index=index,
            sample_ids=ids.tolist(),
            num_batches=self._prefix[position + 1] - self._prefix[position],
        )

    def batch_sample_ids(self, batch_id: str) -> list[int]:
        """Sample ids of batch ``batch_id`` of this job, in row order. ValueError for an id of
        another job or outside the plan."""
        ref = parse_batch_id(batch_id)
        if ref.job_id != self.job_id:
            raise ValueError(f"batch {batch_id!r} is not of job {self.job_id!r}")
        if not 0 <= ref.epoch < self.epochs:
            raise ValueError(f"batch {batch_id!r}: epoch outside [0, {self.epochs})")
        shards = self.train_shards_per_epoch if ref.split == "train" else self.eval_shards_per_epoch
        if ref.shard_index >= shards:
            raise ValueError(f"batch {batch_id!r}: no shard {ref.shard_index} in {ref.split}")
        order = self.train_order(ref.epoch) if ref.split == "train" else self.eval_ids
        start = ref.shard_index * self.shard_size + ref.position * self.micro_batch_size
        stop = min(start + self.micro_batch_size, (ref.shard_index + 1) * self.shard_size)
        ids = order[start:stop]
        if ref.position >= self.max_shard_batches or ids.size == 0:
            raise ValueError(f"batch {batch_id!r}: no batch {ref.position} in its shard")
        return [int(i) for i in ids.tolist()]

    def epoch_shards(self, epoch: int) -> list[Shard]:
        """Every task of ``epoch`` in release order (train shards, then eval shards)."""
        first = epoch * self.tasks_per_epoch
        return [self.task(k) for k in range(first, first + self.tasks_per_epoch)]

    def train_order(self, epoch: int) -> Ids:
        """Train ids in ``epoch``'s order; the latest epoch's order is cached."""
        if epoch < 0 or epoch >= self.epochs:
            raise ValueError(f"epoch {epoch} outside [0, {self.epochs})")
        cached = self._epoch_cache
        if cached is None or cached[0] != epoch:
            cached = (epoch, epoch_order(self.train_ids, self.seed, epoch))
            self._epoch_cache = cached
        return cached[1]
