"""``npz://<location>``: a directory or S3 prefix of ``.npz`` shards plus ``manifest.json``.

``<location>`` is a local directory (``npz:///data/digits``, ``npz://./data``),
``npz://file:///abs/dir`` or ``npz://s3://bucket/prefix`` (one S3 form: the
object-store URI nested after ``npz://``; endpoint and keys come from
StorageSettings). All I/O goes through ``conveyor.platform.storage``.

Layout::

    manifest.json   {"format": "conveyor-npz", "version": 1, "num_samples": N,
                     "num_classes": K, "sample_shape": [C, H, W],
                     "shards": [{"file": "shard-00000.npz", "num_samples": n, "sha256": hex}]}
    shard-*.npz     x: uint8 [n, H, W] (C == 1) or [n, C, H, W];  y: integer [n] in [0, K)

Sample ids are global: shard ``s`` holds ids ``[sum(n_<s), sum(n_<=s))``. Each
shard's sha256 is verified when it is loaded; loaded shards live in a bounded
LRU cache shared by the threads reading the dataset.
"""

from __future__ import annotations

import io
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.base import Dataset, DatasetError, ImageBatch, LabelBatch, split_uri
from conveyor.training.datasets.location import open_location, read_object
from conveyor.training.datasets.manifest import MANIFEST_FILE, Manifest, ShardEntry, read_manifest

DEFAULT_CACHE_BYTES = 512 * 2**20
"""Default bound of the shard cache (the most recent shard is kept even if larger)."""


@dataclass(slots=True, frozen=True)
class _Shard:
    x: ImageBatch  # [n,C,H,W]
    y: LabelBatch  # [n]

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.y.nbytes)


def decode_shard(data: bytes, entry: ShardEntry, manifest: Manifest, where: str) -> _Shard:
    """Parse and validate one shard's bytes against its manifest entry."""
    name = f"{where}/{entry.file}"
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            missing = {"x", "y"} - set(npz.files)
            if missing:
                raise DatasetError(
                    f"shard {name} lacks array(s) {sorted(missing)} (has {sorted(npz.files)})"
                )
            x = npz["x"]
            y = npz["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"shard {name} is not a readable .npz file: {exc}") from exc
    c, h, w = manifest.sample_shape
    if x.dtype != np.uint8:
        raise DatasetError(f"shard {name}: x has dtype {x.dtype}, expected uint8")
    stored_shape = x.shape
    if x.ndim == 3 and c == 1:
        x = x[:, None]  # [n,H,W] -> [n,1,H,W]
    if x.shape != (entry.num_samples, c, h, w):
        raise DatasetError(
            f"shard {name}: x has shape {stored_shape}, expected "
            f"{(entry.num_samples, c, h, w)} (manifest sample_shape {[c, h, w]})"
        )
    if y.shape != (entry.num_samples,) or not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(
            f"shard {name}: y has shape {y.shape} dtype {y.dtype}, "
            f"expected integer [{entry.num_samples}]"
        )
    y = y.astype(np.int64, copy=False)
    if y.size and (int(y.min()) < 0 or int(y.max()) >= manifest.num_classes):
        raise DatasetError(
            f"shard {name}: labels span [{int(y.min())}, {int(y.max())}], "
            f"outside [0, {manifest.num_classes})"
        )
    x.setflags(write=False)
    y.setflags(write=False)
    return _Shard(x=x, y=y)


class _ShardCache:
    """Bounded LRU of decoded shards; concurrent misses on one shard load it once."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Shard] = OrderedDict()
        self._bytes = 0
        self._pending: dict[int, Future[_Shard]] = {}

    def get(self, index: int, load: Callable[[int], _Shard]) -> _Shard:
        with self._lock:
            shard = self._entries.get(index)
            if shard is not None:
                self._entries.move_to_end(index)
                return shard
            pending = self._pending.get(index)
            owner = pending is None
            if pending is None:
                pending = self._pending[index] = Future()
        if not owner:
            return pending.result()  # the owner always resolves it, so this cannot hang
        try:
            shard = load(index)
        except BaseException as exc:
            with self._lock:
                del self._pending[index]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[index]
            self._entries[index] = shard
            self._bytes += shard.nbytes
            while self._bytes > self._max_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
        pending.set_result(shard)
        return shard


class NpzDataset(Dataset):
    """Sharded npz dataset; see the module docstring."""

    def __init__(
        self,
        uri: str,
        *,
        storage: StorageSettings | None = None,
        max_cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        _, location = split_uri(uri)
        self._store, self._where = open_location(uri, location, storage)
        self.manifest = read_manifest(self._store, self._where)
        m = self.manifest
        super().__init__(
            uri=uri,
            num_samples=m.num_samples,
            sample_shape=m.sample_shape,
            num_classes=m.num_classes,
        )
        sizes = np.array([s.num_samples for s in m.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # [S] first id per shard
        self._cache = _ShardCache(max_cache_bytes)
        self._shard(0)  # cheap validation at open: the first shard's bytes, shapes, labels

    def _load(self, index: int) -> _Shard:
        entry = self.manifest.shards[index]
        data = read_object(self._store, self._where, entry.file, expected_sha256=entry.sha256)
        return decode_shard(data, entry, self.manifest, self._where)

    def _shard(self, index: int) -> _Shard:
        return self._cache.get(index, self._load)

    def _read(self, ids: NDArray[np.int64]) -> tuple[ImageBatch, LabelBatch]:
        x = np.empty((ids.size, *self.sample_shape), dtype=np.uint8)  # [N,C,H,W]
        y = np.empty((ids.size,), dtype=np.int64)  # [N]
        shard_of = np.searchsorted(self._starts, ids, side="right") - 1  # [N]
        for index in np.unique(shard_of).tolist():
            rows = np.flatnonzero(shard_of == index)
            local = ids[rows] - self._starts[index]
            shard = self._shard(index)
            x[rows] = shard.x[local]
            y[rows] = shard.y[local]
        return x, y


__all__ = ["MANIFEST_FILE", "Manifest", "NpzDataset", "ShardEntry"]
