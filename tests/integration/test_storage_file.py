"""Object storage, file backend specifics: where it keeps checksums, and what it does with
files edited, half-written or put there by someone else."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from conveyor.platform.storage import (
    ChecksumMismatch,
    FileObjectStore,
    StorageError,
    open_store,
    sha256_hex,
)


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
