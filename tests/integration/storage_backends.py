"""Helpers shared by the object-storage tests (test_storage_*.py, test_checkpoint_store.py):
the S3 endpoint's settings, a raw client to reach behind a store's back, both backends as a
:class:`Backend`, and deterministic payloads."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minio import Minio

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import ObjectStore, open_store

MiB = 1024 * 1024
S3_PREFIX = "runs/r1"


def s3_settings(s3_server: dict[str, str]) -> StorageSettings:
    return StorageSettings(
        s3_endpoint=s3_server["endpoint"],
        s3_access_key=s3_server["access_key"],
        s3_secret_key=s3_server["secret_key"],
        s3_region=s3_server["region"],
    )


def raw_client(s3_server: dict[str, str]) -> Minio:
    return Minio(
        s3_server["endpoint"],
        access_key=s3_server["access_key"],
        secret_key=s3_server["secret_key"],
        region=s3_server["region"],
        secure=False,
    )


def pending_uploads(s3_server: dict[str, str], bucket: str) -> list[str]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=f"http://{s3_server['endpoint']}",
        aws_access_key_id=s3_server["access_key"],
        aws_secret_access_key=s3_server["secret_key"],
        region_name=s3_server["region"],
    )
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return [str(upload["Key"]) for upload in uploads]


def payload(size_bytes: int, seed: int = 0) -> bytes:
    """Deterministic bytes; a prime period so chunks and parts differ from each other."""
    period = bytes((i * 31 + seed) % 256 for i in range(251))
    return (period * (size_bytes // 251 + 1))[:size_bytes]


@dataclass
class Backend:
    """A store plus ways to reach behind its back."""

    name: str
    store: ObjectStore
    corrupt: Callable[[str, bytes], None]
    """Replace a key's content directly, keeping the checksum the store recorded."""
    junk: Callable[[], list[str]]
    """Leftovers of writes: temp files (file) or unfinished multipart uploads (S3)."""


def file_backend(tmp_path: Path) -> Backend:
    root = tmp_path / "store"

    def corrupt(key: str, data: bytes) -> None:
        # Bit rot: new bytes, same size and mtime, so only the checksum can tell.
        path = root / key
        before = path.stat()
        assert len(data) == before.st_size
        path.write_bytes(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    def junk() -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))

    return Backend("file", open_store(f"file://{root}"), corrupt, junk)


def s3_backend(s3_server: dict[str, str], bucket: str) -> Backend:
    store = open_store(f"s3://{bucket}/{S3_PREFIX}", s3_settings(s3_server))
    raw = raw_client(s3_server)

    def corrupt(key: str, data: bytes) -> None:
        name = f"{S3_PREFIX}/{key}"
        old = raw.stat_object(bucket, name).metadata
        assert old is not None
        metadata: dict[str, str | list[str] | tuple[str]] = {"sha256": old["x-amz-meta-sha256"]}
        raw.put_object(bucket, name, io.BytesIO(data), len(data), metadata=metadata)

    return Backend("s3", store, corrupt, lambda: pending_uploads(s3_server, bucket))
