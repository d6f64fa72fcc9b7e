"""Durable local file-system steps used by the file backend and downloads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from conveyor.platform.storage.base import RESERVED_PREFIX, StorageError


def make_dirs(directory: Path) -> None:
    """mkdir -p that fsyncs each new directory's parent, so the entries survive a crash."""
    missing: list[Path] = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for new_dir in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent writer made it
            new_dir.mkdir()
        fsync_dir(new_dir.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or creation inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_dir(directory: Path) -> Iterator[int]:
    """Exclusive flock on ``directory``: serialises commits of keys in it across processes."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def os_errors(action: str) -> Iterator[None]:
    """Turn OS errors of the local file system into StorageError."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot {action}: {exc}") from exc


def raise_error(exc: OSError) -> None:
    """os.walk error hook: fail instead of silently skipping unreadable directories."""
    raise exc


def _replace(tmp: Path, target: Path, stat: os.stat_result) -> None:
    os.replace(tmp, target)
    fsync_dir(target.parent)


@contextlib.contextmanager
def replacing(
    target: Path, commit: Callable[[Path, Path, os.stat_result], None] = _replace
) -> Iterator[BinaryIO]:
    """Yield a new temp file beside ``target``, so ``target`` only ever holds complete content.

    On a clean exit the temp file is fsynced and ``commit(tmp, target, stat_of_tmp)``
    runs (default: rename over ``target`` and fsync the directory); on an exception,
    or if commit fails, the temp file is removed. Parent directories are created.
    """
    make_dirs(target.parent)
    tmp = target.with_name(f"{RESERVED_PREFIX}{target.name}.{secrets.token_hex(8)}.tmp")
    try:
        # O_EXCL: never share a temp file; mode 0o666 lets the umask decide.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
            stat = os.fstat(out.fileno())
        commit(tmp, target, stat)
    finally:
        tmp.unlink(missing_ok=True)
