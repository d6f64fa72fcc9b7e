"""``webdataset://<dir or s3 prefix>/<shards>``: tar shards of samples grouped by key.

``<shards>`` names the tar files with brace ranges, expanded in order: ``{000000..000127}.tar``
(zero-padded to the first bound's width), ``train-{0..9}-{a,b}.tar`` (ranges and lists, several
braces give every combination). Shards and samples keep that order: shard ``s`` holds the sample
ids after those of shards ``< s``.

The WebDataset convention: consecutive tar members with the same key (the member's path up to
the first ``.`` of its file name) make one sample; its image is the ``.jpg``/``.jpeg``/``.png``
member and its label the ``.cls`` member (a decimal integer); other members are ignored. A
sample without exactly one image, without a readable ``.cls``, or whose image is not a regular
file or runs past the end of the shard is a :class:`BadSample` ("bad tar member"), skipped and
counted. A shard whose headers cannot be parsed fails the read (its later samples cannot be
found).

Opening: with a ``manifest.json`` beside the shards (``conveyor dataset pack`` writes one:
format ``conveyor-webdataset``, the sample count and sha256 of every shard, the class names)
naming exactly these shards, opening reads only it, and a shard's index (member offsets) is
built on its first read. Without one, every shard is indexed at open (its headers read, and its
``.cls`` members for ``num_classes`` = largest label + 1). Images are then read as byte ranges
of their shard (``ObjectStore.get_range``), never whole shards; the manifest's sha256 therefore
describes a shard as written, and each sample is validated as it is read instead.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import tarfile
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.base import (
    IMAGE_EXTENSIONS,
    BadSample,
    DatasetError,
    EncodedDataset,
    EncodedSample,
    split_uri,
)
from conveyor.training.datasets.location import (
    RangeFile,
    open_location,
    read_object,
    read_range,
    stat_object,
    stored_location,
)

MANIFEST_FILE = "manifest.json"
MAX_SHARDS = 1_000_000
"""Most shards one pattern may expand to."""
MAX_CLS_BYTES = 64
"""Largest ``.cls`` member read."""
_INDEX_READ_BYTES = 1 << 20
"""Range size while reading a shard's headers."""
_BRACE_RE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """Every name ``pattern`` stands for, in order (see the module docstring); ValueError for a
    malformed brace or more than MAX_SHARDS names."""
    pieces: list[list[str]] = []
    position = 0
    for match in _BRACE_RE.finditer(pattern):
        pieces.append([pattern[position : match.start()]])
        pieces.append(_alternatives(match.group(1), pattern))
        position = match.end()
    pieces.append([pattern[position:]])
    if any(c in "{}" for piece in pieces[::2] for c in piece[0]):
        raise ValueError(f"{pattern!r}: unbalanced brace")
    total = 1
    for piece in pieces:
        total *= len(piece)
    if total > MAX_SHARDS:
        raise ValueError(f"{pattern!r} expands to {total} names, more than {MAX_SHARDS}")
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _alternatives(body: str, pattern: str) -> list[str]:
    low, dots, high = body.partition("..")
    if dots:
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ValueError(f"{pattern!r}: {{{body}}} must be {{first..last}}, first <= last")
        if int(high) - int(low) >= MAX_SHARDS:
            raise ValueError(f"{pattern!r}: {{{body}}} names more than {MAX_SHARDS} shards")
        return [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    options = body.split(",")
    if len(options) < 2 or not all(options):
        raise ValueError(f"{pattern!r}: {{{body}}} must be a range a..b or a list a,b")
    return options


# -- manifest ------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class TarShard:
    """One shard of a packed WebDataset."""

    file: str
    """Key of the tar file relative to the dataset location (``000000.tar``)."""
    num_samples: int
    """Samples (keys) in it."""
    sha256: str
    """Lowercase hex sha256 of the tar file as written."""


@dataclass(kw_only=True, slots=True, frozen=True)
class WebDatasetManifest:
    """``manifest.json`` of a packed WebDataset, written after the shards."""

    FORMAT: ClassVar[str] = "conveyor-webdataset"
    VERSION: ClassVar[int] = 1

    num_samples: int
    classes: tuple[str, ...]
    """Class names; label ``i`` is ``classes[i]``."""
    shards: tuple[TarShard, ...]

    def to_json(self) -> bytes:
        document = {
            "format": self.FORMAT,
            "version": self.VERSION,
            "num_samples": self.num_samples,
            "classes": list(self.classes),
            "shards": [
                {"file": s.file, "num_samples": s.num_samples, "sha256": s.sha256}
                for s in self.shards
            ],
        }
        return json.dumps(document, indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> WebDatasetManifest:
        """Parse and validate; DatasetError naming the manifest and the problem."""
        name = f"{where}/{MANIFEST_FILE}"
        try:
            raw = json.loads(data)
            if raw.get("format") != cls.FORMAT or raw.get("version") != cls.VERSION:
                raise ValueError(f"not a {cls.FORMAT} v{cls.VERSION} manifest")
            shards = tuple(
                TarShard(
                    file=str(s["file"]),
                    num_samples=_count(s["num_samples"]),
                    sha256=str(s["sha256"]),
                )
                for s in raw["shards"]
            )
            classes = tuple(str(c) for c in raw["classes"])
            manifest = cls(num_samples=_count(raw["num_samples"]), classes=classes, shards=shards)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DatasetError(f"{name} is invalid: {exc}") from None
        if sum(s.num_samples for s in shards) != manifest.num_samples or not classes:
            raise DatasetError(f"{name} is invalid: shard counts or classes do not add up")
        return manifest


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"counts must be integers >= 0, got {value!r}")
    return value


# -- shard index ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    """One sample of a shard: where its image is, its label, or why it is bad."""

    key: str
    label: int
    image_member: str
    offset: int
    size: int
    problem: str | None


def split_member(name: str) -> tuple[str, str]:
    """``dir/key.ext.more`` -> ``("dir/key", "ext.more")`` (lower-cased extension)."""
    folder, slash, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return f"{folder}{slash}{stem}", ext.lower()


def index_shard(fileobj: io.BufferedIOBase, size_bytes: int, shard: str) -> list[_Entry]:
    """The samples of one tar shard, in order; DatasetError when its headers cannot be read
    (a corrupt header, which would otherwise silently end the archive early)."""
    groups: list[tuple[str, list[tuple[tarfile.TarInfo, bytes | None]]]] = []
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for member in tar:
                if member.isdir():
                    continue
                key, ext = split_member(member.name)
                cls = None
                if ext == "cls" and member.isfile() and member.size <= MAX_CLS_BYTES:
                    extracted = tar.extractfile(member)
                    cls = extracted.read() if extracted is not None else None
                if not groups or groups[-1][0] != key:
                    groups.append((key, []))
                groups[-1][1].append((member, cls))
            end = tar.offset
    except tarfile.TarError as exc:
        raise DatasetError(f"{shard} is not a readable tar file: {exc}") from exc
    # tarfile stops at the first header it cannot parse as if the archive ended there; only
    # zero padding may follow the last member.
    fileobj.seek(end)
    while chunk := fileobj.read(_INDEX_READ_BYTES):
        if chunk.strip(b"\0"):
            raise DatasetError(f"{shard}: unreadable tar header at byte {end}")
    return [_entry(key, members, size_bytes) for key, members in groups]


def _entry(key: str, members: list[tuple[tarfile.TarInfo, bytes | None]], size: int) -> _Entry:
    images = [m for m, _ in members if m.name.lower().endswith(IMAGE_EXTENSIONS)]
    labels = [(m, cls) for m, cls in members if split_member(m.name)[1] == "cls"]
    problem = None
    label = -1
    if len(images) != 1:
        problem = f"bad tar member: {len(images)} image members ({'/'.join(IMAGE_EXTENSIONS)})"
    elif not images[0].isfile():
        problem = f"bad tar member: {images[0].name} is not a regular file"
    elif images[0].offset_data + images[0].size > size:
        problem = f"bad tar member: {images[0].name} runs past the end of the shard"
    if problem is None:
        if len(labels) != 1 or labels[0][1] is None:
            problem = "bad tar member: no readable .cls member"
        else:
            text = labels[0][1].decode("ascii", errors="replace").strip()
            if not re.fullmatch(r"-?\d{1,9}", text):
                problem = f"bad tar member: {labels[0][0].name} holds {text[:20]!r}, not a class id"
            else:
                label = int(text)
    image = images[0] if len(images) == 1 else None
    return _Entry(
        key=key,
        label=label,
        image_member=image.name if image is not None else "",
        offset=image.offset_data if image is not None else 0,
        size=image.size if image is not None else 0,
        problem=problem,
    )


class WebDataset(EncodedDataset):
    """See the module docstring; ``shards`` are the tar keys in order."""

    def __init__(self, uri: str, *, storage: StorageSettings | None = None) -> None:
        scheme, rest = split_uri(uri)
        path, _, query = rest.partition("?")
        if query:
            raise DatasetError(f"{uri}: webdataset takes no parameters, got {query!r}")
        pattern = path.rpartition("/")[2]
        try:
            self.shards = expand_braces(pattern)
        except ValueError as exc:
            raise DatasetError(f"{uri}: {exc}") from None
        if not pattern or any(not s.endswith(".tar") for s in self.shards):
            raise DatasetError(
                f"{uri}: shards must be named .tar files, e.g. {{000000..000009}}.tar"
            )
        self._store, self._where = open_location(uri, stored_location(scheme, rest), storage)
        self._indexes: dict[int, list[_Entry]] = {}
        self._locks = [threading.Lock() for _ in self.shards]
        manifest = self._manifest()
        self.classes: tuple[str, ...] | None = None
        if manifest is not None:
            self.classes = manifest.classes
            counts = [entry.num_samples for entry in manifest.shards]
            num_classes = len(manifest.classes)
        else:
            counts, max_label = [], -1
            for index in range(len(self.shards)):
                entries = self._index(index)
                counts.append(len(entries))
                labels = [e.label for e in entries if e.problem is None]
                max_label = max([max_label, *labels])
            num_classes = max_label + 1
        self._starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # [S]
        self._counts = counts
        super().__init__(uri=uri, num_samples=int(sum(counts)), num_classes=num_classes)

    def _manifest(self) -> WebDatasetManifest | None:
        if not self._store.exists(MANIFEST_FILE):
            return None
        data = read_object(self._store, self._where, MANIFEST_FILE)
        manifest = WebDatasetManifest.from_json(data, where=self._where)
        if [s.file for s in manifest.shards] != self.shards:
            return None  # it describes another selection of shards: index these instead
        return manifest

    def _index(self, index: int) -> list[_Entry]:
        with self._locks[index]:
            entries = self._indexes.get(index)
            if entries is None:
                key = self.shards[index]
                size = stat_object(self._store, self._where, key)
                raw = RangeFile(self._store, self._where, key, size)
                with io.BufferedReader(raw, buffer_size=_INDEX_READ_BYTES) as fileobj:
                    entries = index_shard(fileobj, size, f"{self._where}/{key}")
                self._indexes[index] = entries
            return entries

    def _read_encoded(self, ids: NDArray[np.int64]) -> tuple[list[EncodedSample], list[BadSample]]:
        good: list[EncodedSample] = []
        bad: list[BadSample] = []
        shard_of = np.searchsorted(self._starts, ids, side="right") - 1  # [N]
        for sample_id, index in zip(ids.tolist(), shard_of.tolist(), strict=True):
            entries = self._index(index)
            key = self.shards[index]
            if len(entries) != self._counts[index]:
                raise DatasetError(
                    f"{self._where}/{key} holds {len(entries)} samples, the manifest says "
                    f"{self._counts[index]}"
                )
            entry = entries[sample_id - int(self._starts[index])]
            source = f"{self._where}/{key}:{entry.image_member or entry.key}"
            if entry.problem is not None:
                bad.append(BadSample(sample_id=sample_id, source=source, reason=entry.problem))
                continue
            data = read_range(self._store, self._where, key, entry.offset, entry.size)
            good.append(
                EncodedSample(sample_id=sample_id, label=entry.label, data=data, source=source)
            )
        return good, bad


__all__ = ["MANIFEST_FILE", "TarShard", "WebDataset", "WebDatasetManifest", "expand_braces"]
