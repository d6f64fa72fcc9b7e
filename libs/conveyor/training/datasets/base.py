"""The dataset contracts every source implements, their error type and shared helpers.

Two kinds of datasets, both fixed, indexable sets of labelled images whose global sample ids
run from 0 to ``num_samples - 1``:

- :class:`Dataset` (arrays: builtin, synthetic, npz, idx): every image has the same shape and
  ``read(ids)`` returns uint8 images ``[N,C,H,W]`` and int64 labels ``[N]`` in the order asked;
- :class:`EncodedDataset` (image files: imagefolder, webdataset, parquet): images are encoded
  (JPEG, PNG) and of any size; ``read_encoded(ids)`` returns their bytes and labels, and the
  samples that fail validation as :class:`BadSample` (skipped and counted, not raised).
  Decoding and bringing them to the job's fixed shape is the preprocessors' work.

Normalisation never happens here: images stay uint8 until they reach the trainer's device.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import parse_qsl

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.errors import ConveyorError

if TYPE_CHECKING:
    from conveyor.training.datasets.tokens import TokenDataset

ImageBatch = NDArray[np.uint8]
"""uint8 images ``[N, C, H, W]``."""
LabelBatch = NDArray[np.int64]
"""int64 class ids ``[N]``, each in ``[0, num_classes)``."""


class DatasetError(ConveyorError):
    """A dataset cannot be opened or read: bad URI, missing/corrupt file, bad shape or label."""


class DatasetUnavailable(DatasetError):
    """The dataset's storage failed in a way that may pass (network, throttling); retry later."""

    retriable: ClassVar[bool] = True


class Dataset(ABC):
    """A readable, thread-safe image classification dataset.

    Attributes are fixed at open time: ``uri`` (as given to ``open_dataset``),
    ``num_samples``, ``sample_shape`` ``(C, H, W)`` and ``num_classes``.
    """

    def __init__(
        self, *, uri: str, num_samples: int, sample_shape: tuple[int, int, int], num_classes: int
    ) -> None:
        if num_samples <= 0:
            raise DatasetError(f"{uri}: dataset is empty")
        if len(sample_shape) != 3 or min(sample_shape) <= 0:
            raise DatasetError(
                f"{uri}: sample shape must be 3 positive dims (C,H,W), got {sample_shape}"
            )
        if num_classes <= 0:
            raise DatasetError(f"{uri}: num_classes must be positive, got {num_classes}")
        self.uri = uri
        self.num_samples = num_samples
        self.sample_shape = sample_shape
        self.num_classes = num_classes

    def read(
        self, sample_ids: Sequence[int] | NDArray[np.integer]
    ) -> tuple[ImageBatch, LabelBatch]:
        """Return ``(x uint8 [N,C,H,W], y int64 [N])`` for ``sample_ids``, in that order.

        Raises ``DatasetError`` for an id outside ``[0, num_samples)`` or data that
        fails validation (bad shard, label out of range), ``DatasetUnavailable``
        when storage fails transiently. Safe to call from several threads.
        """
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)  # [N]
        if ids.size == 0:
            return (
                np.empty((0, *self.sample_shape), dtype=np.uint8),
                np.empty((0,), dtype=np.int64),
            )
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_samples:
            bad = low if low < 0 else high
            raise DatasetError(f"{self.uri}: sample id {bad} out of range [0, {self.num_samples})")
        x, y = self._read(ids)
        if y.size and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            bad_label = int(y.min()) if int(y.min()) < 0 else int(y.max())
            raise DatasetError(
                f"{self.uri}: label {bad_label} out of range [0, {self.num_classes})"
            )
        return x, y

    @abstractmethod
    def _read(self, ids: NDArray[np.int64]) -> tuple[ImageBatch, LabelBatch]:
        """Read valid, non-empty ids ``[N]``; the caller checks ranges and labels."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(uri={self.uri!r}, num_samples={self.num_samples}, "
            f"sample_shape={self.sample_shape}, num_classes={self.num_classes})"
        )


@dataclass(frozen=True, slots=True)
class EncodedSample:
    """One encoded image and its label, as stored."""

    sample_id: int
    """Global sample id."""
    label: int
    """Class id in ``[0, num_classes)``."""
    data: bytes
    """The image file's bytes (JPEG or PNG)."""
    source: str
    """Where it was read from, for messages (``file:///d/cat/1.jpg``, ``s3://b/p/0.tar:k.jpg``)."""


@dataclass(frozen=True, slots=True)
class BadSample:
    """A sample that failed validation and is skipped; ``str()`` gives ``source: reason``."""

    sample_id: int
    """Global sample id."""
    source: str
    """The file (and member or row) it came from."""
    reason: str
    """What is wrong with it (corrupt image, bad tar member, wrong column type...)."""

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
"""File name endings of image files (compared in lower case). Here, not beside the decoder in
``images``, so that listing image files does not load Pillow into every service."""


class EncodedDataset(ABC):
    """A readable, thread-safe dataset of labelled encoded images of any size.

    Attributes are fixed at open time: ``uri``, ``num_samples`` and ``num_classes``. Opening
    lists and counts; it reads no image.
    """

    def __init__(self, *, uri: str, num_samples: int, num_classes: int) -> None:
        if num_samples <= 0:
            raise DatasetError(f"{uri}: dataset is empty")
        if num_classes <= 0:
            raise DatasetError(f"{uri}: num_classes must be positive, got {num_classes}")
        self.uri = uri
        self.num_samples = num_samples
        self.num_classes = num_classes

    def read_encoded(
        self, sample_ids: Sequence[int] | NDArray[np.integer]
    ) -> tuple[list[EncodedSample], list[BadSample]]:
        """The samples of ``sample_ids`` that are readable, in the order asked, and those that
        are not (a missing label, a bad tar member, a label out of range...), each once.

        Raises ``DatasetError`` for an id outside ``[0, num_samples)`` or a failure that is
        not one sample's (an unreadable shard or file footer), ``DatasetUnavailable`` when
        storage fails transiently. Safe to call from several threads.
        """
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)  # [N]
        if ids.size == 0:
            return [], []
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_samples:
            bad = low if low < 0 else high
            raise DatasetError(f"{self.uri}: sample id {bad} out of range [0, {self.num_samples})")
        good, bad_samples = self._read_encoded(ids)
        kept: list[EncodedSample] = []
        for sample in good:
            if 0 <= sample.label < self.num_classes:
                kept.append(sample)
            else:
                bad_samples.append(
                    BadSample(
                        sample_id=sample.sample_id,
                        source=sample.source,
                        reason=f"label {sample.label} out of range [0, {self.num_classes})",
                    )
                )
        return kept, bad_samples

    @abstractmethod
    def _read_encoded(self, ids: NDArray[np.int64]) -> tuple[list[EncodedSample], list[BadSample]]:
        """Read valid, non-empty ids ``[N]`` in order; the caller checks id ranges and labels."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(uri={self.uri!r}, num_samples={self.num_samples}, "
            f"num_classes={self.num_classes})"
        )


DEFAULT_CHANNELS = 3
"""Channels encoded images are decoded to unless the job says otherwise (RGB)."""


def output_shape(
    dataset: Dataset | EncodedDataset | TokenDataset,
    *,
    image_size: Sequence[int] | None,
    channels: int | None,
) -> tuple[int, int, int]:
    """``(C, H, W)`` of the samples a job's batches carry: ``image_size`` (H, W) when given,
    else an array dataset's own; ``channels`` for encoded images (default 3), an array
    dataset's own otherwise; ``(1, 1, block_size)`` for token sequences. DatasetError for
    encoded images without ``image_size`` (they have no common size) and for ``channels``
    other than an array dataset's."""
    if isinstance(dataset, EncodedDataset):
        if image_size is None:
            raise DatasetError(
                f"{dataset.uri}: images of any size need preprocess.image_size [H, W], the "
                f"shape the preprocessors bring them to"
            )
        return (channels or DEFAULT_CHANNELS, int(image_size[0]), int(image_size[1]))
    c, h, w = dataset.sample_shape
    if channels is not None and channels != c:
        raise DatasetError(
            f"{dataset.uri}: preprocess.channels={channels} but the dataset's images have {c}; "
            f"channels converts decoded image files only"
        )
    if image_size is None:
        return (c, h, w)
    return (c, int(image_size[0]), int(image_size[1]))


def split_uri(uri: str) -> tuple[str, str]:
    """Split ``scheme://rest`` into ``(scheme, rest)``; DatasetError when there is no scheme."""
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme:
        raise DatasetError(f"dataset uri {uri!r} has no scheme (expected scheme://...)")
    return scheme, rest


def parse_query(uri: str, query: str, known: Sequence[str]) -> dict[str, str]:
    """Parse ``a=1&b=2``; DatasetError on duplicates, blanks or keys outside ``known``."""
    params: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in known:
            raise DatasetError(f"{uri}: unknown parameter {key!r} (known: {', '.join(known)})")
        if key in params:
            raise DatasetError(f"{uri}: parameter {key!r} given twice")
        if not value:
            raise DatasetError(f"{uri}: parameter {key!r} has no value")
        params[key] = value
    return params


_BURN_CHUNK = bytes(range(256)) * 64  # 16 KiB: ~10 us of hashing between clock reads


def burn_cpu(duration_ms: float) -> None:
    """Spend ``duration_ms`` of this thread's CPU time hashing (a stand-in for decoding).

    Measured with the thread's CPU clock, not wall time, so a contended machine
    still pays the full cost, as it would with a real decoder. Hashing large
    buffers releases the GIL, like real image decoders do.
    """
    if duration_ms <= 0:
        return
    deadline = time.thread_time() + duration_ms / 1000.0
    digest = hashlib.sha256()
    while time.thread_time() < deadline:
        digest.update(_BURN_CHUNK)
