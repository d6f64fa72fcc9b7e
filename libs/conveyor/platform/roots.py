"""Roots: the local directories and S3 prefixes inside which jobs may write and read.

The operator lists the roots (``StorageSettings.output_roots`` and ``dataset_roots``; the
object store is always one); a job spec only picks a place inside one of them. This module
decides "inside" and nothing else. It writes nothing and talks to no server; it reads the file
system only to resolve symbolic links.

A location is ``file://<path>``, a bare local path, or ``s3://<bucket>[/<prefix>]``. It is inside
a root only after both are normalised:

- local: ``os.path.realpath`` against this process's working directory, so relative paths,
  ``..`` and every symbolic link of the part that exists are resolved the way the operating
  system resolves them when the path is opened; then compared by whole path components
  (``/data`` holds ``/data/x``, not ``/data2``). A path that does not exist yet (an output
  directory) is resolved as far as it exists and taken as written from there.
- S3: the bucket compared exactly, the key by whole ``/`` segments (``s3://b/data`` holds
  ``s3://b/data/x``, not ``s3://b/data2``). Keys are literal in S3, but an HTTP client or server
  may collapse ``.`` and ``..`` in a URL path, so a key with ``.``, ``..`` or empty segments is
  refused rather than interpreted. Trailing slashes are dropped, as ``open_store`` drops them.

A check is only as good as its agreement with the writer or reader: callers check the very
string they then open, or open the :class:`Location` the check returns.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3 bucket naming rules (3-63 of a-z 0-9 . -, starting and ending alphanumeric)."""


class LocationRefused(ValueError):
    """A location that is malformed or outside every allowed root; ``str()`` gives the reason,
    naming the allowed roots."""


@dataclass(frozen=True, slots=True)
class Location:
    """A normalised place: a local real path (``scheme`` ``file``, ``parts`` its components
    below ``/``) or an S3 prefix (``scheme`` ``s3``, ``bucket``, ``parts`` the key's segments)."""

    scheme: Literal["file", "s3"]
    bucket: str
    """The S3 bucket; empty for a local path."""
    parts: tuple[str, ...]
    """Path components (local) or key segments (S3); empty for ``/`` or the whole bucket."""

    def __str__(self) -> str:
        path = "/".join(self.parts)
        if self.scheme == "file":
            return f"file:///{path}"
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"

    def is_within(self, root: Location) -> bool:
        """True when this is ``root`` or lies below it, by whole components."""
        return (
            self.scheme == root.scheme
            and self.bucket == root.bucket
            and self.parts[: len(root.parts)] == root.parts
        )


def resolve_location(location: str) -> Location:
    """Normalise ``location`` (see the module docstring). ValueError for an empty or malformed
    location, a NUL byte, a scheme other than ``file://`` and ``s3://``, an invalid bucket name
    or a ``.``, ``..`` or empty segment in an S3 key."""
    if "\0" in location:
        raise ValueError("a location must not contain a NUL byte")
    if location.startswith("s3://"):
        return _resolve_s3(location)
    path = location.removeprefix("file://")
    if "://" in path:
        raise ValueError(f"{location!r}: only file://, s3:// or a local path name a location")
    if not path:
        raise ValueError(f"{location!r} names no path")
    real = os.path.realpath(path)
    return Location(scheme="file", bucket="", parts=tuple(p for p in real.split(os.sep) if p))


def _resolve_s3(location: str) -> Location:
    bucket, _, key = location.removeprefix("s3://").partition("/")
    if not BUCKET_RE.fullmatch(bucket):
        raise ValueError(
            f"{location!r}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . -)"
        )
    key = key.rstrip("/")
    parts = tuple(key.split("/")) if key else ()
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{location!r}: an S3 key must not have '.', '..' or empty segments")
    return Location(scheme="s3", bucket=bucket, parts=parts)


@dataclass(frozen=True, slots=True)
class Roots:
    """The places one kind of location must fall inside, normalised when built."""

    kind: str
    """What the roots are for, in messages: ``output``, ``dataset``."""
    setting: str
    """The operator's setting that lists them, named in refusals."""
    roots: tuple[Location, ...]

    @classmethod
    def resolve(cls, kind: str, setting: str, roots: Iterable[str]) -> Roots:
        """Normalise ``roots`` now (local ones against the working directory); ValueError
        naming a malformed one."""
        resolved = []
        for root in roots:
            try:
                resolved.append(resolve_location(root))
            except ValueError as exc:
                raise ValueError(f"{kind} root {root!r} is not usable: {exc}") from exc
        return cls(kind=kind, setting=setting, roots=tuple(resolved))

    def check(self, location: str) -> Location:
        """``location`` normalised, when it lies inside one of the roots. LocationRefused
        otherwise, and for a malformed location; the message names the allowed roots."""
        try:
            resolved = resolve_location(location)
        except ValueError as exc:
            raise LocationRefused(f"not a usable {self.kind} location: {exc}") from exc
        if any(resolved.is_within(root) for root in self.roots):
            return resolved
        # The resolved path is left out on purpose: it would tell a client where a server's
        # symbolic links point.
        raise LocationRefused(
            f"{location} is outside the allowed {self.kind} roots ({self.describe()}), "
            f"compared after resolving '..' and symbolic links; the operator lists them in "
            f"{self.setting}"
        )

    def describe(self) -> str:
        """The roots, comma-separated, for messages."""
        return ", ".join(str(root) for root in self.roots) or "none"
