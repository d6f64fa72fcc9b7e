"""Test messages and wire-byte builders shared by the codec tests (test_codec_*.py).

The messages register wire names ``tests.codec.*`` when this module is imported: import it,
never copy them (a name registers once per process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from torch import Tensor

from conveyor.platform.codec import ALIGN_BYTES, PREFIX_BYTES, decode, encode
from conveyor.platform.messages import Message, message


@message("tests.codec.Sample", version=1)
@dataclass(kw_only=True, slots=True)
class Sample(Message):
    name: str
    count: int
    scale: float
    flag: bool
    blob: bytes
    maybe: str | None
    ids: list[int]
    meta: dict[str, Any]
    t: Tensor
    named: dict[str, Tensor]


@message("tests.codec.One", version=1)
@dataclass(kw_only=True, slots=True)
class One(Message):
    t: Tensor


@message("tests.codec.Named", version=1)
@dataclass(kw_only=True, slots=True)
class Named(Message):
    named: dict[str, Tensor]


@message("tests.codec.Plain", version=1)
@dataclass(kw_only=True, slots=True)
class Plain(Message):
    name: str
    count: int


def sample(t: Tensor | None = None, **overrides: Any) -> Sample:
    fields: dict[str, Any] = {
        "name": "s-1",
        "count": 3,
        "scale": 0.5,
        "flag": True,
        "blob": b"\x00\xffraw",
        "maybe": None,
        "ids": [5, 1, 9],
        "meta": {"mean": [0.5], "nested": {"k": None, "b": b"x"}, "n": -7},
        "t": torch.arange(12, dtype=torch.float32).reshape(3, 4) if t is None else t,
        "named": {"w": torch.ones(2, 3, dtype=torch.float16), "b": torch.tensor([1, 2])},
    }
    fields.update(overrides)
    return Sample(**fields)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen
    ).to(dtype)


def roundtrip_tensor(t: Tensor) -> Tensor:
    decoded = decode(encode(One(t=t)))
    assert isinstance(decoded, One)
    return decoded.t


def buffer_range(data: bytes | bytearray) -> tuple[int, int]:
    start = int(np.frombuffer(data, dtype=np.uint8).ctypes.data)
    return start, start + len(data)


def framed(head: bytes) -> bytes:
    """``head`` (msgpack bytes) behind its 4-byte little-endian length prefix."""
    return len(head).to_bytes(PREFIX_BYTES, "little") + head


def packed(header: object) -> bytes:
    """Hand-built wire bytes of a message without tensor bytes: prefix and msgpack header."""
    return framed(msgpack.packb(header))


def header_of(data: bytes) -> Any:
    """The msgpack header of wire bytes, parsed with plain msgpack."""
    header_len = int.from_bytes(data[:PREFIX_BYTES], "little")
    return msgpack.unpackb(data[PREFIX_BYTES : PREFIX_BYTES + header_len])


def raw_message(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """Hand-built wire bytes: prefix, header, pad to 64, payload (offsets count from the pad's
    end)."""
    head = packed(header)
    return head + bytes(-len(head) % ALIGN_BYTES) + payload if payload else head


def one_header(**desc: Any) -> dict[str, Any]:
    tensor = {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    tensor.update(desc)
    return {"v": 1, "type": "tests.codec.One", "t": tensor}
