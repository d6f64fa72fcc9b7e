"""``manifest.json`` of an npz dataset: the list of shards, written last as the commit."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from conveyor.platform.storage import ObjectStore
from conveyor.platform.storage.base import check_key
from conveyor.training.datasets.base import DatasetError
from conveyor.training.datasets.location import read_object

MANIFEST_FILE = "manifest.json"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardEntry:
    """One shard file of an npz dataset."""

    file: str
    """Key of the shard relative to the dataset location (``shard-00000.npz``)."""
    num_samples: int
    """Samples in the shard (> 0)."""
    sha256: str
    """Lowercase hex sha256 of the shard file's bytes."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Manifest:
    """Describes an npz dataset; shards in global sample-id order."""

    FORMAT: ClassVar[str] = "conveyor-npz"
    VERSION: ClassVar[int] = 1

    num_samples: int
    """Total samples, equal to the sum over shards."""
    num_classes: int
    """Labels lie in ``[0, num_classes)``."""
    sample_shape: tuple[int, int, int]
    """``(C, H, W)`` of every image."""
    shards: tuple[ShardEntry, ...]
    """The shard files, in order."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``manifest.json``."""
        return {
            "format": self.FORMAT,
            "version": self.VERSION,
            "num_samples": self.num_samples,
            "num_classes": self.num_classes,
            "sample_shape": list(self.sample_shape),
            "shards": [
                {"file": s.file, "num_samples": s.num_samples, "sha256": s.sha256}
                for s in self.shards
            ],
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate; DatasetError naming ``where`` and the problem."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetError(f"{where}/{MANIFEST_FILE} is not valid JSON: {exc}") from exc
        try:
            return _parse(raw)
        except _Invalid as exc:
            raise DatasetError(f"{where}/{MANIFEST_FILE} is invalid: {exc}") from None


class _Invalid(Exception):
    pass


def _int(raw: dict[str, Any], key: str, *, low: int = 1) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _Invalid(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def _check_keys(raw: object, expected: set[str], what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _Invalid(f"{what} must be a JSON object")
    if set(raw) != expected:
        missing, unknown = sorted(expected - set(raw)), sorted(set(raw) - expected)
        raise _Invalid(f"{what}: missing keys {missing}, unknown keys {unknown}")
    return raw


def _parse(raw: object) -> Manifest:
    top = _check_keys(
        raw,
        {"format", "version", "num_samples", "num_classes", "sample_shape", "shards"},
        "manifest",
    )
    if top["format"] != Manifest.FORMAT:
        raise _Invalid(f"format must be {Manifest.FORMAT!r}, got {top['format']!r}")
    if top["version"] != Manifest.VERSION:
        raise _Invalid(f"unsupported version {top['version']!r} (supported: {Manifest.VERSION})")
    shape = top["sample_shape"]
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise _Invalid(f"sample_shape must be 3 positive integers [C,H,W], got {shape!r}")
    shards_raw = top["shards"]
    if not isinstance(shards_raw, list) or not shards_raw:
        raise _Invalid("shards must be a non-empty list")
    shards: list[ShardEntry] = []
    for i, item in enumerate(shards_raw):
        entry = _check_keys(item, {"file", "num_samples", "sha256"}, f"shards[{i}]")
        name, sha = entry["file"], entry["sha256"]
        try:
            check_key(name)
        except ValueError as exc:
            raise _Invalid(f"shards[{i}].file: {exc}") from None
        if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
            raise _Invalid(f"shards[{i}].sha256 must be 64 lowercase hex characters")
        shards.append(ShardEntry(file=name, num_samples=_int(entry, "num_samples"), sha256=sha))
    num_samples = _int(top, "num_samples")
    if sum(s.num_samples for s in shards) != num_samples:
        raise _Invalid(
            f"num_samples {num_samples} != sum of shard sizes {sum(s.num_samples for s in shards)}"
        )
    return Manifest(
        num_samples=num_samples,
        num_classes=_int(top, "num_classes"),
        sample_shape=(shape[0], shape[1], shape[2]),
        shards=tuple(shards),
    )


def read_manifest(store: ObjectStore, where: str) -> Manifest:
    """Fetch and validate the manifest at the store's root."""
    data = read_object(store, where, MANIFEST_FILE)
    return Manifest.from_json(data, where=where)
