"""Datasets addressed by URI, all read the same way: ``open_dataset(uri).read(ids)``.

URIs (DESIGN section 6):

- ``builtin://sklearn-digits``: real 8x8 digits shipped with scikit-learn.
- ``synthetic://?n=10000&shape=3x32x32&classes=10&seed=0&cost_ms=0``: generated,
  learnable, any size; ``cost_ms`` burns CPU per sample like a heavy decoder.
- ``npz://<dir>``, ``npz://file://<dir>``, ``npz://s3://bucket/prefix``: npz shards
  plus ``manifest.json`` (write them with ``pack_source`` / ``pack_npz``).
- ``mnist-idx://<dir>``: the classic MNIST idx files in a local directory.
- ``imagefolder://<dir or s3 prefix>``: class folders of JPEG/PNG files of any size.
- ``webdataset://<dir or s3 prefix>/{000000..000127}.tar``: tar shards (``.jpg``/``.png`` +
  ``.cls`` per key); ``pack_imagefolder`` writes them from an image folder.
- ``parquet://<file or dir>?image=image&label=label``: image bytes + label columns (a Hugging
  Face image dataset's Parquet export).

- ``tokens://<file>?dtype=uint16&block_size=256&vocab_size=256``: a flat array of token ids
  cut into sequences of ``block_size + 1`` (nanoGPT's ``.bin``), for language models.

The first four are :class:`Dataset` (uint8 arrays of one shape), the image files
:class:`EncodedDataset` (encoded images of any size, decoded by the preprocessors), the token
file a :class:`TokenDataset` (int64 sequences, its "shape" ``(1, 1, block_size)``).

Opening validates cheaply and raises DatasetError with a clear reason; every
dataset's reads are thread-safe. The image decoder (``decode_image``, Pillow) lives in
:mod:`conveyor.training.datasets.images`, imported by the processes that decode, not here.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.base import (
    BadSample,
    Dataset,
    DatasetError,
    DatasetUnavailable,
    EncodedDataset,
    EncodedSample,
    ImageBatch,
    LabelBatch,
    burn_cpu,
    output_shape,
    split_uri,
)
from conveyor.training.datasets.builtin import open_builtin
from conveyor.training.datasets.idx import IdxDataset
from conveyor.training.datasets.imagefolder import ImageFolderDataset
from conveyor.training.datasets.manifest import Manifest, ShardEntry
from conveyor.training.datasets.npz import NpzDataset
from conveyor.training.datasets.pack import PackResult, load_arrays, pack_idx, pack_npz, pack_source
from conveyor.training.datasets.synthetic import SyntheticDataset, open_synthetic
from conveyor.training.datasets.tokens import TokenDataset
from conveyor.training.datasets.webdataset import WebDataset

AnyDataset = Dataset | EncodedDataset | TokenDataset
"""What ``open_dataset`` returns."""

__all__ = [
    "AnyDataset",
    "BadSample",
    "Dataset",
    "DatasetError",
    "DatasetUnavailable",
    "EncodedDataset",
    "EncodedSample",
    "IdxDataset",
    "ImageBatch",
    "ImageFolderDataset",
    "LabelBatch",
    "Manifest",
    "NpzDataset",
    "PackResult",
    "ShardEntry",
    "SyntheticDataset",
    "TokenDataset",
    "WebDataset",
    "burn_cpu",
    "known_schemes",
    "load_arrays",
    "open_array_dataset",
    "open_dataset",
    "open_tokens",
    "output_shape",
    "pack_idx",
    "pack_npz",
    "pack_source",
]

_Opener = Callable[[str, StorageSettings | None], AnyDataset]

_OPENERS: dict[str, _Opener] = {
    "builtin": lambda uri, _storage: open_builtin(uri),
    "synthetic": lambda uri, _storage: open_synthetic(uri),
    "npz": lambda uri, storage: NpzDataset(uri, storage=storage),
    "mnist-idx": lambda uri, _storage: IdxDataset(uri),
    "imagefolder": lambda uri, storage: ImageFolderDataset(uri, storage=storage),
    "webdataset": lambda uri, storage: WebDataset(uri, storage=storage),
    "parquet": lambda uri, storage: _open_parquet(uri, storage),
    "tokens": lambda uri, storage: TokenDataset(uri, storage=storage),
}


def _open_parquet(uri: str, storage: StorageSettings | None) -> EncodedDataset:
    # pyarrow is imported by parquet:// jobs only: at module level it cost every service process
    # most of a second of CPU at start, on machines where few jobs read Parquet.
    from conveyor.training.datasets.parquet import ParquetDataset

    return ParquetDataset(uri, storage=storage)


def known_schemes() -> list[str]:
    """The URI schemes ``open_dataset`` understands."""
    return sorted(_OPENERS)


def open_dataset(uri: str, *, storage: StorageSettings | None = None) -> AnyDataset:
    """Open the dataset named by ``uri``; ``storage`` supplies S3 endpoint and keys.

    Raises DatasetError (unknown scheme, bad parameters, missing or corrupt
    files, empty dataset) or DatasetUnavailable (retriable storage failure).
    Opening is cheap (for npz: the manifest and the first shard; for image files: a listing,
    a manifest or the files' footers); reads validate what they load.
    """
    scheme, _ = split_uri(uri)
    opener = _OPENERS.get(scheme)
    if opener is None:
        raise DatasetError(
            f"unknown dataset scheme {scheme!r} in {uri!r} (known: {', '.join(known_schemes())})"
        )
    return opener(uri, storage)


def open_array_dataset(uri: str, *, storage: StorageSettings | None = None) -> Dataset:
    """``open_dataset`` for callers that need uint8 arrays of one shape (``Dataset.read``);
    DatasetError for image files, which only the preprocessors decode and resize."""
    dataset = open_dataset(uri, storage=storage)
    if not isinstance(dataset, Dataset):
        raise DatasetError(f"{uri}: images of any size are decoded by the preprocessors only")
    return dataset


def open_tokens(uri: str, *, storage: StorageSettings | None = None) -> TokenDataset:
    """Open ``tokens://<file>?dtype=..&block_size=..``; DatasetError as ``open_dataset``."""
    scheme, _ = split_uri(uri)
    if scheme != "tokens":
        raise DatasetError(f"{uri}: not a tokens:// uri")
    return TokenDataset(uri, storage=storage)
