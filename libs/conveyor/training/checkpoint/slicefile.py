"""The file of one slice's state: a safetensors file laid out by :func:`encode_slice` and
parsed by :func:`decode_slice` (only safetensors and JSON, never pickle).

The part of checkpoints that imports torch: :class:`~.store.CheckpointStore` imports it when
it first writes or reads a slice file, so a process that only lists, commits and retains
checkpoints (the gateway, the sharder, the checkpointer) does not load torch; the checkpointer
reads what it needs of a file back (its identity, the job's progress) with :mod:`.slicehead`,
over the same header."""

from __future__ import annotations

import json
import math
import mmap
import warnings
from typing import Any

import torch

from conveyor.training.checkpoint.manifest import SliceFile
from conveyor.training.checkpoint.progress import (
    PROGRESS_METADATA_KEY,
    PROGRESS_TENSORS,
    JobProgress,
)
from conveyor.training.checkpoint.slicehead import read_header
from conveyor.training.checkpoint.store import SliceState

SLICE_FORMAT = "1"
_OPTIMIZER_PREFIX = "optimizer."
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names (those a slice's state can hold)."""
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


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
    head = read_header(data)
    metadata, header = head.metadata, head.entries
    start, tensors = head.data_start, {}
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
