"""Object storage for checkpoints, datasets and exports: ``file://`` or ``s3://``.

Synchronous API (async callers use ``asyncio.to_thread``)::

    store = open_store("s3://bucket/runs", settings)
    info = store.put_file("ckpt/step-100/shard-0.safetensors", local_path)
    store.get_file(info.key, dest, expected_sha256=info.sha256)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.platform.config import StorageSettings
from conveyor.platform.roots import BUCKET_RE
from conveyor.platform.storage.base import (
    ChecksumMismatch,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    StorageUnavailable,
    check_key,
    sha256_hex,
)
from conveyor.platform.storage.file import FileObjectStore

if TYPE_CHECKING:
    from minio import Minio

__all__ = [
    "ChecksumMismatch",
    "FileObjectStore",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "StorageError",
    "StorageUnavailable",
    "open_store",
    "sha256_hex",
]


def open_store(uri: str, settings: StorageSettings | None = None) -> ObjectStore:
    """Open the store rooted at ``uri``; performs no I/O.

    ``file://<dir>``: a local directory (relative to the current directory unless
    absolute), created on the first write. ``s3://<bucket>[/prefix]``: keys live
    under ``prefix/`` in an existing bucket, reached with ``settings.s3_*``.
    ValueError for a malformed URI or missing S3 settings.
    """
    if uri.startswith("file://"):
        directory = uri.removeprefix("file://")
        if not directory:
            raise ValueError(f"storage uri {uri!r} names no directory (file://<dir>)")
        return FileObjectStore(directory)
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not BUCKET_RE.fullmatch(bucket):
            raise ValueError(
                f"storage uri {uri!r}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . -)"
            )
        prefix = prefix.rstrip("/")
        if prefix:
            try:
                check_key(prefix)
            except ValueError as exc:
                raise ValueError(f"storage uri {uri!r} has an invalid prefix: {exc}") from exc
        # minio is imported by s3:// stores only: it costs a process 1.5 s of CPU to import,
        # and the embedded stack's file:// store never needs it.
        from conveyor.platform.storage.s3 import S3ObjectStore

        return S3ObjectStore(_client(uri, settings), bucket, f"{prefix}/" if prefix else "")
    raise ValueError(f"storage uri {uri!r} must start with file:// or s3://")


def _client(uri: str, settings: StorageSettings | None) -> Minio:
    from minio import Minio

    if settings is None or not settings.s3_endpoint:
        raise ValueError(f"storage uri {uri!r} needs StorageSettings with s3_endpoint (host:port)")
    endpoint, secure = settings.s3_endpoint, settings.s3_secure
    # Accept a URL too ("http://minio:9000"): its scheme decides TLS.
    if "://" in endpoint:
        scheme, _, endpoint = endpoint.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"s3_endpoint {settings.s3_endpoint!r} must be host:port or a URL")
        secure = scheme == "https"
    return Minio(
        endpoint.rstrip("/"),
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        region=settings.s3_region,
        secure=secure,
    )
