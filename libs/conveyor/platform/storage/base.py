"""The object-store contract shared by every backend: errors, keys, checksums.

Keys are ``/``-separated relative paths (``ckpt/step-100/shard-0.safetensors``).
Every object carries the sha256 of its content, computed when it was written;
reads verify it. A write is complete or invisible: readers never see a
partially written object under its key.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar

from conveyor.platform.errors import ConveyorError

CHUNK_BYTES = 1024 * 1024
"""Unit of streaming reads and writes: large objects never sit whole in memory."""

MAX_KEY_BYTES = 1024
"""Longest key (UTF-8 bytes), S3's limit, so keys stay portable between backends."""

RESERVED_PREFIX = ".conveyor."
"""Key segments starting with this are the file backend's own (checksums, temp files)."""

_SHA256_RE = re.compile(r"[0-9a-f]{64}")

Bytes = bytes | bytearray | memoryview


class StorageError(ConveyorError):
    """Base of every object-store failure; not worth retrying unless a subclass says so."""


class StorageUnavailable(StorageError):
    """The store could not be reached or answered with a transient error; retry with backoff."""

    retriable: ClassVar[bool] = True


class ObjectNotFound(StorageError):
    """No object exists under the key."""


class ChecksumMismatch(StorageError):
    """An object's content does not match its recorded or the expected sha256."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ObjectInfo:
    """What a store knows about one object."""

    key: str
    """Key relative to the store's root."""
    size_bytes: int
    """Length of the content."""
    sha256: str
    """Lowercase hex sha256 of the content; empty for an object written by another tool
    without a recorded checksum (its reads are then verified only against expected_sha256)."""


def sha256_hex(data: Bytes) -> str:
    """Lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise ValueError.

    Valid: non-empty, relative, ``/``-separated segments that are neither empty,
    ``.`` nor ``..``, no NUL, no segment starting with ``.conveyor.``, at most
    1024 UTF-8 bytes.
    """
    if not isinstance(key, str) or not key:
        raise ValueError("object key must be a non-empty string")
    if key.startswith("/"):
        raise ValueError(f"object key {key!r} must be relative, not absolute")
    if "\x00" in key:
        raise ValueError(f"object key {key!r} contains a NUL character")
    if len(key.encode("utf-8", errors="surrogatepass")) > MAX_KEY_BYTES:
        raise ValueError(f"object key is longer than {MAX_KEY_BYTES} bytes")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(f"object key {key!r} has an empty, '.' or '..' segment")
        if segment.startswith(RESERVED_PREFIX):
            raise ValueError(f"object key {key!r} uses the reserved prefix {RESERVED_PREFIX!r}")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid list() prefix: empty, or a key optionally ending in /."""
    if prefix:
        check_key(prefix.removesuffix("/"))
    return prefix


def check_range(offset: int, length: int) -> None:
    """ValueError unless ``offset >= 0`` and ``length >= 0``."""
    if offset < 0 or length < 0:
        raise ValueError(f"a range needs offset >= 0 and length >= 0, got {offset}, {length}")


def check_sha256(expected_sha256: str | None) -> str | None:
    """Normalise an expected digest to lowercase hex; ValueError unless 64 hex characters."""
    if expected_sha256 is None:
        return None
    normalised = expected_sha256.lower()
    if not _SHA256_RE.fullmatch(normalised):
        raise ValueError(f"expected_sha256 {expected_sha256!r} is not 64 hex characters")
    return normalised


class HashingReader:
    """A binary reader that hashes and counts every byte passing through ``read``.

    With ``expect_size_bytes`` and ``expect_sha256`` it also checks, when the
    last expected byte has been read, that the content still has that digest and
    raises StorageError otherwise, before the consumer (an S3 upload) can commit.
    """

    def __init__(
        self,
        raw: BinaryIO,
        *,
        expect_size_bytes: int | None = None,
        expect_sha256: str | None = None,
    ) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self._expect_size_bytes = expect_size_bytes
        self._expect_sha256 = expect_sha256
        self.size_bytes = 0
        """Bytes read so far."""

    def read(self, size: int = -1) -> bytes:
        """Read up to ``size`` bytes (all when negative) from the wrapped reader."""
        chunk = self._raw.read(size)
        self._hash.update(chunk)
        self.size_bytes += len(chunk)
        if (
            self.size_bytes == self._expect_size_bytes
            and self._expect_sha256 is not None
            and self.hexdigest() != self._expect_sha256
        ):
            raise StorageError("source changed while it was being uploaded")
        return chunk

    def hexdigest(self) -> str:
        """Lowercase hex sha256 of what was read so far."""
        return self._hash.hexdigest()


def verify(key: str, actual: str, recorded: list[str], expected: str | None) -> None:
    """Raise ChecksumMismatch unless ``actual`` is acceptable.

    ``recorded`` holds the digest(s) the store recorded for the key (empty for an
    object without a checksum); ``expected`` is the caller's, if any.
    """
    if recorded and actual not in recorded:
        raise ChecksumMismatch(
            f"object {key!r} is corrupt: content sha256 {actual} != recorded {recorded[0]}"
        )
    if expected is not None and actual != expected:
        raise ChecksumMismatch(f"object {key!r} has sha256 {actual}, caller expected {expected}")


class ObjectStore(ABC):
    """A flat namespace of immutable-once-written blobs under ``/``-separated keys.

    Synchronous and thread-safe; async callers use ``asyncio.to_thread``. Every
    method raises ValueError for an invalid key, StorageUnavailable (retriable)
    when the backend cannot be reached, StorageError for other failures.
    """

    @abstractmethod
    def put_bytes(self, key: str, data: Bytes) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically (replacing any object there)."""

    @abstractmethod
    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
        """Return the content of ``key`` after checking it against the recorded sha256 and
        ``expected_sha256``. ObjectNotFound if absent, ChecksumMismatch on a mismatch."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes of ``key`` from byte ``offset`` (fewer only where the object
        ends first), without reading the rest. Not verified against a checksum (that needs the
        whole object): readers of ranges validate what they parse. ValueError for a negative
        offset or length, ObjectNotFound if absent."""

    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        """Stream the local file ``path`` into ``key`` atomically, in chunks.

        FileNotFoundError (not a StorageError) when ``path`` does not exist."""

    @abstractmethod
    def get_file(
        self, key: str, path: str | Path, *, expected_sha256: str | None = None
    ) -> ObjectInfo:
        """Stream ``key`` into the local file ``path`` (parents created), verified like
        get_bytes. ``path`` is replaced atomically and only with verified content."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists under ``key``."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix`` (a plain string prefix, recursive), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error (idempotent)."""

    @abstractmethod
    def info(self, key: str) -> ObjectInfo:
        """Size and recorded sha256 of ``key`` without reading it; ObjectNotFound if absent."""

    @abstractmethod
    def uri_for(self, key: str) -> str:
        """Absolute URI of ``key`` (``file:///abs/dir/key`` or ``s3://bucket/prefix/key``)."""
