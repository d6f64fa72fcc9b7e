"""Fixtures shared by several integration test files of this folder: a read failure injected
into the object stores' uploads (the storage behaviour suite and the S3 specifics use it). The
stack-wide fixtures, Kafka and the S3 endpoint, are in tests/conftest.py."""

from __future__ import annotations

import errno
from collections.abc import Callable

import pytest

from conveyor.libs.storage.base import CHUNK_BYTES, HashingReader


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
