"""Object storage: one behaviour suite, run against both backends (file and S3).

The S3 backend runs against a real HTTP S3 endpoint (moto server, see tests/conftest.py).
Backend specifics are in test_storage_file.py, test_storage_s3.py and test_storage_open_store.py.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from storage_backends import S3_PREFIX, Backend, payload

from conveyor.platform.storage import (
    ChecksumMismatch,
    ObjectNotFound,
    StorageError,
    sha256_hex,
)
from conveyor.platform.storage.base import CHUNK_BYTES

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


def test_get_range_reads_part_of_an_object(backend: Backend) -> None:
    store = backend.store
    data = bytes(range(256)) * 40
    store.put_bytes("r/blob", data)
    assert store.get_range("r/blob", 0, 10) == data[:10]
    assert store.get_range("r/blob", 1000, 300) == data[1000:1300]
    assert store.get_range("r/blob", len(data) - 5, 50) == data[-5:]  # short at the end
    assert store.get_range("r/blob", len(data), 10) == b""
    assert store.get_range("r/blob", 7, 0) == b""
    with pytest.raises(ObjectNotFound):
        store.get_range("r/none", 0, 10)
    with pytest.raises(ValueError, match="offset >= 0"):
        store.get_range("r/blob", -1, 10)


def test_file_round_trip_streams_multi_chunk_files(backend: Backend, tmp_path: Path) -> None:
    data = payload(3 * CHUNK_BYTES + 17)
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
    data = payload(4096)
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
    src.write_bytes(payload(4 * CHUNK_BYTES))
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
    src.write_bytes(payload(3 * CHUNK_BYTES))
    fail_reads_after(CHUNK_BYTES)
    with pytest.raises(StorageError):
        backend.store.put_file("shard", src)
    assert backend.store.get_bytes("shard") == b"version one"
    assert backend.store.info("shard") == first
    assert backend.store.list() == ["shard"]
    assert backend.junk() == []


def test_readers_never_see_a_torn_or_mismatched_object(backend: Backend) -> None:
    versions = [payload(1000 + 97 * i, seed=i) for i in range(8)]
    backend.store.put_bytes("hot", versions[0])
    stop = threading.Event()
    read_once = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            # 40 writes, and on until the reader has read once: on a busy machine this thread
            # could make all 40 before the reader's first look.
            i = 0
            while i < 40 or not read_once.is_set():
                backend.store.put_bytes("hot", versions[i % len(versions)])
                i += 1
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    try:
        while not stop.is_set():
            assert backend.store.get_bytes("hot") in versions
            reads += 1
            read_once.set()
    finally:
        read_once.set()  # a failed read must not leave the writer writing
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
