"""Choosing and reading the checkpoint a job resumes from (see :mod:`.progress`)."""

from __future__ import annotations

from conveyor.training.checkpoint.progress import JobProgress
from conveyor.training.checkpoint.store import CheckpointError, CheckpointStore


def read_progress(checkpoints: CheckpointStore, version: int) -> JobProgress:
    """The job progress of committed checkpoint ``version`` (slice 0's file, verified).
    CheckpointError when the checkpoint is torn or corrupt, or holds no progress."""
    manifest = checkpoints.read_manifest(version)
    state = checkpoints.read_slice(manifest.files[0])
    if state.progress is None or state.progress.version != version:
        raise CheckpointError(f"version {version}: slice 0 holds no job progress")
    return state.progress


def resume_point(checkpoints: CheckpointStore) -> tuple[JobProgress | None, list[str]]:
    """The newest committed checkpoint a job can resume from: (its progress, why each newer
    one could not be used); (None, reasons) when there is none. Storage failures other than
    a torn or corrupt checkpoint raise the store's StorageError."""
    refused: list[str] = []
    for version in checkpoints.committed_versions():
        try:
            progress = read_progress(checkpoints, version)
        except CheckpointError as exc:
            refused.append(f"v{version}: {exc}")
            continue
        if progress.usable:
            return progress, refused
        refused.append(f"v{version}: the evaluation of an earlier epoch is not in it")
    return None, refused
