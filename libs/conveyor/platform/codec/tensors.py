"""Tensor bytes on the wire, the receiving side: which dtypes travel, and how tensor
descriptors are turned back into zero-copy views of the received buffer (:class:`_PayloadReader`).
The sending side is :mod:`~conveyor.platform.codec.writer`; the header around them is
:mod:`conveyor.platform.codec.framing`'s.

The one module of the codec that imports torch: the plan of a schema with tensor fields
(:mod:`~conveyor.platform.codec.plans`) imports it on the first decode of such a message, so a
process that never receives a tensor never loads torch."""

from __future__ import annotations

import math
import warnings
from operator import countOf
from typing import Any

import numpy as np
import torch

from conveyor.platform.codec.errors import MalformedMessage
from conveyor.platform.codec.limits import ALIGN_BYTES, CodecLimits
from conveyor.platform.codec.writer import WIRE_DTYPES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPES}
"""Wire name -> dtype of every tensor dtype the codec carries."""
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
