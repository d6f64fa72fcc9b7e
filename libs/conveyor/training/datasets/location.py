"""Where a stored dataset lives: a local directory or an object-store prefix.

Dataset readers see storage failures as DatasetError (DatasetUnavailable when
retrying may help), each naming the file it concerns.
"""

from __future__ import annotations

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


def dataset_location(uri: str) -> str | None:
    """Where the dataset at ``uri`` is read from, written the way its reader opens it:
    ``file://<path>`` (absolute where the reader makes it absolute, with the reader's ``..``
    handling) or ``s3://...``; None for data that reads no storage (``builtin://``,
    ``synthetic://``). ValueError for a malformed URI or a scheme without a rule here: a new
    reader must say where it reads before a job may use it (checks fail closed)."""
    scheme, sep, location = uri.partition("://")
    if not sep:
        raise ValueError(f"dataset uri {uri!r} has no scheme (expected scheme://...)")
    if scheme in ("builtin", "synthetic"):
        return None
    if scheme == "npz":
        store_uri = store_uri_for(location)
        if store_uri.startswith("file://"):
            directory = store_uri.removeprefix("file://")
            if not directory:
                raise ValueError(f"dataset uri {uri!r} names no directory")
            # FileObjectStore opens os.path.abspath(<dir>): '..' goes lexically, before links.
            return f"file://{os.path.abspath(directory)}"
        return store_uri
    if scheme == "mnist-idx":
        return f"file://{location.removeprefix('file://')}"  # opened as a Path, as written
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
