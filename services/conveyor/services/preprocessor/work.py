"""The preprocessor's CPU work, pure and synchronous: shard task -> ready :class:`Batch` messages.

``read_shard`` reads the task's samples (one ``Dataset.read`` for the whole shard),
``make_batches`` augments them (randomness keyed by job seed, epoch and sample id) and cuts
them into micro-batches of ``micro_batch_size`` rows in the task's order. The batch at position
``k`` of shard ``s`` is ``batch_id_for(s, k)``; the same task always yields the same ids,
samples, pixels and labels, whichever process runs it and however often. Callers run these
functions in a worker thread (they take milliseconds to seconds).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from conveyor.platform.messages import Batch, ShardTask, batch_id_for
from conveyor.services.preprocessor.augment import Augmenter, build_augmenter
from conveyor.training.datasets import Dataset, DatasetError, ImageBatch, LabelBatch


@dataclass(frozen=True, slots=True)
class ShardSamples:
    """What :func:`read_shard` read, with when (unix seconds)."""

    x: ImageBatch
    """uint8 [N, C, H, W] in the task's sample order."""
    y: LabelBatch
    """int64 [N]."""
    read_start: float
    read_end: float


def augmenter_for(preprocess: Mapping[str, Any]) -> Augmenter:
    """The augmenter of a job spec's preprocess section; ValueError for a bad op list."""
    specs = preprocess.get("augment") or []
    if not isinstance(specs, list) or not all(isinstance(spec, dict) for spec in specs):
        raise ValueError(f"preprocess.augment must be a list of mappings, got {specs!r}")
    return build_augmenter(specs)


def batch_ids(task: ShardTask) -> list[str]:
    """Ids of the batches ``task`` makes, in order."""
    count = -(-len(task.sample_ids) // task.micro_batch_size)
    return [batch_id_for(task.shard_id, k) for k in range(count)]


def read_shard(dataset: Dataset, task: ShardTask) -> ShardSamples:
    """Read the task's samples. DatasetError when the task has none or the dataset fails."""
    if not task.sample_ids:
        raise DatasetError(f"shard {task.shard_id} has no samples")
    read_start = time.time()
    x, y = dataset.read(task.sample_ids)  # [N,C,H,W] uint8, [N] int64
    return ShardSamples(x=x, y=y, read_start=read_start, read_end=time.time())


def make_batches(task: ShardTask, samples: ShardSamples, augmenter: Augmenter) -> list[Batch]:
    """Augment and collate ``samples`` into the task's batches (timestamps: released,
    read_start, read_end, augment_end; the sender adds ``sent``)."""
    x = augmenter.apply(samples.x, task.sample_ids, seed=task.seed, epoch=task.epoch)
    # Batches become views of one array; torch wants it contiguous and writable.
    if not (x.flags.c_contiguous and x.flags.writeable):
        x = np.array(x, order="C")  # [N,C,H,W]
    y = np.array(samples.y, dtype=np.int64)  # [N], a private copy
    augment_end = time.time()
    timestamps = {"read_start": samples.read_start, "read_end": samples.read_end}
    if task.released_at > 0:
        timestamps["released"] = task.released_at
    timestamps["augment_end"] = augment_end
    size = task.micro_batch_size
    x_all, y_all = torch.from_numpy(x), torch.from_numpy(y)
    return [
        Batch(
            job_id=task.job_id,
            batch_id=batch_id,
            shard_id=task.shard_id,
            epoch=task.epoch,
            split=task.split,
            sample_ids=task.sample_ids[k * size : (k + 1) * size],
            x=x_all[k * size : (k + 1) * size],  # [B,C,H,W] uint8
            y=y_all[k * size : (k + 1) * size],  # [B] int64
            timestamps=dict(timestamps),
        )
        for k, batch_id in enumerate(batch_ids(task))
    ]


def process_shard(dataset: Dataset, task: ShardTask, augmenter: Augmenter) -> list[Batch]:
    """:func:`read_shard` then :func:`make_batches`."""
    return make_batches(task, read_shard(dataset, task), augmenter)
