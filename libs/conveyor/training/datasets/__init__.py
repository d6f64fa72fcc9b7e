"""Datasets addressed by URI, all read the same way: ``open_dataset(uri).read(ids)``.

URIs (DESIGN section 6):

- ``builtin://sklearn-digits``: real 8x8 digits shipped with scikit-learn.
- ``synthetic://?n=10000&shape=3x32x32&classes=10&seed=0&cost_ms=0``: generated,
  learnable, any size; ``cost_ms`` burns CPU per sample like a heavy decoder.
- ``npz://<dir>``, ``npz://file://<dir>``, ``npz://s3://bucket/prefix``: npz shards
  plus ``manifest.json`` (write them with ``pack_source`` / ``pack_npz``).
- ``mnist-idx://<dir>``: the classic MNIST idx files in a local directory.

Opening validates cheaply and raises DatasetError with a clear reason; every
dataset's ``read`` is thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.base import (
    Dataset,
    DatasetError,
    DatasetUnavailable,
    ImageBatch,
    LabelBatch,
    burn_cpu,
    split_uri,
)
from conveyor.training.datasets.builtin import open_builtin
from conveyor.training.datasets.idx import IdxDataset
from conveyor.training.datasets.manifest import Manifest, ShardEntry
from conveyor.training.datasets.npz import NpzDataset
from conveyor.training.datasets.pack import PackResult, load_arrays, pack_idx, pack_npz, pack_source
from conveyor.training.datasets.synthetic import SyntheticDataset, open_synthetic

__all__ = [
    "Dataset",
    "DatasetError",
    "DatasetUnavailable",
    "IdxDataset",
    "ImageBatch",
    "LabelBatch",
    "Manifest",
    "NpzDataset",
    "PackResult",
    "ShardEntry",
    "SyntheticDataset",
    "burn_cpu",
    "known_schemes",
    "load_arrays",
    "open_dataset",
    "pack_idx",
    "pack_npz",
    "pack_source",
]

_Opener = Callable[[str, StorageSettings | None], Dataset]

_OPENERS: dict[str, _Opener] = {
    "builtin": lambda uri, _storage: open_builtin(uri),
    "synthetic": lambda uri, _storage: open_synthetic(uri),
    "npz": lambda uri, storage: NpzDataset(uri, storage=storage),
    "mnist-idx": lambda uri, _storage: IdxDataset(uri),
}


def known_schemes() -> list[str]:
    """The URI schemes ``open_dataset`` understands."""
    return sorted(_OPENERS)


def open_dataset(uri: str, *, storage: StorageSettings | None = None) -> Dataset:
    """Open the dataset named by ``uri``; ``storage`` supplies S3 endpoint and keys.

    Raises DatasetError (unknown scheme, bad parameters, missing or corrupt
    files, empty dataset) or DatasetUnavailable (retriable storage failure).
    Opening is cheap (for npz: the manifest and the first shard); reads validate
    what they load.
    """
    scheme, _ = split_uri(uri)
    opener = _OPENERS.get(scheme)
    if opener is None:
        raise DatasetError(
            f"unknown dataset scheme {scheme!r} in {uri!r} (known: {', '.join(known_schemes())})"
        )
    return opener(uri, storage)
