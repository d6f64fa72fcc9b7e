"""Object store in a local directory: one file per key, mirroring the key's path.

Layout of ``<root>/a/b/c``: the content in ``a/b/c``, its checksum record in the
hidden sibling ``a/b/.conveyor.c.sha256`` (JSON), temp files as
``a/b/.conveyor.c.<random>.tmp``. list() never shows ``.conveyor.*`` names.

Write protocol (crash-safe): content goes to a temp file, fsync; then, holding
a lock on the directory, the checksum record is replaced (fsync) and THEN the
temp file is renamed over the key, and the directory fsynced. A visible object
therefore always has its checksum. The record keeps the new digest and the
digest of the content still visible, so a reader (or a crash) between the two
renames still finds the old content valid.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from conveyor.platform.storage._fs import locked_dir, os_errors, raise_error, replacing
from conveyor.platform.storage.base import (
    CHUNK_BYTES,
    RESERVED_PREFIX,
    Bytes,
    ChecksumMismatch,
    HashingReader,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    check_sha256,
    sha256_hex,
    verify,
)

_READ_ATTEMPTS = 5
"""A read that races two overwrites of its key is retried this often."""


@dataclass(frozen=True, slots=True)
class _Record:
    """The checksum of one written version, identified by its size and mtime."""

    sha256: str
    size_bytes: int
    mtime_ns: int


class FileObjectStore(ObjectStore):
    """Objects as files under ``root`` (created on the first write)."""

    def __init__(self, root: str | Path) -> None:
        self._root = Path(os.path.abspath(root))

    @property
    def root(self) -> Path:
        """Absolute directory holding the objects."""
        return self._root

    def put_bytes(self, key: str, data: Bytes) -> ObjectInfo:
        def fill(out: BinaryIO) -> str:
            out.write(data)
            return sha256_hex(data)

        return self._write(check_key(key), fill)

    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        check_key(key)
        with open(path, "rb") as src:
            reader = HashingReader(src)

            def fill(out: BinaryIO) -> str:
                while chunk := reader.read(CHUNK_BYTES):
                    out.write(chunk)
                return reader.hexdigest()

            return self._write(key, fill)

    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
        parts: list[bytes] = []
        self._read(check_key(key), check_sha256(expected_sha256), parts.append, parts.clear)
        return b"".join(parts)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        path = self._path(check_key(key))
        with os_errors(f"read {key!r}"):
            try:
                src = open(path, "rb")  # noqa: SIM115 - closed by the with below
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
                raise ObjectNotFound(f"object {self.uri_for(key)} not found") from exc
            with src:
                return os.pread(src.fileno(), length, offset) if length else b""

    def get_file(
        self, key: str, path: str | Path, *, expected_sha256: str | None = None
    ) -> ObjectInfo:
        check_key(key)
        expected = check_sha256(expected_sha256)
        with os_errors(f"download {key!r} to {path}"), replacing(Path(path)) as out:

            def restart() -> None:
                out.seek(0)
                out.truncate()

            return self._read(key, expected, out.write, restart)

    def exists(self, key: str) -> bool:
        return self._path(check_key(key)).is_file()

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        directory, _, partial = prefix.rpartition("/")
        base = self._root.joinpath(*directory.split("/")) if directory else self._root
        if not base.is_dir():
            return []
        keys: list[str] = []
        with os_errors(f"list {prefix!r}"):
            for dirpath, dirnames, filenames in os.walk(base, onerror=raise_error):
                at_base = dirpath == str(base)
                dirnames[:] = [
                    d
                    for d in dirnames
                    if not d.startswith(RESERVED_PREFIX) and (not at_base or d.startswith(partial))
                ]
                rel = Path(dirpath).relative_to(self._root).as_posix()
                for name in filenames:
                    key = name if rel == "." else f"{rel}/{name}"
                    if not name.startswith(RESERVED_PREFIX) and key.startswith(prefix):
                        keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(check_key(key))
        if not path.parent.is_dir():
            return
        with os_errors(f"delete {key!r}"), locked_dir(path.parent) as dir_fd:
            # Content first: a crash in between leaves an invisible, harmless record.
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                path.unlink()
            _record_path(path).unlink(missing_ok=True)
            os.fsync(dir_fd)

    def info(self, key: str) -> ObjectInfo:
        path = self._path(check_key(key))
        with os_errors(f"stat {key!r}"):
            try:
                stat = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                stat = None
            if stat is None or not path.is_file():
                raise ObjectNotFound(f"object {self.uri_for(key)} not found")
            records = _read_records(path, key)
        sha = ""
        if records:
            same = [r for r in records if (r.size_bytes, r.mtime_ns) == _version(stat)]
            sha = (same or records)[0].sha256
        return ObjectInfo(key=key, size_bytes=stat.st_size, sha256=sha)

    def uri_for(self, key: str) -> str:
        return f"file://{self._path(check_key(key))}"

    def _path(self, key: str) -> Path:
        return self._root.joinpath(*key.split("/"))

    def _write(self, key: str, fill: Callable[[BinaryIO], str]) -> ObjectInfo:
        info: list[ObjectInfo] = []

        def commit(tmp: Path, path: Path, stat: os.stat_result) -> None:
            # Runs when the with-block below exits, after fill() set ``digest``.
            new = _Record(sha256=digest, size_bytes=stat.st_size, mtime_ns=stat.st_mtime_ns)
            with locked_dir(path.parent) as dir_fd:
                _commit_record(path, new)
                os.replace(tmp, path)  # rename keeps mtime_ns, so the record matches
                os.fsync(dir_fd)
            info.append(ObjectInfo(key=key, size_bytes=stat.st_size, sha256=digest))

        with os_errors(f"write {key!r}"), replacing(self._path(key), commit) as out:
            digest = fill(out)
        return info[0]

    def _read(
        self,
        key: str,
        expected: str | None,
        sink: Callable[[bytes], object],
        restart: Callable[[], None],
    ) -> ObjectInfo:
        """Stream ``key`` into ``sink`` and verify it; retried (after ``restart``) when
        the key was replaced twice during the read."""
        path = self._path(key)
        for attempt in range(_READ_ATTEMPTS):
            with os_errors(f"read {key!r}"):
                try:
                    src = open(path, "rb")  # noqa: SIM115 - closed by the with below
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
                    raise ObjectNotFound(f"object {self.uri_for(key)} not found") from exc
                with src:
                    reader = HashingReader(src)
                    while chunk := reader.read(CHUNK_BYTES):
                        sink(chunk)
                    # The record is read after the content: see the module docstring.
                    records = _read_records(path, key)
                    replaced = _version(os.fstat(src.fileno())) != _current_version(path)
            digest = reader.hexdigest()
            try:
                verify(key, digest, [r.sha256 for r in records], expected)
            except ChecksumMismatch:
                if not replaced or attempt == _READ_ATTEMPTS - 1:
                    raise
                restart()
                continue
            return ObjectInfo(key=key, size_bytes=reader.size_bytes, sha256=digest)
        raise AssertionError("unreachable")


def _record_path(path: Path) -> Path:
    return path.with_name(f"{RESERVED_PREFIX}{path.name}.sha256")


def _version(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _current_version(path: Path) -> tuple[int, int] | None:
    try:
        return _version(path.stat())
    except FileNotFoundError:
        return None


def _read_records(path: Path, key: str) -> list[_Record]:
    """The checksum records of ``path``, newest first; [] when it has none."""
    try:
        text = _record_path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    try:
        return [_Record(**fields) for fields in json.loads(text)["records"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ChecksumMismatch(f"checksum record of object {key!r} is unreadable") from exc


def _commit_record(path: Path, new: _Record) -> None:
    """Replace the record of ``path`` with ``new`` plus the record of the content still
    visible there (if known). Caller holds the directory lock and fsyncs it afterwards."""
    keep: list[_Record] = []
    current = _current_version(path)
    with contextlib.suppress(ChecksumMismatch):  # an unreadable record is simply replaced
        keep = [r for r in _read_records(path, "") if (r.size_bytes, r.mtime_ns) == current]
    records = [asdict(r) for r in [new, *keep[:1]]]
    with replacing(_record_path(path), commit=_rename) as out:
        out.write(json.dumps({"records": records}).encode("utf-8"))


def _rename(tmp: Path, target: Path, stat: os.stat_result) -> None:
    os.replace(tmp, target)
