"""Write npz datasets (see ``npz.py`` for the layout) from arrays or idx files.

Shards are written first, ``manifest.json`` last: a reader either sees the
complete new dataset or no manifest (an interrupted pack is invisible).
Destinations: a local directory, ``file://<dir>``, ``s3://bucket/prefix``, or
any of these behind ``npz://``. ``pack_source`` is the entry point of
``conveyor dataset pack``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import open_store
from conveyor.training.datasets.idx import IdxDataset
from conveyor.training.datasets.location import store_uri_for
from conveyor.training.datasets.manifest import MANIFEST_FILE, Manifest, ShardEntry

DEFAULT_SHARD_SIZE = 4096

PackProgress = Callable[[int, int], None]
"""Called as a pack goes: (samples packed so far, samples in all)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PackResult:
    """What a pack wrote."""

    uri: str
    """Dataset URI to put in a job spec (``npz:///abs/dir`` or ``npz://s3://bucket/prefix``)."""
    manifest: Manifest
    """The manifest written last."""


def pack_npz(
    x: NDArray[np.uint8],
    y: NDArray[np.integer],
    dest: str,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    num_classes: int | None = None,
    storage: StorageSettings | None = None,
    overwrite: bool = False,
    progress: PackProgress | None = None,
) -> PackResult:
    """Write ``x`` uint8 ``[N,H,W]``/``[N,C,H,W]`` and ``y`` integer ``[N]`` as npz shards.

    ``num_classes`` defaults to ``max(y) + 1``. ValueError for bad arrays or
    options, or when ``dest`` already holds a manifest and not ``overwrite``;
    StorageError (from ``conveyor.platform.storage``) when writing fails. With
    ``overwrite``, shard files of the previous pack that the new manifest does
    not name are deleted after the manifest is written. ``progress`` is called
    after each shard is written.
    """
    x4 = _check_arrays(x, y)
    labels = np.asarray(y, dtype=np.int64)
    max_label = int(labels.max())
    if int(labels.min()) < 0:
        raise ValueError(f"labels must be >= 0, found {int(labels.min())}")
    classes = max_label + 1 if num_classes is None else num_classes
    if classes <= max_label:
        raise ValueError(f"num_classes={classes} but labels go up to {max_label}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    location = dest.removeprefix("npz://")
    store_uri = store_uri_for(location)
    store = open_store(store_uri, storage)
    if store.exists(MANIFEST_FILE) and not overwrite:
        raise ValueError(f"{store_uri} already holds a dataset (pass overwrite=True to replace it)")

    shards: list[ShardEntry] = []
    for index, start in enumerate(range(0, x4.shape[0], shard_size)):
        buffer = io.BytesIO()
        np.savez(buffer, x=x4[start : start + shard_size], y=labels[start : start + shard_size])
        info = store.put_bytes(f"shard-{index:05d}.npz", buffer.getbuffer())
        shards.append(
            ShardEntry(
                file=info.key, num_samples=min(shard_size, x4.shape[0] - start), sha256=info.sha256
            )
        )
        if progress is not None:
            progress(start + shards[-1].num_samples, int(x4.shape[0]))
    manifest = Manifest(
        num_samples=int(x4.shape[0]),
        num_classes=classes,
        sample_shape=(x4.shape[1], x4.shape[2], x4.shape[3]),
        shards=tuple(shards),
    )
    store.put_bytes(MANIFEST_FILE, manifest.to_json())
    written = {s.file for s in shards}
    for key in store.list("shard-"):
        if key.endswith(".npz") and "/" not in key and key not in written:
            store.delete(key)
    return PackResult(uri=f"npz://{_display_location(store_uri)}", manifest=manifest)


def _display_location(store_uri: str) -> str:
    return store_uri.removeprefix("file://") if store_uri.startswith("file://") else store_uri


def _check_arrays(x: NDArray[np.uint8], y: NDArray[np.integer]) -> NDArray[np.uint8]:
    """Validate and return x as ``[N,C,H,W]``."""
    if x.dtype != np.uint8:
        raise ValueError(f"x must be uint8 (scale images to 0..255 first), got {x.dtype}")
    if x.ndim not in (3, 4):
        raise ValueError(f"x must be [N,H,W] or [N,C,H,W], got shape {x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y must be a 1-d integer array, got {y.dtype} {y.shape}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
    if x.shape[0] == 0 or 0 in x.shape:
        raise ValueError(f"nothing to pack: x has shape {x.shape}")
    return x[:, None] if x.ndim == 3 else x


def load_arrays(
    path: str | os.PathLike[str], labels_path: str | os.PathLike[str] | None = None
) -> tuple[NDArray[np.uint8], NDArray[np.integer]]:
    """Load ``(x, y)`` from a ``.npz`` with arrays ``x`` and ``y``, or from two ``.npy`` files
    (``path`` images, ``labels_path`` labels). Never unpickles. ValueError for a wrong
    format or missing arrays; OSError when a file cannot be read."""
    source = Path(path)
    if source.suffix == ".npz":
        if labels_path is not None:
            raise ValueError("labels_path is only for .npy inputs; a .npz holds both x and y")
        with np.load(source, allow_pickle=False) as npz:
            missing = {"x", "y"} - set(npz.files)
            if missing:
                raise ValueError(f"{source} lacks array(s) {sorted(missing)} (has {npz.files})")
            return npz["x"], npz["y"]
    if source.suffix == ".npy":
        if labels_path is None:
            raise ValueError(f"{source} holds images only: give the labels .npy too")
        x = np.load(source, allow_pickle=False)
        y = np.load(labels_path, allow_pickle=False)
        return x, y
    raise ValueError(f"{source}: expected a .npz (x, y) or a .npy images file")


def pack_idx(
    src_dir: str | os.PathLike[str],
    dest: str,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    num_classes: int | None = None,
    storage: StorageSettings | None = None,
    overwrite: bool = False,
    progress: PackProgress | None = None,
) -> PackResult:
    """Pack the idx files in ``src_dir`` (see ``idx.py``) into npz shards at ``dest``."""
    source = IdxDataset(f"mnist-idx://{os.fspath(src_dir)}")
    x, y = source.read(np.arange(source.num_samples))
    return pack_npz(
        x,
        y,
        dest,
        shard_size=shard_size,
        num_classes=source.num_classes if num_classes is None else num_classes,
        storage=storage,
        overwrite=overwrite,
        progress=progress,
    )


def pack_source(
    src: str | os.PathLike[str],
    dest: str,
    *,
    labels_path: str | os.PathLike[str] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    num_classes: int | None = None,
    storage: StorageSettings | None = None,
    overwrite: bool = False,
    progress: PackProgress | None = None,
) -> PackResult:
    """Pack ``src`` (a directory of idx files, a ``.npz``, or a ``.npy`` plus ``labels_path``).

    ValueError for an unrecognised source; DatasetError for bad idx files. ``progress``: as
    :func:`pack_npz`.
    """
    if Path(src).is_dir():
        if labels_path is not None:
            raise ValueError("labels_path is only for .npy inputs")
        return pack_idx(
            src,
            dest,
            shard_size=shard_size,
            num_classes=num_classes,
            storage=storage,
            overwrite=overwrite,
            progress=progress,
        )
    x, y = load_arrays(src, labels_path)
    return pack_npz(
        x,
        y,
        dest,
        shard_size=shard_size,
        num_classes=num_classes,
        storage=storage,
        overwrite=overwrite,
        progress=progress,
    )
