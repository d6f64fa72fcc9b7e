"""Reading and writing a job's checkpoints in an object store (``file://`` or ``s3://``).

Writers: each aggregator slice owner writes its slice's state (:meth:`CheckpointStore.
write_slice`); the checkpointer commits (:meth:`CheckpointStore.commit`: checks every listed
file, writes the manifest, moves ``latest``) and applies retention (:meth:`CheckpointStore.
retain`). Readers (:meth:`CheckpointStore.latest_good`) verify what they load and fall back to
the previous checkpoint when one is torn (a file or the manifest missing) or corrupt (a size or
sha256 that does not match, a file that does not parse), reporting each one skipped.

Only safetensors and JSON are read back, never pickle. Calls are blocking (object-store I/O):
use a thread from async code. Storage failures raise the store's StorageError.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.platform.storage import ObjectNotFound, ObjectStore, StorageError
from conveyor.training.checkpoint.manifest import (
    Manifest,
    SliceFile,
    checkpoint_prefix,
    job_checkpoints_prefix,
    latest_key,
    manifest_key,
    slice_key,
    version_of,
)

if TYPE_CHECKING:
    import torch

    from conveyor.training.checkpoint.progress import JobProgress

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SliceState:
    """What a slice owner saves at a version boundary."""

    slice_index: int
    version: int
    values: torch.Tensor
    """fp32 [numel] parameters of the slice at ``version``."""
    optimizer: dict[str, torch.Tensor]
    """The slice optimizer's state (:meth:`~conveyor.training.optim.SliceOptimizer.
    state_tensors`)."""
    grads_offset: int
    """See :attr:`~conveyor.training.checkpoint.manifest.SliceFile.grads_offset`."""
    progress: JobProgress | None = None
    """The job's progress at ``version`` (:mod:`.progress`): in slice 0's file only."""


@dataclass(frozen=True, slots=True)
class Skipped:
    """A checkpoint a reader did not use, and why."""

    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One row of :meth:`CheckpointStore.listing`."""

    version: int
    state: str
    """``committed`` (its manifest exists) or ``incomplete`` (files without a manifest: being
    written, or torn by a crash)."""
    step: int | None
    created_at: float | None
    size_bytes: int
    trigger: str | None
    uri: str
    latest: bool


class CheckpointError(StorageError):
    """A checkpoint cannot be committed or read as asked (the message says which and why)."""


class CheckpointStore:
    """The checkpoints of one job in ``store`` (see the module docstring)."""

    def __init__(self, store: ObjectStore, job_id: str) -> None:
        self.store = store
        self.job_id = job_id

    # -- writing ---------------------------------------------------------------------------

    def write_slice(self, state: SliceState) -> SliceFile:
        """Write one slice's state file (atomically, multipart on S3 for large slices)."""
        # The slice file's format imports torch: loaded by the first slice file written or
        # read, not by the services that only list and commit checkpoints.
        from conveyor.training.checkpoint.slicefile import encode_slice

        key = slice_key(self.job_id, state.version, state.slice_index)
        info = self.store.put_bytes(key, encode_slice(self.job_id, state))
        return SliceFile(
            slice_index=state.slice_index,
            key=info.key,
            size_bytes=info.size_bytes,
            sha256=info.sha256,
            grads_offset=state.grads_offset,
        )

    def commit(self, manifest: Manifest) -> str:
        """Check that every file the manifest lists is in the store with its size and
        sha256, then write the manifest (the commit) and move ``latest`` to it. Returns the
        manifest's URI. CheckpointError when a file is missing or differs."""
        if manifest.job_id != self.job_id:
            raise CheckpointError(f"manifest of job {manifest.job_id}, not {self.job_id}")
        for entry in manifest.files:
            try:
                info = self.store.info(entry.key)
            except ObjectNotFound as exc:
                missing = f"version {manifest.version}: {entry.key} is missing"
                raise CheckpointError(missing) from exc
            if info.size_bytes != entry.size_bytes or (info.sha256 and info.sha256 != entry.sha256):
                raise CheckpointError(
                    f"version {manifest.version}: {entry.key} is not the file that was written"
                )
        info = self.store.put_bytes(manifest_key(self.job_id, manifest.version), manifest.to_json())
        pointer = {"version": manifest.version, "manifest": info.key, "sha256": info.sha256}
        self.store.put_bytes(latest_key(self.job_id), json.dumps(pointer).encode())
        return self.store.uri_for(info.key)

    def retain(self, keep_last: int) -> list[int]:
        """Delete every committed checkpoint but the newest ``keep_last``, and every
        incomplete one older than the newest commit (torn by a crash; a newer one may be being
        written). A manifest goes first, so a half-deleted checkpoint is never committed.
        Returns the versions deleted."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        keys = self._keys_by_version()
        committed = sorted((v for v, ks in keys.items() if self._manifest_in(v, ks)), reverse=True)
        if not committed:
            return []
        newest = committed[0]
        doomed = set(committed[keep_last:])
        doomed |= {v for v, ks in keys.items() if v < newest and not self._manifest_in(v, ks)}
        for version in sorted(doomed):
            manifest = manifest_key(self.job_id, version)
            for key in sorted(keys[version], key=lambda k: k != manifest):
                self.store.delete(key)
        return sorted(doomed)

    # -- reading ---------------------------------------------------------------------------

    def committed_versions(self) -> list[int]:
        """Versions with a manifest, newest first."""
        keys = self._keys_by_version()
        return sorted((v for v, ks in keys.items() if self._manifest_in(v, ks)), reverse=True)

    def read_manifest(self, version: int) -> Manifest:
        """The manifest of ``version``; CheckpointError when it is missing or malformed."""
        try:
            return Manifest.from_json(self.store.get_bytes(manifest_key(self.job_id, version)))
        except ObjectNotFound as exc:
            raise CheckpointError(f"version {version} has no manifest") from exc
        except ValueError as exc:
            raise CheckpointError(f"version {version}: {exc}") from exc

    def read_slice(self, entry: SliceFile) -> SliceState:
        """Load and verify one listed file; CheckpointError when it is missing, truncated or
        corrupt."""
        from conveyor.training.checkpoint.slicefile import decode_slice  # see write_slice

        try:
            data = self.store.get_bytes(entry.key, expected_sha256=entry.sha256)
        except ObjectNotFound as exc:
            raise CheckpointError(f"{entry.key} is missing") from exc
        except StorageError as exc:
            if getattr(exc, "retriable", False):
                raise
            raise CheckpointError(f"{entry.key}: {exc}") from exc
        if len(data) != entry.size_bytes:
            raise CheckpointError(f"{entry.key}: {len(data)} bytes, listed {entry.size_bytes}")
        try:
            return decode_slice(data, expected=entry)
        except ValueError as exc:
            raise CheckpointError(f"{entry.key}: {exc}") from exc

    def latest_good(
        self, slices: Iterable[int] | None = None
    ) -> tuple[Manifest | None, dict[int, SliceState], list[Skipped]]:
        """The newest committed checkpoint whose files verify: (manifest, the states of
        ``slices`` (all when None), the newer checkpoints skipped and why); (None, {}, skipped)
        when none is good. Only the requested slices' files are read."""
        skipped: list[Skipped] = []
        for version in self.committed_versions():
            try:
                manifest = self.read_manifest(version)
                wanted = manifest.files if slices is None else [manifest.files[p] for p in slices]
                states = {entry.slice_index: self.read_slice(entry) for entry in wanted}
            except IndexError:
                skipped.append(Skipped(version, "the manifest lists fewer slices than asked"))
                continue
            except CheckpointError as exc:
                logger.warning("job %s: checkpoint v%d is unusable: %s", self.job_id, version, exc)
                skipped.append(Skipped(version, str(exc)))
                continue
            if any(s.version != version for s in states.values()):
                skipped.append(Skipped(version, "a slice file holds another version"))
                continue
            return manifest, states, skipped
        return None, {}, skipped

    def listing(self) -> list[CheckpointInfo]:
        """Every checkpoint of the job, newest first (committed and incomplete)."""
        keys = self._keys_by_version()
        committed = [v for v, ks in keys.items() if self._manifest_in(v, ks)]
        latest = max(committed, default=None)
        rows: list[CheckpointInfo] = []
        for version in sorted(keys, reverse=True):
            manifest: Manifest | None = None
            if version in committed:
                try:
                    manifest = self.read_manifest(version)
                except CheckpointError as exc:
                    logger.warning("job %s: %s", self.job_id, exc)
            rows.append(
                CheckpointInfo(
                    version=version,
                    state="committed" if manifest is not None else "incomplete",
                    step=manifest.step if manifest else None,
                    created_at=manifest.created_at if manifest else None,
                    size_bytes=manifest.size_bytes if manifest else 0,
                    trigger=manifest.trigger if manifest else None,
                    uri=self.store.uri_for(checkpoint_prefix(self.job_id, version).rstrip("/")),
                    latest=version == latest,
                )
            )
        return rows

    def _keys_by_version(self) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        for key in self.store.list(job_checkpoints_prefix(self.job_id)):
            version = version_of(self.job_id, key)
            if version is not None:
                found.setdefault(version, []).append(key)
        return found

    def _manifest_in(self, version: int, keys: list[str]) -> bool:
        return manifest_key(self.job_id, version) in keys
