"""Pack an image folder into WebDataset tar shards plus ``manifest.json`` (see ``webdataset.py``).

Sample ``i`` of the image folder (its order: classes by name, files by folder and name) becomes
key ``%08d`` in shard ``i // shard_size``: ``<key>.<jpg|png>`` holds the file's bytes as they
are (no re-encoding), ``<key>.cls`` the class id. Tar headers carry no time, owner or mode of the
source, so packing the same folder twice writes the same bytes. Shards (``000000.tar``, ...)
are written first and the manifest (counts, sha256 of every shard, class names) last: an
interrupted pack leaves no manifest. ``pack_imagefolder`` is what ``conveyor dataset pack``
runs for a folder of class folders.
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass

import numpy as np

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import open_store
from conveyor.training.datasets.idx import IMAGES_NAMES
from conveyor.training.datasets.imagefolder import ImageFolderDataset
from conveyor.training.datasets.location import store_uri_for
from conveyor.training.datasets.pack import PackProgress
from conveyor.training.datasets.webdataset import MANIFEST_FILE, TarShard, WebDatasetManifest

DEFAULT_SAMPLES_PER_SHARD = 4096
_READ_CHUNK = 256
"""Images fetched from the source per read."""


@dataclass(kw_only=True, slots=True, frozen=True)
class WebDatasetPackResult:
    """What a pack wrote."""

    uri: str
    """Dataset URI for a job spec: ``webdataset://<dest>/{000000..000NNN}.tar``."""
    manifest: WebDatasetManifest
    """The manifest written last."""


def is_image_folder(path: str) -> bool:
    """Whether ``path`` is ``imagefolder://...`` or a local directory without idx files."""
    if path.startswith("imagefolder://"):
        return True
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    return not any(n in names or f"{n}.gz" in names for n in IMAGES_NAMES)


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def pack_imagefolder(
    src: str,
    dest: str,
    *,
    shard_size: int = DEFAULT_SAMPLES_PER_SHARD,
    storage: StorageSettings | None = None,
    overwrite: bool = False,
    progress: PackProgress | None = None,
) -> WebDatasetPackResult:
    """Pack the image folder ``src`` (a directory, ``imagefolder://<dir or s3 prefix>``) into
    shards at ``dest`` (a directory, ``file://`` or ``s3://``, optionally behind
    ``webdataset://``). ValueError for bad options, a destination holding a manifest (unless
    ``overwrite``) or a source file that cannot be read; DatasetError for a bad source;
    StorageError when writing fails. With ``overwrite``, ``NNNNNN.tar`` shards of an earlier
    pack that the new manifest does not name are deleted after it is written. ``progress`` is
    called after each chunk of images read into a shard."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    source_uri = src if src.startswith("imagefolder://") else f"imagefolder://{src}"
    source = ImageFolderDataset(source_uri, storage=storage)
    store_uri = store_uri_for(dest.removeprefix("webdataset://"))
    store = open_store(store_uri, storage)
    if store.exists(MANIFEST_FILE) and not overwrite:
        raise ValueError(f"{store_uri} already holds a dataset (pass overwrite=True to replace it)")
    shards: list[TarShard] = []
    for index, start in enumerate(range(0, source.num_samples, shard_size)):
        buffer = io.BytesIO()
        ids = np.arange(start, min(start + shard_size, source.num_samples))
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for chunk in range(0, ids.size, _READ_CHUNK):
                samples, bad = source.read_encoded(ids[chunk : chunk + _READ_CHUNK])
                if bad:
                    raise ValueError(f"cannot pack {bad[0]}")
                for sample in samples:
                    ext = "png" if sample.source.lower().endswith(".png") else "jpg"
                    key = f"{sample.sample_id:08d}"
                    _tar_member(tar, f"{key}.{ext}", sample.data)
                    _tar_member(tar, f"{key}.cls", str(sample.label).encode("ascii"))
                if progress is not None:
                    progress(start + min(chunk + _READ_CHUNK, ids.size), source.num_samples)
        info = store.put_bytes(f"{index:06d}.tar", buffer.getbuffer())
        shards.append(TarShard(file=info.key, num_samples=int(ids.size), sha256=info.sha256))
    manifest = WebDatasetManifest(
        num_samples=source.num_samples, classes=tuple(source.classes), shards=tuple(shards)
    )
    store.put_bytes(MANIFEST_FILE, manifest.to_json())
    written = {s.file for s in shards}
    for key in store.list():
        stale = "/" not in key and key.endswith(".tar") and key[:-4].isdigit()
        if stale and key not in written:
            store.delete(key)
    location = store_uri.removeprefix("file://") if store_uri.startswith("file://") else store_uri
    last = len(shards) - 1
    pattern = f"{{000000..{last:06d}}}.tar" if last else "000000.tar"
    return WebDatasetPackResult(uri=f"webdataset://{location}/{pattern}", manifest=manifest)
