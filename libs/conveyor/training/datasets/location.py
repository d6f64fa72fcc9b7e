"""Where a stored dataset lives: a local directory or an object-store prefix.

Dataset readers see storage failures as DatasetError (DatasetUnavailable when
retrying may help), each naming the file it concerns.
"""

from __future__ import annotations

import io
import os

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import (
    ChecksumMismatch,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    StorageUnavailable,
    open_store,
)
from conveyor.training.datasets.base import DatasetError, DatasetUnavailable


def store_uri_for(location: str) -> str:
    """``s3://...`` and ``file://...`` unchanged; any other string is a local directory,
    made absolute. ValueError for another nested scheme or an empty location."""
    if not location:
        raise ValueError("dataset location is empty (expected a directory, file:// or s3://)")
    if location.startswith(("s3://", "file://")):
        return location
    if "://" in location:
        raise ValueError(
            f"dataset location {location!r}: only s3://, file:// or a local directory are supported"
        )
    return f"file://{os.path.abspath(location)}"


STORED_SCHEMES = ("npz", "imagefolder", "webdataset", "parquet", "tokens")
"""Dataset schemes read through an object store (a local directory or ``s3://``); what follows
``://`` (before any ``?query``) is the location, for ``webdataset`` with a last segment that
names the shards (``{000000..000127}.tar``)."""


def stored_location(scheme: str, rest: str) -> str:
    """The location part of a stored dataset's URI: ``rest`` without its ``?query`` and, for
    ``webdataset``, without the shard pattern (its last segment; ``.`` when it is all)."""
    location = rest.partition("?")[0]
    if scheme == "webdataset":
        directory, slash, _ = location.rpartition("/")
        location = directory if slash else "."  # bare shard names: the working directory
    return location


def dataset_location(uri: str) -> str | None:
    """Where the dataset at ``uri`` is read from, written the way its reader opens it:
    ``file://<path>`` (absolute where the reader makes it absolute, with the reader's ``..``
    handling) or ``s3://...``; None for data that reads no storage (``builtin://``,
    ``synthetic://``). ValueError for a malformed URI or a scheme without a rule here: a new
    reader must say where it reads before a job may use it (checks fail closed)."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise ValueError(f"dataset uri {uri!r} has no scheme (expected scheme://...)")
    if scheme in ("builtin", "synthetic"):
        return None
    if scheme in STORED_SCHEMES:
        store_uri = store_uri_for(stored_location(scheme, rest))
        if store_uri.startswith("file://"):
            directory = store_uri.removeprefix("file://")
            if not directory:
                raise ValueError(f"dataset uri {uri!r} names no directory")
            # FileObjectStore opens os.path.abspath(<dir>): '..' goes lexically, before links.
            return f"file://{os.path.abspath(directory)}"
        return store_uri
    if scheme == "mnist-idx":
        return f"file://{rest.removeprefix('file://')}"  # opened as a Path, as written
    raise ValueError(f"dataset scheme {scheme!r} has no location rule")


def open_location(
    uri: str, location: str, storage: StorageSettings | None
) -> tuple[ObjectStore, str]:
    """Open the store holding a dataset; returns ``(store, where)`` with ``where`` the
    location's URI for messages. DatasetError for a bad location or a missing local dir."""
    try:
        store_uri = store_uri_for(location)
        store = open_store(store_uri, storage)
    except ValueError as exc:
        raise DatasetError(f"{uri}: {exc}") from exc
    if store_uri.startswith("file://"):
        directory = store_uri.removeprefix("file://")
        if not os.path.isdir(directory):
            raise DatasetError(f"{uri}: directory {directory} does not exist or is not readable")
    return store, store_uri.rstrip("/")


def open_file_location(
    uri: str, location: str, storage: StorageSettings | None
) -> tuple[ObjectStore, str, str]:
    """Open the store holding the single file ``location`` (a local path, ``file://`` or
    ``s3://bucket/key``); returns ``(store, key, where)``, ``where`` its directory's URI for
    messages. DatasetError for a location that names no file or a missing local file."""
    scheme = "s3://" if location.startswith("s3://") else "file://"
    path = location.removeprefix(scheme) if location.startswith(scheme) else location
    parent, slash, key = path.rpartition("/")
    if not key or (scheme == "s3://" and not parent):
        raise DatasetError(f"{uri}: {location!r} names no file")
    if scheme == "s3://":
        directory = f"s3://{parent}"
    else:
        directory = parent if parent else ("/" if slash else ".")
    store, where = open_location(uri, directory, storage)
    return store, key, where


def stat_object(store: ObjectStore, where: str, key: str) -> int:
    """The size in bytes of ``key``; DatasetError (DatasetUnavailable) naming it otherwise."""
    try:
        return store.info(key).size_bytes
    except ObjectNotFound as exc:
        raise DatasetError(f"{where}/{key} not found") from exc
    except StorageUnavailable as exc:
        raise DatasetUnavailable(f"{where}/{key}: storage unavailable: {exc}") from exc
    except (StorageError, ValueError) as exc:
        raise DatasetError(f"{where}/{key} cannot be read: {exc}") from exc


def read_range(store: ObjectStore, where: str, key: str, offset: int, length: int) -> bytes:
    """``length`` bytes of ``key`` from ``offset``; DatasetError when fewer exist (a file
    shorter than its index or footer says) or the read fails."""
    name = f"{where}/{key}"
    try:
        data = store.get_range(key, offset, length)
    except ObjectNotFound as exc:
        raise DatasetError(f"{name} not found") from exc
    except StorageUnavailable as exc:
        raise DatasetUnavailable(f"{name}: storage unavailable: {exc}") from exc
    except (StorageError, ValueError) as exc:
        raise DatasetError(f"{name} cannot be read: {exc}") from exc
    if len(data) != length:
        raise DatasetError(
            f"{name} is truncated: {length} bytes expected at offset {offset}, {len(data)} read"
        )
    return data


def list_keys(store: ObjectStore, where: str, prefix: str = "") -> list[str]:
    """Every key under the store's root starting with ``prefix``, sorted."""
    try:
        return store.list(prefix)
    except StorageUnavailable as exc:
        raise DatasetUnavailable(f"{where}: storage unavailable while listing: {exc}") from exc
    except (StorageError, ValueError) as exc:
        raise DatasetError(f"{where} cannot be listed: {exc}") from exc


def read_object(
    store: ObjectStore, where: str, key: str, *, expected_sha256: str | None = None
) -> bytes:
    """Fetch ``key`` (verified against ``expected_sha256`` when given) as bytes."""
    name = f"{where}/{key}"
    try:
        return store.get_bytes(key, expected_sha256=expected_sha256)
    except ValueError as exc:
        raise DatasetError(f"{name}: invalid file name or checksum: {exc}") from exc
    except ObjectNotFound as exc:
        raise DatasetError(f"{name} not found") from exc
    except ChecksumMismatch as exc:
        raise DatasetError(f"{name} is corrupt (sha256 does not match the manifest)") from exc
    except StorageUnavailable as exc:
        raise DatasetUnavailable(f"{name}: storage unavailable: {exc}") from exc
    except StorageError as exc:
        raise DatasetError(f"{name} cannot be read: {exc}") from exc


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one object, read in ranges (``ObjectStore.get_range``):
    what tarfile and pyarrow are given to read an object's headers or footer without fetching
    all of it. Wrap it in ``io.BufferedReader`` to read in large ranges. Not thread-safe: one per
    reader. Storage failures surface as DatasetError / DatasetUnavailable."""

    def __init__(self, store: ObjectStore, where: str, key: str, size_bytes: int) -> None:
        super().__init__()
        self._store, self._where, self._key = store, where, key
        self._size = size_bytes
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        length = max(0, min(len(buffer), self._size - self._position))
        if length == 0:
            return 0
        data = read_range(self._store, self._where, self._key, self._position, length)
        buffer[:length] = data
        self._position += length
        return length
