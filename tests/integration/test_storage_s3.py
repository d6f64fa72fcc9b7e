"""Object storage, S3 backend specifics: multipart uploads carry the checksum and are aborted
on failure, foreign objects, and which errors are permanent or retriable. Runs against a real
HTTP S3 endpoint (moto server, see tests/conftest.py)."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from storage_backends import MiB, payload, pending_uploads, raw_client, s3_settings

from conveyor.embedded.broker import free_port
from conveyor.platform.storage import (
    StorageError,
    StorageUnavailable,
    open_store,
    sha256_hex,
)
from conveyor.platform.storage.s3 import S3ObjectStore


@pytest.fixture
def small_parts_store(s3_server: dict[str, str], s3_bucket: str) -> S3ObjectStore:
    return S3ObjectStore(raw_client(s3_server), s3_bucket, "mp/", part_size_bytes=5 * MiB)


def test_s3_multipart_upload_carries_the_checksum(
    small_parts_store: S3ObjectStore, s3_server: dict[str, str], s3_bucket: str, tmp_path: Path
) -> None:
    data = os.urandom(11 * MiB + 5)  # three parts
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    info = small_parts_store.put_file("big.bin", src)
    stat = raw_client(s3_server).stat_object(s3_bucket, "mp/big.bin")
    assert stat.metadata is not None
    assert stat.metadata["x-amz-meta-sha256"] == sha256_hex(data) == info.sha256
    assert stat.etag is not None and stat.etag.endswith("-3")  # really multipart
    assert small_parts_store.get_file("big.bin", tmp_path / "back.bin") == info
    assert (tmp_path / "back.bin").read_bytes() == data


def test_s3_multipart_failing_mid_stream_is_aborted(
    small_parts_store: S3ObjectStore,
    s3_server: dict[str, str],
    s3_bucket: str,
    tmp_path: Path,
    fail_reads_after: Callable[[int], None],
) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * MiB))
    fail_reads_after(7 * MiB)  # after the first part went out
    with pytest.raises(StorageError, match="injected"):
        small_parts_store.put_file("big.bin", src)
    assert not small_parts_store.exists("big.bin")
    assert small_parts_store.list() == []
    assert pending_uploads(s3_server, s3_bucket) == []


def test_s3_source_changed_during_upload_is_not_committed(
    small_parts_store: S3ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(payload(6 * MiB))
    real_file_digest = hashlib.file_digest

    def digest_then_modify(fileobj: Any, name: str) -> Any:
        result = real_file_digest(fileobj, name)
        with open(src, "r+b") as f:  # same size, different bytes
            f.write(b"X")
        return result

    monkeypatch.setattr(hashlib, "file_digest", digest_then_modify)
    with pytest.raises(StorageError, match="source changed"):
        small_parts_store.put_file("src.bin", src)
    assert small_parts_store.list() == []


def test_s3_foreign_object_without_checksum(s3_server: dict[str, str], s3_bucket: str) -> None:
    raw_client(s3_server).put_object(s3_bucket, "p/user.bin", io.BytesIO(b"abc"), 3)
    store = open_store(f"s3://{s3_bucket}/p/", s3_settings(s3_server))
    assert store.list() == ["user.bin"]
    assert store.info("user.bin").sha256 == ""
    assert store.get_bytes("user.bin", expected_sha256=sha256_hex(b"abc")) == b"abc"


def test_s3_missing_bucket_is_a_permanent_error_to_read(s3_server: dict[str, str]) -> None:
    store = open_store("s3://no-such-bucket-here", s3_settings(s3_server))
    with pytest.raises(StorageError, match="does not exist") as caught:
        store.get_bytes("k")
    assert not caught.value.retriable
    assert not raw_client(s3_server).bucket_exists("no-such-bucket-here")


def test_s3_first_write_creates_a_missing_bucket(s3_server: dict[str, str]) -> None:
    store = open_store("s3://made-by-a-write/runs", s3_settings(s3_server))
    info = store.put_bytes("k", b"v")
    assert raw_client(s3_server).bucket_exists("made-by-a-write")
    assert store.get_bytes("k", expected_sha256=info.sha256) == b"v"
    assert open_store("s3://made-by-a-write/runs", s3_settings(s3_server)).list() == ["k"]


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    yield f"127.0.0.1:{free_port()}"  # nothing listens there


def test_s3_unreachable_endpoint_is_retriable(dead_endpoint: str) -> None:
    import urllib3

    # No client retries, so the test takes milliseconds rather than the default backoff.
    client = Minio(
        dead_endpoint,
        access_key="a",
        secret_key="b",
        region="us-east-1",
        secure=False,
        http_client=urllib3.PoolManager(retries=False),
    )
    store = S3ObjectStore(client, "bucket")
    with pytest.raises(StorageUnavailable) as caught:
        store.get_bytes("k")
    assert caught.value.retriable
    assert isinstance(caught.value.__cause__, urllib3.exceptions.HTTPError)
