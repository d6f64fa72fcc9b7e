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
import math
import mmap
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

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
from conveyor.training.checkpoint.progress import (
    PROGRESS_METADATA_KEY,
    PROGRESS_TENSORS,
    JobProgress,
)

logger = logging.getLogger(__name__)

SLICE_FORMAT = "1"
_OPTIMIZER_PREFIX = "optimizer."
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names (those a slice's state can hold)."""
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


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


def encode_slice(job_id: str, state: SliceState) -> memoryview:
    """The safetensors file of a slice's state (metadata: job, version, slice, offset).

    Laid out here rather than by ``safetensors.torch.save``, which copies every tensor twice
    (into its own buffer, then into ``bytes``): each tensor is copied once, straight into the
    file's buffer (see :func:`_file_buffer`). The format is safetensors' own (8-byte
    little-endian header length, JSON header padded to 8 bytes, the tensors' bytes in header
    order, larger elements first so every tensor stays aligned); any safetensors reader loads
    it. Returns a view of that buffer."""
    tensors = {"values": state.values.detach().to(torch.float32)}
    for name, value in state.optimizer.items():
        tensors[_OPTIMIZER_PREFIX + name] = value.detach()
    metadata = {
        "format": SLICE_FORMAT,
        "job_id": job_id,
        "version": str(state.version),
        "slice_index": str(state.slice_index),
        "grads_offset": str(state.grads_offset),
    }
    if state.progress is not None:
        metadata[PROGRESS_METADATA_KEY], progress_tensors = state.progress.to_file_parts()
        tensors.update(progress_tensors)
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": metadata}
    data_bytes = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"cannot save {name!r}: dtype {tensor.dtype} has no safetensors name")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [data_bytes, data_bytes + nbytes],
        }
        data_bytes += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    buffer = _file_buffer(start + data_bytes)
    buffer[:start] = len(head).to_bytes(8, "little") + head
    out = torch.frombuffer(buffer, dtype=torch.uint8)  # [file bytes]
    for name in order:
        begin, end = header[name]["data_offsets"]
        if end > begin:
            flat = tensors[name].contiguous().reshape(-1).view(torch.uint8)
            out[start + begin : start + end].copy_(flat)
    return memoryview(buffer)


def _file_buffer(nbytes: int) -> mmap.mmap:
    """Private anonymous memory for a file's bytes, in transparent huge pages where the kernel
    grants them (its ``madvise`` mode, a common default): a fresh buffer of tens of MB in 4 KiB
    pages costs more in page faults than the copy into it (measured: 47 ms for 48 MB, 16 ms in
    huge pages, 8 ms to copy into memory already mapped)."""
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def decode_slice(
    data: bytes | bytearray | memoryview, *, expected: SliceFile | None = None
) -> SliceState:
    """Parse :func:`encode_slice`'s bytes (any safetensors file of a slice's state); ValueError
    when they do not parse or do not hold the slice ``expected`` names.

    No copy: the tensors are read-only views of ``data`` (which they keep alive); copy one
    before changing it in place (a slice owner copies what it loads)."""
    try:
        metadata, tensors = _parse_safetensors(memoryview(data))
        progress = None
        if PROGRESS_METADATA_KEY in metadata:
            progress = JobProgress.from_file_parts(metadata[PROGRESS_METADATA_KEY], {
                name: tensors.pop(name) for name in PROGRESS_TENSORS if name in tensors
            })  # fmt: skip
        state = SliceState(
            slice_index=int(metadata["slice_index"]),
            version=int(metadata["version"]),
            values=tensors.pop("values"),
            optimizer={k.removeprefix(_OPTIMIZER_PREFIX): v for k, v in tensors.items()},
            grads_offset=int(metadata["grads_offset"]),
            progress=progress,
        )
    except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"not a slice state file: {exc}") from exc
    if expected is not None and (state.slice_index, state.grads_offset) != (
        expected.slice_index,
        expected.grads_offset,
    ):
        raise ValueError(f"{expected.key} holds slice {state.slice_index}, not the listed one")
    return state


def _parse_safetensors(data: memoryview) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(``__metadata__``, tensors as views of ``data``) of a safetensors file. ValueError (or
    KeyError, TypeError) for a truncated or malformed one."""
    if data.nbytes < 8:
        raise ValueError("truncated header")
    length = int.from_bytes(data[:8], "little")
    if 8 + length > data.nbytes:
        raise ValueError(f"header of {length} bytes in a file of {data.nbytes}")
    header = json.loads(bytes(data[8 : 8 + length]))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict):
        raise ValueError("no metadata")
    start, tensors = 8 + length, {}
    with warnings.catch_warnings():
        # torch warns that a tensor over read-only memory (bytes) could write to it: see
        # decode_slice, nothing writes to these.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        for name, entry in header.items():
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            begin, end = (int(n) for n in entry["data_offsets"])
            numel = math.prod(shape)
            if begin < 0 or end - begin != numel * dtype.itemsize or start + end > data.nbytes:
                raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit")
            if numel == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            view = torch.frombuffer(data, dtype=dtype, count=numel, offset=start + begin)
            tensors[name] = view.reshape(shape)
    return metadata, tensors


class CheckpointStore:
    """The checkpoints of one job in ``store`` (see the module docstring)."""

    def __init__(self, store: ObjectStore, job_id: str) -> None:
        self.store = store
        self.job_id = job_id

    # -- writing ---------------------------------------------------------------------------

    def write_slice(self, state: SliceState) -> SliceFile:
        """Write one slice's state file (atomically, multipart on S3 for large slices)."""
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
