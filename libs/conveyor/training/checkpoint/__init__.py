"""Checkpoints of a job's training state in an object store: slice files, the manifest that
commits them, retention, verified loading with fallback (:mod:`.store`, :mod:`.manifest`), and
the job progress a resume starts from (:mod:`.progress`, :mod:`.resume`).

The slice file's format (:mod:`.slicefile`: ``encode_slice``, ``decode_slice``) is the one
module that imports torch; import it from there, so that importing the package stays
torch-free for the services that only list and commit checkpoints."""

from conveyor.training.checkpoint.manifest import (
    MANIFEST_FORMAT,
    TRIGGERS,
    DataCursor,
    Manifest,
    SliceFile,
    checkpoint_prefix,
    latest_key,
    manifest_key,
    slice_key,
)
from conveyor.training.checkpoint.progress import EpochOutcome, JobProgress
from conveyor.training.checkpoint.resume import read_progress, resume_point
from conveyor.training.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    Skipped,
    SliceState,
)

__all__ = [
    "MANIFEST_FORMAT",
    "TRIGGERS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "DataCursor",
    "EpochOutcome",
    "JobProgress",
    "Manifest",
    "Skipped",
    "SliceFile",
    "SliceState",
    "checkpoint_prefix",
    "latest_key",
    "manifest_key",
    "read_progress",
    "resume_point",
    "slice_key",
]
