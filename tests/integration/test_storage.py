"""Object storage: one behaviour suite run against both backends, then backend specifics.

The S3 backend runs against a real HTTP S3 endpoint (moto server, see conftest).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from minio import Minio

from conveyor.embedded.broker import free_port
from conveyor.libs.config import StorageSettings
from conveyor.libs.storage import (
    ChecksumMismatch,
    FileObjectStore,
    ObjectNotFound,
    ObjectStore,
    S3ObjectStore,
    StorageError,
    StorageUnavailable,
    open_store,
    sha256_hex,
)
from conveyor.libs.storage.base import CHUNK_BYTES, HashingReader

MiB = 1024 * 1024
S3_PREFIX = "runs/r1"


@dataclass
class Backend:
    """A store plus ways to reach behind its back."""

    name: str
    store: ObjectStore
    corrupt: Callable[[str, bytes], None]
    """Replace a key's content directly, keeping the checksum the store recorded."""
    junk: Callable[[], list[str]]
    """Leftovers of writes: temp files (file) or unfinished multipart uploads (S3)."""


def _s3_settings(s3_server: dict[str, str]) -> StorageSettings:
    return StorageSettings(
        s3_endpoint=s3_server["endpoint"],
        s3_access_key=s3_server["access_key"],
        s3_secret_key=s3_server["secret_key"],
        s3_region=s3_server["region"],
    )


def _raw_client(s3_server: dict[str, str]) -> Minio:
    return Minio(
        s3_server["endpoint"],
        access_key=s3_server["access_key"],
        secret_key=s3_server["secret_key"],
        region=s3_server["region"],
        secure=False,
    )


def _pending_uploads(s3_server: dict[str, str], bucket: str) -> list[str]:
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


def _file_backend(tmp_path: Path) -> Backend:
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


def _s3_backend(s3_server: dict[str, str], bucket: str) -> Backend:
    store = open_store(f"s3://{bucket}/{S3_PREFIX}", _s3_settings(s3_server))
    raw = _raw_client(s3_server)

    def corrupt(key: str, data: bytes) -> None:
        name = f"{S3_PREFIX}/{key}"
        old = raw.stat_object(bucket, name).metadata
        assert old is not None
        metadata: dict[str, str | list[str] | tuple[str]] = {"sha256": old["x-amz-meta-sha256"]}
        raw.put_object(bucket, name, io.BytesIO(data), len(data), metadata=metadata)

    return Backend("s3", store, corrupt, lambda: _pending_uploads(s3_server, bucket))


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        return _file_backend(tmp_path)
    s3_server: dict[str, str] = request.getfixturevalue("s3_server")
    return _s3_backend(s3_server, request.getfixturevalue("s3_bucket"))


@pytest.fixture
def fail_reads_after(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Arm: every source read through HashingReader fails with EIO once ``limit`` bytes
    went through; reads are cut to CHUNK_BYTES so the failure lands mid-stream."""

    def arm(limit_bytes: int) -> None:
        original = HashingReader.read

        def read(self: HashingReader, size: int = -1) -> bytes:
            if self.size_bytes >= limit_bytes:
                raise OSError(errno.EIO, "injected read failure")
            return original(self, CHUNK_BYTES if size < 0 else min(size, CHUNK_BYTES))

        monkeypatch.setattr(HashingReader, "read", read)

    return arm


def _payload(size_bytes: int, seed: int = 0) -> bytes:
    """Deterministic bytes; a prime period so chunks and parts differ from each other."""
    period = bytes((i * 31 + seed) % 256 for i in range(251))
    return (period * (size_bytes // 251 + 1))[:size_bytes]


# ---------------------------------------------------------------- behaviour suite


def test_bytes_round_trip_records_size_and_sha256(backend: Backend) -> None:
    store = backend.store
    data = b"hello conveyor"
    info = store.put_bytes("a/b/hello.txt", data)
    assert (info.key, info.size_bytes, info.sha256) == (
        "a/b/hello.txt",
        len(data),
        hashlib.sha256(data).hexdigest(),
    )
    assert store.get_bytes("a/b/hello.txt") == data
    assert store.get_bytes("a/b/hello.txt", expected_sha256=info.sha256.upper()) == data
    assert store.info("a/b/hello.txt") == info
    assert store.exists("a/b/hello.txt")
    assert not store.exists("a/b/other.txt")


def test_empty_object(backend: Backend) -> None:
    info = backend.store.put_bytes("empty", b"")
    assert (info.size_bytes, info.sha256) == (0, sha256_hex(b""))
    assert backend.store.get_bytes("empty") == b""


def test_file_round_trip_streams_multi_chunk_files(backend: Backend, tmp_path: Path) -> None:
    data = _payload(3 * CHUNK_BYTES + 17)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    info = backend.store.put_file("ckpt/step-1/shard-0.bin", src)
    assert (info.size_bytes, info.sha256) == (len(data), sha256_hex(data))
    dest = tmp_path / "out" / "nested" / "copy.bin"
    got = backend.store.get_file("ckpt/step-1/shard-0.bin", dest, expected_sha256=info.sha256)
    assert got == info
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] == ["copy.bin"]


def test_overwrite_replaces_content_and_checksum(backend: Backend) -> None:
    backend.store.put_bytes("latest", b"step-000100")
    second = backend.store.put_bytes("latest", b"step-000200")
    assert backend.store.get_bytes("latest") == b"step-000200"
    assert backend.store.info("latest") == second
    assert backend.store.list() == ["latest"]


def test_missing_key_raises_object_not_found(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    with pytest.raises(ObjectNotFound, match="nope"):
        store.get_bytes("nope")
    with pytest.raises(ObjectNotFound):
        store.info("dir/nope")
    dest = tmp_path / "dest.bin"
    with pytest.raises(ObjectNotFound):
        store.get_file("nope", dest)
    assert not dest.exists()
    assert not ObjectNotFound.retriable
    store.delete("nope")  # idempotent: deleting a missing key is fine


def test_list_is_sorted_recursive_and_filtered_by_prefix(backend: Backend) -> None:
    store = backend.store
    assert store.list() == []
    keys = ["b/2", "a/x/deep/1", "a/1", "ab", "a/x/2", "c"]
    for key in keys:
        store.put_bytes(key, key.encode())
    assert store.list() == sorted(keys)
    assert store.list("a/") == ["a/1", "a/x/2", "a/x/deep/1"]
    assert store.list("a") == ["a/1", "a/x/2", "a/x/deep/1", "ab"]
    assert store.list("a/x") == ["a/x/2", "a/x/deep/1"]
    assert store.list("zz/") == []


def test_delete_removes_object(backend: Backend) -> None:
    store = backend.store
    store.put_bytes("keep", b"1")
    store.put_bytes("dir/gone", b"2")
    store.delete("dir/gone")
    assert not store.exists("dir/gone")
    assert store.list() == ["keep"]
    with pytest.raises(ObjectNotFound):
        store.get_bytes("dir/gone")


@pytest.mark.parametrize(
    "key", ["", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a/.conveyor.x", "a\x00b"]
)
def test_invalid_keys_are_rejected(backend: Backend, key: str) -> None:
    with pytest.raises(ValueError):
        backend.store.put_bytes(key, b"x")
    with pytest.raises(ValueError):
        backend.store.get_bytes(key)
    assert backend.store.list() == []


def test_corruption_behind_the_stores_back_is_detected(backend: Backend, tmp_path: Path) -> None:
    data = _payload(4096)
    info = backend.store.put_bytes("model.bin", data)
    backend.corrupt("model.bin", bytes([data[0] ^ 0xFF]) + data[1:])
    with pytest.raises(ChecksumMismatch, match="corrupt"):
        backend.store.get_bytes("model.bin")
    dest = tmp_path / "model.bin"
    dest.write_bytes(b"previous download")
    with pytest.raises(ChecksumMismatch):
        backend.store.get_file("model.bin", dest)
    assert dest.read_bytes() == b"previous download"  # never replaced by unverified bytes
    assert backend.store.info("model.bin").sha256 == info.sha256


def test_expected_sha256_is_enforced(backend: Backend, tmp_path: Path) -> None:
    backend.store.put_bytes("k", b"content")
    wrong = sha256_hex(b"other")
    with pytest.raises(ChecksumMismatch, match="expected"):
        backend.store.get_bytes("k", expected_sha256=wrong)
    with pytest.raises(ChecksumMismatch):
        backend.store.get_file("k", tmp_path / "k", expected_sha256=wrong)
    assert not (tmp_path / "k").exists()
    with pytest.raises(ValueError, match="64 hex"):
        backend.store.get_bytes("k", expected_sha256="abc")


def test_write_failing_mid_stream_leaves_nothing_visible(
    backend: Backend, tmp_path: Path, fail_reads_after: Callable[[int], None]
) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(_payload(4 * CHUNK_BYTES))
    fail_reads_after(2 * CHUNK_BYTES)
    with pytest.raises(StorageError, match="injected read failure"):
        backend.store.put_file("dir/big.bin", src)
    assert not backend.store.exists("dir/big.bin")
    assert backend.store.list() == []
    assert backend.junk() == []


def test_failed_overwrite_keeps_the_previous_version(
    backend: Backend, tmp_path: Path, fail_reads_after: Callable[[int], None]
) -> None:
    first = backend.store.put_bytes("shard", b"version one")
    src = tmp_path / "v2.bin"
    src.write_bytes(_payload(3 * CHUNK_BYTES))
    fail_reads_after(CHUNK_BYTES)
    with pytest.raises(StorageError):
        backend.store.put_file("shard", src)
    assert backend.store.get_bytes("shard") == b"version one"
    assert backend.store.info("shard") == first
    assert backend.store.list() == ["shard"]
    assert backend.junk() == []


def test_readers_never_see_a_torn_or_mismatched_object(backend: Backend) -> None:
    versions = [_payload(1000 + 97 * i, seed=i) for i in range(8)]
    backend.store.put_bytes("hot", versions[0])
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(40):
                backend.store.put_bytes("hot", versions[i % len(versions)])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    while not stop.is_set():
        assert backend.store.get_bytes("hot") in versions
        reads += 1
    writer.join()
    assert errors == []
    assert reads > 0


def test_uri_for(backend: Backend, tmp_path: Path) -> None:
    if backend.name == "file":
        assert backend.store.uri_for("a/b") == f"file://{tmp_path}/store/a/b"
    else:
        assert backend.store.uri_for("a/b").endswith(f"/{S3_PREFIX}/a/b")
        assert backend.store.uri_for("a/b").startswith("s3://test-")
    with pytest.raises(ValueError):
        backend.store.uri_for("../x")


# ---------------------------------------------------------------- file backend


def test_file_store_relative_root_is_created_on_demand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("file://rel/objects")
    assert isinstance(store, FileObjectStore)
    assert store.root == tmp_path / "rel" / "objects"
    assert not store.root.exists()
    assert store.list() == []
    store.put_bytes("k", b"v")
    assert (tmp_path / "rel" / "objects" / "k").read_bytes() == b"v"
    # Checksums live in hidden siblings that list() never shows.
    assert sorted(p.name for p in store.root.iterdir()) == [".conveyor.k.sha256", "k"]
    assert store.list() == ["k"]


def test_file_store_detects_an_edited_file(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    store.put_bytes("k", b"original")
    (tmp_path / "k").write_bytes(b"edited by hand")
    with pytest.raises(ChecksumMismatch):
        store.get_bytes("k")


def test_file_store_crash_between_checksum_and_rename_keeps_old_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileObjectStore(tmp_path)
    old = store.put_bytes("latest", b"step-1")
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "latest":  # the data rename, after the record was committed
            raise OSError(errno.EIO, "crash before the data rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(StorageError, match="crash"):
        store.put_bytes("latest", b"step-2")
    monkeypatch.undo()
    assert store.get_bytes("latest") == b"step-1"  # the old content still verifies
    assert store.info("latest") == old
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_file_store_reads_foreign_files_without_a_checksum(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-0.npz").write_bytes(b"user bytes")
    store = FileObjectStore(tmp_path)
    assert store.list() == ["data/shard-0.npz"]
    assert store.info("data/shard-0.npz").sha256 == ""
    assert store.get_bytes("data/shard-0.npz") == b"user bytes"
    with pytest.raises(ChecksumMismatch):
        store.get_bytes("data/shard-0.npz", expected_sha256=sha256_hex(b"other"))


# ---------------------------------------------------------------- S3 backend


@pytest.fixture
def small_parts_store(s3_server: dict[str, str], s3_bucket: str) -> S3ObjectStore:
    return S3ObjectStore(_raw_client(s3_server), s3_bucket, "mp/", part_size_bytes=5 * MiB)


def test_s3_multipart_upload_carries_the_checksum(
    small_parts_store: S3ObjectStore, s3_server: dict[str, str], s3_bucket: str, tmp_path: Path
) -> None:
    data = os.urandom(11 * MiB + 5)  # three parts
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    info = small_parts_store.put_file("big.bin", src)
    stat = _raw_client(s3_server).stat_object(s3_bucket, "mp/big.bin")
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
    assert _pending_uploads(s3_server, s3_bucket) == []


def test_s3_source_changed_during_upload_is_not_committed(
    small_parts_store: S3ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(_payload(6 * MiB))
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
    _raw_client(s3_server).put_object(s3_bucket, "p/user.bin", io.BytesIO(b"abc"), 3)
    store = open_store(f"s3://{s3_bucket}/p/", _s3_settings(s3_server))
    assert store.list() == ["user.bin"]
    assert store.info("user.bin").sha256 == ""
    assert store.get_bytes("user.bin", expected_sha256=sha256_hex(b"abc")) == b"abc"


def test_s3_missing_bucket_is_a_permanent_error(s3_server: dict[str, str]) -> None:
    store = open_store("s3://no-such-bucket-here", _s3_settings(s3_server))
    with pytest.raises(StorageError, match="does not exist") as caught:
        store.put_bytes("k", b"v")
    assert not caught.value.retriable


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


# ---------------------------------------------------------------- open_store


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("file://", "names no directory"),
        ("ftp://host/x", "must start with"),
        ("s3://", "not a valid bucket"),
        ("s3:///prefix", "not a valid bucket"),
        ("s3://Bad_Bucket/x", "not a valid bucket"),
        ("s3://bucket/a/../b", "invalid prefix"),
        ("s3://bucket//x", "invalid prefix"),
    ],
)
def test_open_store_rejects_malformed_uris(uri: str, message: str) -> None:
    settings = StorageSettings(s3_endpoint="127.0.0.1:9000")
    with pytest.raises(ValueError, match=message):
        open_store(uri, settings)


def test_open_store_needs_an_s3_endpoint() -> None:
    with pytest.raises(ValueError, match="s3_endpoint"):
        open_store("s3://bucket")
    with pytest.raises(ValueError, match="s3_endpoint"):
        open_store("s3://bucket", StorageSettings())


def test_open_store_accepts_an_endpoint_url(s3_server: dict[str, str], s3_bucket: str) -> None:
    settings = _s3_settings(s3_server).model_copy(
        update={"s3_endpoint": f"http://{s3_server['endpoint']}/"}
    )
    store = open_store(f"s3://{s3_bucket}", settings)
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"
    assert store.uri_for("k") == f"s3://{s3_bucket}/k"
