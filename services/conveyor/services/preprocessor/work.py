"""The preprocessor's CPU work, pure and synchronous: shard task -> ready :class:`Batch` messages.

``read_shard`` reads the task's samples (one ``Dataset.read`` for the whole shard, or one
``EncodedDataset.read_encoded`` for image files), ``make_batches`` decodes image files (to the
job's ``preprocess.channels``; straight to the output size when the first op sizes, see
``Augmenter.apply_encoded``), augments and sizes the images (randomness keyed by job seed,
epoch and sample id; evaluation shards get the deterministic ops only, see ``augment.py``) and
cuts them into micro-batches of ``micro_batch_size`` positions of the task's order. Token
sequences (``tokens://``) are cut the same way into int32 inputs and int64 next-token targets,
with no image work. The batch
at position ``k`` of shard ``s`` is ``batch_id_for(s, k)``; the same task always yields the
same ids, samples, pixels and labels, whichever process runs it and however often.

A sample that fails validation (the reader's :class:`BadSample`, or an image that does not
decode) is left out of its batch and reported in :attr:`ShardOutput.bad`; the service counts
them against the job's ``dataset.max_bad_samples``. A micro-batch left with no sample fails
the shard (DatasetError): a batch carries at least one sample. Callers run these functions in
a worker thread (they take milliseconds to seconds).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.messages import Batch, ShardTask, batch_id_for
from conveyor.services.preprocessor.augment import Augmenter, build_augmenter
from conveyor.training.datasets import (
    AnyDataset,
    BadSample,
    Dataset,
    DatasetError,
    EncodedSample,
    ImageBatch,
    LabelBatch,
    TokenDataset,
)
from conveyor.training.datasets.base import DEFAULT_CHANNELS
from conveyor.training.datasets.images import BadImage, EncodedImage

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True, slots=True)
class ShardSamples:
    """What :func:`read_shard` read, with when (unix seconds): arrays, or encoded images."""

    x: ImageBatch | list[EncodedSample] | NDArray[np.int64]
    """uint8 [N, C, H, W] in the task's sample order, the readable encoded samples in that
    order (the bad ones left out), or int64 [N, T + 1] token sequences."""
    y: LabelBatch
    """int64 [N], the labels of ``x`` (empty for token sequences: their targets are in x)."""
    read_start: float
    read_end: float
    bad: list[BadSample]
    """Samples the reader found bad."""


@dataclass(frozen=True, slots=True)
class ShardOutput:
    """What :func:`make_batches` made of a shard."""

    batches: list[Batch]
    """The task's batches in order (ids as :func:`batch_ids`)."""
    bad: list[BadSample]
    """Samples left out (read or decode failures), by sample id."""


def augmenter_for(preprocess: Mapping[str, Any]) -> Augmenter:
    """The augmenter of a job spec's preprocess section; ValueError for a bad op list."""
    specs = preprocess.get("augment") or []
    if not isinstance(specs, list) or not all(isinstance(spec, dict) for spec in specs):
        raise ValueError(f"preprocess.augment must be a list of mappings, got {specs!r}")
    return build_augmenter(specs, image_size=preprocess.get("image_size"))


def batch_ids(task: ShardTask) -> list[str]:
    """Ids of the batches ``task`` makes, in order."""
    count = -(-len(task.sample_ids) // task.micro_batch_size)
    return [batch_id_for(task.shard_id, k) for k in range(count)]


def read_shard(dataset: AnyDataset, task: ShardTask) -> ShardSamples:
    """Read the task's samples. DatasetError when the task has none or the dataset fails."""
    if not task.sample_ids:
        raise DatasetError(f"shard {task.shard_id} has no samples")
    read_start = time.time()
    if isinstance(dataset, TokenDataset):
        tokens = dataset.read(task.sample_ids)  # [N,T+1] int64
        no_labels = np.empty(0, dtype=np.int64)
        return ShardSamples(x=tokens, y=no_labels, read_start=read_start, read_end=time.time(),
                            bad=[])  # fmt: skip
    if isinstance(dataset, Dataset):
        x, y = dataset.read(task.sample_ids)  # [N,C,H,W] uint8, [N] int64
        return ShardSamples(x=x, y=y, read_start=read_start, read_end=time.time(), bad=[])
    encoded, bad = dataset.read_encoded(task.sample_ids)
    labels = np.array([sample.label for sample in encoded], dtype=np.int64)  # [N']
    return ShardSamples(x=encoded, y=labels, read_start=read_start, read_end=time.time(), bad=bad)


def _parse(
    encoded: list[EncodedSample], channels: int
) -> tuple[list[EncodedImage], list[int], list[BadSample]]:
    """Read each sample's image header; returns the images, their positions in ``encoded``
    and the bad (unknown format, too many pixels)."""
    images, kept, bad = [], [], []
    for position, sample in enumerate(encoded):
        try:
            images.append(EncodedImage.parse(sample.data, channels=channels))
        except BadImage as exc:
            bad.append(BadSample(sample_id=sample.sample_id, source=sample.source, reason=str(exc)))
            continue
        kept.append(position)
    return images, kept, bad


def make_batches(task: ShardTask, samples: ShardSamples, augmenter: Augmenter) -> ShardOutput:
    """Decode, augment and collate ``samples`` into the task's batches (timestamps: released,
    read_start, read_end, augment_end; the sender adds ``sent``). DatasetError when a
    micro-batch has no sample left."""
    if task.split == "eval":
        augmenter = augmenter.for_eval()
    bad = list(samples.bad)
    x: NDArray[Any]
    if isinstance(samples.x, np.ndarray) and samples.x.dtype == np.int64:
        ids = list(task.sample_ids)
        x = samples.x[:, :-1].astype(np.int32)  # [N,T] inputs (TokenDataset keeps ids < 2^31)
        y = np.ascontiguousarray(samples.x[:, 1:])  # [N,T] int64 next-token targets
    elif isinstance(samples.x, np.ndarray):
        ids = list(task.sample_ids)
        images = cast(ImageBatch, samples.x)  # uint8: the token case is above
        x = augmenter.apply(images, ids, seed=task.seed, epoch=task.epoch)  # [N,C,H,W]
        y = np.array(samples.y, dtype=np.int64)  # [N], a private copy
    else:
        channels = int(task.preprocess.get("channels") or DEFAULT_CHANNELS)
        parsed, kept, parse_bad = _parse(samples.x, channels)
        bad.extend(parse_bad)
        outcome = augmenter.apply_encoded(
            parsed, [samples.x[p].sample_id for p in kept], seed=task.seed, epoch=task.epoch
        )
        for position, reason in outcome.bad:
            sample = samples.x[kept[position]]
            bad.append(BadSample(sample_id=sample.sample_id, source=sample.source, reason=reason))
        kept = [kept[position] for position in outcome.kept]
        ids = [samples.x[position].sample_id for position in kept]
        x = outcome.x  # [N',C,H,W]
        y = np.array(samples.y[kept], dtype=np.int64)  # [N']
    # Batches become views of one array: contiguous, so each batch's rows are one run of bytes.
    if not x.flags.c_contiguous:
        x = np.array(x, order="C")  # [N,C,H,W]
    augment_end = time.time()
    timestamps = {"read_start": samples.read_start, "read_end": samples.read_end}
    if task.released_at > 0:
        timestamps["released"] = task.released_at
    timestamps["augment_end"] = augment_end
    bad.sort(key=lambda b: b.sample_id)
    # Row r of x holds sample ids[r]; batch k takes the rows of its positions' samples.
    size = task.micro_batch_size
    position_of = {sample_id: p for p, sample_id in enumerate(task.sample_ids)}
    batch_of_row = np.array([position_of[i] // size for i in ids], dtype=np.int64)  # [N']
    bounds = np.searchsorted(batch_of_row, np.arange(len(batch_ids(task)) + 1))
    batches = []
    for k, batch_id in enumerate(batch_ids(task)):
        start, end = int(bounds[k]), int(bounds[k + 1])
        if start == end:
            raise DatasetError(
                f"shard {task.shard_id}: every sample of micro-batch {k} is bad "
                f"({'; '.join(str(b) for b in bad[:3])})"
            )
        batches.append(
            Batch(
                job_id=task.job_id,
                batch_id=batch_id,
                shard_id=task.shard_id,
                epoch=task.epoch,
                split=task.split,
                sample_ids=ids[start:end],
                # numpy, sent as tensors (see Batch): the preprocessors never load torch.
                x=cast("Tensor", x[start:end]),  # [B,C,H,W] uint8 or [B,T] int32
                y=cast("Tensor", y[start:end]),  # [B] or [B,T] int64
                timestamps=dict(timestamps),
            )
        )
    return ShardOutput(batches=batches, bad=bad)


def process_shard(dataset: AnyDataset, task: ShardTask, augmenter: Augmenter) -> ShardOutput:
    """:func:`read_shard` then :func:`make_batches`."""
    return make_batches(task, read_shard(dataset, task), augmenter)
