"""A checkpoint's manifest: the commit record that says what a checkpoint holds.

A checkpoint of job J at parameter version V lives under ``checkpoints/J/v<V>/``: one
safetensors file per aggregator slice (``slice-<p>.safetensors``) and ``manifest.json``,
written last. A checkpoint exists (is *committed*) exactly when its manifest does, and it is
*good* when every file it lists has the listed size and sha256. ``checkpoints/J/latest.json``
points at the newest commit; it is a shortcut for readers, the listing is the truth.

The manifest is self-describing (nanoGPT-style): the job spec, the model's name, options and
shapes, the parameter version and optimizer step, the data cursor (which train batches the
version includes) and how the job's randomness is derived, beside the files.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_FORMAT = 1
"""Version of the manifest layout."""

TRIGGERS = frozenset({"every_steps", "every_s", "epoch_end", "request", "job_end"})
"""Why a checkpoint was taken (``StepClose.checkpoint``)."""

_VERSION_DIR_RE = re.compile(r"v(\d{10})")


def job_checkpoints_prefix(job_id: str) -> str:
    """Key prefix of every checkpoint of a job."""
    return f"checkpoints/{job_id}/"


def checkpoint_prefix(job_id: str, version: int) -> str:
    """Key prefix of the checkpoint of ``job_id`` at ``version`` (zero-padded: keys sort by
    version)."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"{job_checkpoints_prefix(job_id)}v{version:010d}/"


def slice_key(job_id: str, version: int, slice_index: int) -> str:
    """Key of slice ``slice_index``'s state file."""
    return f"{checkpoint_prefix(job_id, version)}slice-{slice_index}.safetensors"


def manifest_key(job_id: str, version: int) -> str:
    return f"{checkpoint_prefix(job_id, version)}manifest.json"


def latest_key(job_id: str) -> str:
    return f"{job_checkpoints_prefix(job_id)}latest.json"


def version_of(job_id: str, key: str) -> int | None:
    """The version of the checkpoint directory ``key`` lies in (None: not in one)."""
    rest = key.removeprefix(job_checkpoints_prefix(job_id))
    if rest == key:
        return None
    match = _VERSION_DIR_RE.fullmatch(rest.partition("/")[0])
    return int(match.group(1)) if match else None


@dataclass(kw_only=True, slots=True, frozen=True)
class SliceFile:
    """One slice's state file, as the manifest lists it."""

    slice_index: int
    key: str
    """Object key (relative to the store's root)."""
    size_bytes: int
    sha256: str
    grads_offset: int
    """Lowest offset of the slice's grads partition that versions after this one may still
    need: a new owner replays the partition from here (exact optimizer state)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DataCursor:
    """Where the job's data stands at the checkpoint's version."""

    epoch: int
    """The epoch the next train batch belongs to."""
    applied_batches: list[str] = field(default_factory=list)
    """Train batches of ``epoch`` and later epochs already in the parameters (a resume skips
    them)."""
    samples_trained: int = 0
    """Train samples applied over all epochs."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Manifest:
    """See the module docstring."""

    job_id: str
    version: int
    """Parameter version the checkpoint holds."""
    step: int
    """Optimizer steps with samples applied up to ``version``."""
    trigger: str
    """Why it was taken (:data:`TRIGGERS`)."""
    created_at: float
    """Unix seconds of the commit."""
    files: list[SliceFile]
    """Every slice, by index."""
    data_cursor: DataCursor
    rng: dict[str, Any]
    """How the job's randomness is derived (the seed and its derivation), so a resume draws
    the same numbers; no generator state is carried because nothing draws from one."""
    spec: dict[str, Any]
    """The job spec (JSON form)."""
    model: dict[str, Any]
    """``name``, ``options``, ``num_classes``, ``sample_shape``, ``num_params``."""
    format: int = MANIFEST_FORMAT

    def __post_init__(self) -> None:
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown checkpoint trigger {self.trigger!r}")
        if sorted(f.slice_index for f in self.files) != list(range(len(self.files))):
            raise ValueError("a manifest lists slices 0..K-1, each once")

    @property
    def size_bytes(self) -> int:
        """Bytes of every file it lists."""
        return sum(f.size_bytes for f in self.files)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest; ValueError with the reason for anything malformed."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            if raw.get("format") != MANIFEST_FORMAT:
                known = MANIFEST_FORMAT
                raise ValueError(f"format {raw.get('format')!r}, this reader knows {known}")
            files = [SliceFile(**entry) for entry in raw.pop("files")]
            cursor = DataCursor(**raw.pop("data_cursor"))
            return cls(files=sorted(files, key=lambda f: f.slice_index), data_cursor=cursor, **raw)
        except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"malformed manifest: {exc}") from exc
