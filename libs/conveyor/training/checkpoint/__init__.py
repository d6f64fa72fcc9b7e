"""Checkpoints of a job's training state in an object store: slice files, the manifest that
commits them, retention, verified loading with fallback (:mod:`.store`, :mod:`.manifest`)."""

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
from conveyor.training.checkpoint.store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    Skipped,
    SliceState,
    decode_slice,
    encode_slice,
)

__all__ = [
    "MANIFEST_FORMAT",
    "TRIGGERS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "DataCursor",
    "Manifest",
    "Skipped",
    "SliceFile",
    "SliceState",
    "checkpoint_prefix",
    "decode_slice",
    "encode_slice",
    "latest_key",
    "manifest_key",
    "slice_key",
]
