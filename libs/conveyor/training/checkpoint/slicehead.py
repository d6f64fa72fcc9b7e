"""What a slice file says of itself, read without torch: its safetensors header (the metadata
and where each tensor lies) and, for the checkpointer, the slice's identity and the job's
progress (whose tensors are small int32 and float64 arrays, read as numpy views).

:mod:`.slicefile` reads the tensors of a slice's state with torch over the same header; this
module is what a process that never trains (the checkpointer committing a job's final
checkpoint from the files in the store) reads, so that it need not load torch for it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from conveyor.training.checkpoint.progress import (
    PROGRESS_METADATA_KEY,
    PROGRESS_TENSORS,
    JobProgress,
)

_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {"I32": np.dtype(np.int32), "F64": np.dtype(np.float64)}
"""The dtypes of the progress tensors."""


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """The parsed header of a safetensors file."""

    metadata: dict[str, str]
    """``__metadata__``."""
    entries: dict[str, dict[str, Any]]
    """Tensor name -> {dtype, shape, data_offsets} as written."""
    data_start: int
    """Where the tensors' bytes start (offsets count from here)."""


def read_header(data: memoryview) -> SafetensorsHeader:
    """The header of a safetensors file; ValueError (or KeyError, TypeError) for a truncated
    or malformed one."""
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
    return SafetensorsHeader(metadata=metadata, entries=header, data_start=8 + length)


@dataclass(frozen=True, slots=True)
class SliceHead:
    """A slice file's identity and, in slice 0's, the job's progress."""

    slice_index: int
    version: int
    grads_offset: int
    progress: JobProgress | None


def read_slice_head(data: bytes | bytearray | memoryview) -> SliceHead:
    """The identity and progress of a slice file written by
    :func:`~.slicefile.encode_slice`, without torch; ValueError when it does not parse."""
    view = memoryview(data)
    try:
        head = read_header(view)
        progress = None
        if PROGRESS_METADATA_KEY in head.metadata:
            arrays = {
                name: _numpy_view(view, head, name)
                for name in PROGRESS_TENSORS
                if name in head.entries
            }
            progress = JobProgress.from_file_parts(head.metadata[PROGRESS_METADATA_KEY], arrays)
        return SliceHead(
            slice_index=int(head.metadata["slice_index"]),
            version=int(head.metadata["version"]),
            grads_offset=int(head.metadata["grads_offset"]),
            progress=progress,
        )
    except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"not a slice state file: {exc}") from exc


def _numpy_view(data: memoryview, head: SafetensorsHeader, name: str) -> np.ndarray[Any, Any]:
    entry = head.entries[name]
    dtype = _NUMPY_DTYPES[entry["dtype"]]
    shape = tuple(int(n) for n in entry["shape"])
    begin, end = (int(n) for n in entry["data_offsets"])
    count = int(np.prod(shape))
    if begin < 0 or end - begin != count * dtype.itemsize or head.data_start + end > data.nbytes:
        raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit")
    if count == 0:
        return np.empty(shape, dtype=dtype)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=head.data_start + begin)
    return flat.reshape(shape)
