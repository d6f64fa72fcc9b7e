"""Tensor bytes on the wire, the sending side: :class:`_PayloadWriter` lays the values of tensor
fields out after the header (:mod:`~conveyor.platform.codec.tensors` reads them back).

A tensor field takes a torch tensor or a numpy array: both go out as the same bytes and the same
descriptor, and decode always gives a torch tensor. This module imports numpy only, so a
process that only sends arrays never loads torch (the preprocessors: their batches are numpy
from decoding to the wire, and torch would cost each of them ~200 MiB and seconds of start-up).
A torch tensor is handled through the torch module that made it: a process holding one has
imported torch.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from conveyor.platform.codec.errors import MalformedMessage, MessageTooLarge
from conveyor.platform.codec.limits import ALIGN_BYTES, PADS, CodecLimits

WIRE_DTYPES = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
)
"""The name on the wire of every tensor dtype the codec carries (torch's and numpy's names;
numpy has no bfloat16)."""
if sys.byteorder != "little":  # tensor bytes travel in host order; every supported host is LE
    raise ImportError("conveyor.platform.codec needs a little-endian host")

_ARRAY_DTYPES = {np.dtype(name): name for name in WIRE_DTYPES if name != "bfloat16"}
_torch_names: dict[Any, str] = {}
"""torch dtype -> wire name, filled the first time a torch tensor is written."""


class _PayloadWriter:
    """Lays tensors out after the header; holds views of their bytes until the final join."""

    __slots__ = ("chunks", "count", "limits", "size")

    def __init__(self, limits: CodecLimits) -> None:
        self.limits = limits
        self.chunks: list[Any] = []  # tensor bytes and the pads between them, in order
        self.size = 0  # payload bytes so far
        self.count = 0

    def add(self, where: str, tensor: object) -> dict[str, Any]:
        """Append ``tensor`` (a torch tensor or a numpy array); return its header descriptor."""
        array: np.ndarray[Any, Any] | None
        if type(tensor) is np.ndarray:
            dtype_name, array = _array_bytes(where, tensor)
            shape, nbytes = list(array.shape), array.nbytes
        else:
            dtype_name, array, shape, nbytes = _tensor_bytes(where, tensor)
        limits = self.limits
        if len(shape) > limits.max_tensor_dims:
            raise MalformedMessage(
                f"{where}: {len(shape)} dims, max_tensor_dims={limits.max_tensor_dims}"
            )
        self.count += 1
        if self.count > limits.max_tensors:
            raise MalformedMessage(f"{where}: more than max_tensors={limits.max_tensors}")
        offset = self.size
        if nbytes:
            pad = -offset % ALIGN_BYTES
            offset += pad
            # Checked before any copy, so an oversize tensor costs nothing.
            if offset + nbytes > limits.max_message_bytes:
                raise MessageTooLarge(
                    f"{where}: tensor ends at {offset + nbytes} bytes, "
                    f"max_message_bytes={limits.max_message_bytes}"
                )
            if pad:
                self.chunks.append(PADS[pad])
            self.chunks.append(array if array is not None else _host_copy(tensor))
            self.size = offset + nbytes
        return {"dtype": dtype_name, "shape": shape, "offset": offset, "nbytes": nbytes}


def _array_bytes(where: str, array: np.ndarray[Any, Any]) -> tuple[str, np.ndarray[Any, Any]]:
    """The wire name of a numpy array's dtype and its bytes, C-contiguous, in host order."""
    dtype_name = _ARRAY_DTYPES.get(array.dtype)  # np.dtype equality: byte order included
    if dtype_name is None:
        native = array.dtype.newbyteorder("=")
        if native not in _ARRAY_DTYPES:
            raise MalformedMessage(f"{where}: unsupported dtype {array.dtype}")
        dtype_name, array = _ARRAY_DTYPES[native], array.astype(native)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return dtype_name, array


def _tensor_bytes(
    where: str, tensor: Any
) -> tuple[str, np.ndarray[Any, Any] | None, list[int], int]:
    """A torch tensor's wire dtype name, its own bytes as an array when they will do (None:
    :func:`_host_copy` makes them), its shape and byte count."""
    torch: Any = sys.modules.get("torch")
    # type() first: isinstance goes through torch's metaclass, 3x slower for a Tensor.
    if torch is None or (type(tensor) is not torch.Tensor and not isinstance(tensor, torch.Tensor)):
        raise MalformedMessage(f"{where}: expected a tensor, got {type(tensor).__name__}")
    dtype = tensor.dtype
    dtype_name = _torch_names.get(dtype)
    if dtype_name is None:
        if not _torch_names:
            _torch_names.update({getattr(torch, name): name for name in WIRE_DTYPES})
        dtype_name = _torch_names.get(dtype)
        if dtype_name is None:
            raise MalformedMessage(f"{where}: unsupported dtype {dtype}")
    # numpy attributes cost a fraction of torch's, so the sizes come from the array when
    # the tensor's own memory will do; otherwise from the tensor, before any copy.
    array = _array_view(torch, tensor, dtype)
    if array is not None:
        return dtype_name, array, list(array.shape), array.nbytes
    if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_nested:
        raise MalformedMessage(f"{where}: only dense tensors with data can be sent")
    return dtype_name, None, list(tensor.shape), tensor.nbytes  # numel * itemsize


def _array_view(torch: Any, tensor: Any, dtype: Any) -> np.ndarray[Any, Any] | None:
    """The tensor's own bytes as a C-contiguous array, or None if they need a copy or a
    check first (another device or layout, bfloat16, autograd, non-contiguous)."""
    if dtype is torch.bfloat16 or tensor.requires_grad or not tensor.is_cpu:
        return None
    try:
        array: np.ndarray[Any, Any] = tensor.numpy()
    except (TypeError, RuntimeError):  # sparse, nested, a conjugate or negative view, ...
        return None
    return array if array.flags.c_contiguous else None


def _host_copy(tensor: Any) -> np.ndarray[Any, Any]:
    """The bytes of a dense tensor that :func:`_array_view` refused, in host memory and
    C-contiguous; copies only what must be copied."""
    torch: Any = sys.modules["torch"]
    # Each call below costs microseconds even when it is a no-op, hence the guards.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.is_neg() or tensor.is_conj():
        tensor = tensor.resolve_neg().resolve_conj()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16; same bytes as int16
        tensor = tensor.view(torch.int16)
    array: np.ndarray[Any, Any] = tensor.numpy()
    return array
