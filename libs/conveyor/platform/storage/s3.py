"""Object store in an S3 bucket (MinIO, AWS, moto...) through the ``minio`` client.

Each object carries its sha256 as user metadata (``x-amz-meta-sha256``), sent
with the PUT (or the multipart upload's creation), so the checksum becomes
visible exactly when the content does. S3 makes a PUT or a completed multipart
upload visible atomically; minio aborts the multipart upload when a part fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import urllib3
from minio import Minio
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError

from conveyor.platform.storage._fs import replacing
from conveyor.platform.storage.base import (
    CHUNK_BYTES,
    Bytes,
    ChecksumMismatch,
    HashingReader,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    StorageUnavailable,
    check_key,
    check_prefix,
    check_range,
    check_sha256,
    sha256_hex,
    verify,
)

MiB = 1024 * 1024
DEFAULT_PART_SIZE_BYTES = 16 * MiB
"""Multipart part size: bounds upload memory (about 4 parts in flight) per put."""

SHA256_METADATA = "sha256"
"""User-metadata name of the checksum (``x-amz-meta-sha256`` on the wire)."""

_MIN_PART_SIZE_BYTES = 5 * MiB  # S3's limits on parts
_MAX_PART_SIZE_BYTES = 5 * 1024 * MiB
_MAX_PARTS = 10_000

_TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed"}
)
"""S3 error codes worth a retry; every other code is a permanent StorageError."""


class S3ObjectStore(ObjectStore):
    """Objects ``<prefix><key>`` in ``bucket`` (created by the first write when missing)."""

    def __init__(
        self,
        client: Minio,
        bucket: str,
        prefix: str = "",
        *,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
    ) -> None:
        """``prefix`` is a key prefix ("" or ending in "/"); ``part_size_bytes`` must lie
        within S3's 5 MiB..5 GiB part limits (it grows for files past 10,000 parts)."""
        if not bucket:
            raise ValueError("bucket name must not be empty")
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end with '/'")
        check_prefix(prefix)
        if not _MIN_PART_SIZE_BYTES <= part_size_bytes <= _MAX_PART_SIZE_BYTES:
            raise ValueError(f"part_size_bytes must be within 5 MiB..5 GiB, got {part_size_bytes}")
        self._client = client
        self._bucket = bucket
        self._bucket_ready = False
        self._prefix = prefix
        self._part_size_bytes = part_size_bytes

    def put_bytes(self, key: str, data: Bytes) -> ObjectInfo:
        check_key(key)
        digest = sha256_hex(data)
        size_bytes = memoryview(data).nbytes  # len() counts items, not bytes, for typed views
        self._put(key, io.BytesIO(data), size_bytes, digest)
        return ObjectInfo(key=key, size_bytes=size_bytes, sha256=digest)

    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        check_key(key)
        with open(path, "rb") as src:
            # The digest must travel with the upload's first request, so hash first
            # (a local read); the upload re-hashes and fails before completing if
            # the file changed in between.
            digest = hashlib.file_digest(src, "sha256").hexdigest()
            size_bytes = src.tell()
            src.seek(0)
            reader = HashingReader(src, expect_size_bytes=size_bytes, expect_sha256=digest)
            self._put(key, reader, size_bytes, digest)
        return ObjectInfo(key=key, size_bytes=size_bytes, sha256=digest)

    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
        parts: list[bytes] = []
        self._get(check_key(key), check_sha256(expected_sha256), parts.append)
        return b"".join(parts)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        name = self._name(check_key(key))
        if length == 0:
            return b""
        with self._errors(key):
            try:
                response = self._client.get_object(self._bucket, name, offset=offset, length=length)
            except S3Error as exc:
                if exc.code != "InvalidRange":
                    raise
                return b""  # the range starts at or past the end of the object
            try:
                return bytes(response.read())
            finally:
                response.close()
                response.release_conn()

    def get_file(
        self, key: str, path: str | Path, *, expected_sha256: str | None = None
    ) -> ObjectInfo:
        check_key(key)
        expected = check_sha256(expected_sha256)
        with self._errors(key), replacing(Path(path)) as out:
            return self._get(key, expected, out.write)

    def exists(self, key: str) -> bool:
        try:
            self.info(key)
        except ObjectNotFound:
            return False
        return True

    def info(self, key: str) -> ObjectInfo:
        name = self._name(check_key(key))
        with self._errors(key):
            stat = self._client.stat_object(self._bucket, name)
        metadata = stat.metadata or {}
        sha = str(metadata.get(f"x-amz-meta-{SHA256_METADATA}", "")).lower()
        return ObjectInfo(key=key, size_bytes=stat.size or 0, sha256=sha)

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        with self._errors(None):
            objects = self._client.list_objects(
                self._bucket, prefix=self._prefix + prefix, recursive=True
            )
            names = [obj.object_name for obj in objects if obj.object_name and not obj.is_dir]
        return sorted(name.removeprefix(self._prefix) for name in names)

    def delete(self, key: str) -> None:
        with self._errors(key):
            self._client.remove_object(self._bucket, self._name(check_key(key)))

    def uri_for(self, key: str) -> str:
        return f"s3://{self._bucket}/{self._name(check_key(key))}"

    def _name(self, key: str) -> str:
        return self._prefix + key

    def _ensure_bucket(self) -> None:
        """Create the bucket before this store's first write when it is missing (a fresh MinIO
        has none); reads of a missing bucket stay errors."""
        if self._bucket_ready:
            return
        with self._errors(None):
            if not self._client.bucket_exists(self._bucket):
                try:
                    self._client.make_bucket(self._bucket)
                except S3Error as exc:  # another writer created it meanwhile
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
        self._bucket_ready = True

    def _put(self, key: str, data: BinaryIO | HashingReader, size_bytes: int, digest: str) -> None:
        self._ensure_bucket()
        # Stay within S3's 10,000-part limit for very large objects.
        part_size = max(self._part_size_bytes, -(-size_bytes // _MAX_PARTS))
        with self._errors(key):
            self._client.put_object(
                self._bucket,
                self._name(key),
                data,  # type: ignore[arg-type]  # minio only calls read()
                size_bytes,
                metadata={SHA256_METADATA: digest},
                part_size=part_size,
            )

    def _get(self, key: str, expected: str | None, sink: Callable[[bytes], Any]) -> ObjectInfo:
        """Stream ``key`` into ``sink`` and verify it against its metadata and ``expected``."""
        with self._errors(key):
            response = self._client.get_object(self._bucket, self._name(key))
            try:
                # Headers and body come from one response: they describe the same version.
                recorded = response.headers.get(f"x-amz-meta-{SHA256_METADATA}", "").lower()
                if expected is not None and recorded and recorded != expected:
                    raise ChecksumMismatch(
                        f"object {key!r} has sha256 {recorded}, caller expected {expected}"
                    )
                hasher = hashlib.sha256()
                size_bytes = 0
                for chunk in response.stream(CHUNK_BYTES):
                    hasher.update(chunk)
                    size_bytes += len(chunk)
                    sink(chunk)
            finally:
                response.close()
                response.release_conn()
        digest = hasher.hexdigest()
        verify(key, digest, [recorded] if recorded else [], expected)
        return ObjectInfo(key=key, size_bytes=size_bytes, sha256=digest)

    @contextlib.contextmanager
    def _errors(self, key: str | None) -> Iterator[None]:
        """Map minio/urllib3 failures onto the storage errors."""
        try:
            yield
        except StorageError:
            raise
        except S3Error as exc:
            _raise_s3(exc, self._bucket, None if key is None else self.uri_for(key))
        except ServerError as exc:
            raise StorageUnavailable(f"S3 server error on bucket {self._bucket!r}: {exc}") from exc
        except InvalidResponseError as exc:
            # A proxy's HTML error page: a 5xx is transient like any server error.
            error = StorageUnavailable if "Response code: 5" in str(exc) else StorageError
            raise error(f"unexpected S3 response: {exc}") from exc
        except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            raise StorageUnavailable(f"cannot reach S3 endpoint: {exc}") from exc
        except (MinioException, OSError) as exc:
            raise StorageError(f"S3 operation failed: {exc}") from exc


def _raise_s3(exc: S3Error, bucket: str, uri: str | None) -> NoReturn:
    if exc.code == "NoSuchKey" and uri is not None:
        raise ObjectNotFound(f"object {uri} not found") from exc
    if exc.code == "NoSuchBucket":
        raise StorageError(f"bucket {bucket!r} does not exist") from exc
    error = StorageUnavailable if exc.code in _TRANSIENT_CODES else StorageError
    raise error(f"S3 error {exc.code} on {uri or bucket}: {exc.message}") from exc
