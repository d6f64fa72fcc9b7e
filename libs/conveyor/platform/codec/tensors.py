"""Tensor bytes on the wire: which dtypes travel, and how tensors are laid out after the header
(:class:`_PayloadWriter`) and turned back into zero-copy views of the received buffer
(:class:`_PayloadReader`). The header around them is :mod:`conveyor.platform.codec.framing`'s.

The one module of the codec that imports torch (and numpy): the plan of a schema with tensor
fields (:mod:`~conveyor.platform.codec.plans`) imports it, so a process that never encodes
or decodes a tensor never loads torch."""

from __future__ import annotations

import math
import sys
import warnings
from operator import countOf
from typing import Any

import numpy as np
import torch

from conveyor.platform.codec.errors import MalformedMessage, MessageTooLarge
from conveyor.platform.codec.limits import ALIGN_BYTES, PADS, CodecLimits

DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
"""Wire name -> dtype of every tensor dtype the codec carries."""
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Wire name -> (torch dtype, numpy dtype or None where numpy has none, itemsize). Decode builds
# tensors through numpy: np.ndarray + torch.from_numpy costs half of frombuffer + view.
_DTYPE_INFO: dict[str, tuple[torch.dtype, np.dtype[Any] | None, int]] = {
    name: (
        dtype,
        None if dtype is torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch.")),
        dtype.itemsize,
    )
    for name, dtype in DTYPES.items()
}

if sys.byteorder != "little":  # tensor bytes travel in host order; every supported host is LE
    raise ImportError("conveyor.platform.codec needs a little-endian host")


def _use_up_read_only_warnings() -> None:
    """Decoded tensors are read-only views of a received ``bytes`` by design, and torch warns
    about such tensors once per process, from frombuffer and from_numpy each. Use both
    warnings up here, ignored, so decode never raises them (whatever the warning filters are
    by then: pytest resets them per test, ``-W error`` turns them into errors). As after any
    first warning, torch then stays silent about read-only buffers for the whole process."""
    read_only = memoryview(bytes(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(read_only, dtype=torch.uint8)
        torch.from_numpy(np.frombuffer(read_only, dtype=np.uint8))


_use_up_read_only_warnings()


class _PayloadWriter:
    """Lays tensors out after the header; holds views of their bytes until the final join."""

    __slots__ = ("chunks", "count", "limits", "size")

    def __init__(self, limits: CodecLimits) -> None:
        self.limits = limits
        self.chunks: list[Any] = []  # tensor bytes and the pads between them, in order
        self.size = 0  # payload bytes so far
        self.count = 0

    def add(self, where: str, tensor: object) -> dict[str, Any]:
        """Append ``tensor``; return its header descriptor."""
        # type() first: isinstance goes through torch's metaclass, 3x slower for a Tensor.
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.Tensor):
            raise MalformedMessage(f"{where}: expected a tensor, got {type(tensor).__name__}")
        limits = self.limits
        dtype = tensor.dtype
        dtype_name = _DTYPE_NAMES.get(dtype)
        if dtype_name is None:
            raise MalformedMessage(f"{where}: unsupported dtype {dtype}")
        # numpy attributes cost a fraction of torch's, so the sizes come from the array when
        # the tensor's own memory will do; otherwise from the tensor, before any copy.
        array = _array_view(tensor, dtype)
        if array is not None:
            shape, nbytes = list(array.shape), array.nbytes
        else:
            if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_nested:
                raise MalformedMessage(f"{where}: only dense tensors with data can be sent")
            shape, nbytes = list(tensor.shape), tensor.nbytes  # numel * itemsize
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
            self.chunks.append(array if array is not None else _host_copy(tensor, dtype))
            self.size = offset + nbytes
        return {"dtype": dtype_name, "shape": shape, "offset": offset, "nbytes": nbytes}


def _array_view(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray[Any, Any] | None:
    """The tensor's own bytes as a C-contiguous array, or None if they need a copy or a
    check first (another device or layout, bfloat16, autograd, non-contiguous)."""
    if dtype is torch.bfloat16 or tensor.requires_grad or not tensor.is_cpu:
        return None
    try:
        array = tensor.numpy()
    except (TypeError, RuntimeError):  # sparse, nested, a conjugate or negative view, ...
        return None
    return array if array.flags.c_contiguous else None


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray[Any, Any]:
    """The bytes of a dense tensor that :func:`_array_view` refused, in host memory and
    C-contiguous; copies only what must be copied."""
    # Each call below costs microseconds even when it is a no-op, hence the guards.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.is_neg() or tensor.is_conj():
        tensor = tensor.resolve_neg().resolve_conj()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if dtype is torch.bfloat16:  # numpy has no bfloat16; same bytes as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


class _PayloadReader:
    """Turns tensor descriptors into views of the payload, checking them against the bytes."""

    __slots__ = ("count", "end", "header_end", "limits", "start", "view")

    def __init__(self, view: memoryview, header_end: int, limits: CodecLimits) -> None:
        self.view = view
        self.limits = limits
        self.header_end = header_end
        self.start = header_end + -header_end % ALIGN_BYTES  # payload_start
        self.end = 0  # end of the last tensor read, relative to payload_start
        self.count = 0

    def read(self, where: str, desc: object) -> torch.Tensor:
        # Four entries, each looked up: exactly the four keys (cheaper than comparing sets).
        try:
            if type(desc) is not dict or len(desc) != 4:
                raise KeyError
            dtype_name, shape = desc["dtype"], desc["shape"]
            offset, nbytes = desc["offset"], desc["nbytes"]
        except KeyError:
            raise MalformedMessage(
                f"{where}: a tensor must be a map of dtype, shape, offset, nbytes"
            ) from None
        try:
            info = _DTYPE_INFO.get(dtype_name)  # only str keys there: other types miss
        except TypeError:  # unhashable
            info = None
        if info is None:
            raise MalformedMessage(f"{where}: unsupported dtype {dtype_name!r}")
        dtype, np_dtype, itemsize = info
        if type(offset) is not int or type(nbytes) is not int:
            raise MalformedMessage(f"{where}: offset and nbytes must be ints")
        limits = self.limits
        if (
            type(shape) is not list
            or len(shape) > limits.max_tensor_dims
            or countOf(map(type, shape), int) != len(shape)  # exact ints: no bools
            or (shape and min(shape) < 0)
        ):
            raise MalformedMessage(
                f"{where}: shape {shape!r} is not a list of at most {limits.max_tensor_dims} sizes"
            )
        self.count += 1
        if self.count > limits.max_tensors:
            raise MalformedMessage(f"{where}: more than max_tensors={limits.max_tensors}")
        numel = math.prod(shape)
        if numel * itemsize != nbytes:
            raise MalformedMessage(f"{where}: {nbytes} bytes do not hold {dtype} {shape}")
        if nbytes == 0:  # no bytes, so the offset means nothing; frombuffer refuses 0 bytes
            # With bytes, each size is at most nbytes (bounded below); without, bound them here.
            if shape and max(shape) > limits.max_message_bytes:
                raise MalformedMessage(f"{where}: shape {shape!r} has a size over the limits")
            return torch.empty(shape, dtype=dtype)
        if offset < self.end or offset % itemsize:
            raise MalformedMessage(f"{where}: offset {offset} overlaps or is misaligned")
        start = self.start + offset
        if start + nbytes > self.view.nbytes:
            raise MalformedMessage(f"{where}: tensor bytes run past the end (truncated message?)")
        self.end = offset + nbytes
        if np_dtype is None:  # bfloat16
            flat = torch.frombuffer(self.view, dtype=dtype, count=numel, offset=start)
            return flat.view(*shape) if shape else flat.view(())  # view(*list) parses fastest
        tensor = torch.from_numpy(np.ndarray(shape, np_dtype, self.view, start))
        if dtype is torch.bool and bool((tensor.view(torch.uint8) > 1).any()):
            raise MalformedMessage(f"{where}: bool tensor holds bytes other than 0 and 1")
        return tensor

    def check_end(self) -> None:
        """The message must end exactly where its last tensor does."""
        expected = self.start + self.end if self.end else self.header_end
        if self.view.nbytes != expected:
            raise MalformedMessage(
                f"message is {self.view.nbytes} bytes, its header and tensors make {expected}"
            )
