"""The codec's size limits, and what encode refuses to put on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from codec_cases import One, Plain, Sample, sample

from conveyor.platform.codec import (
    CodecLimits,
    MalformedMessage,
    MessageTooLarge,
    UnknownMessageType,
    decode,
    encode,
)
from conveyor.platform.messages import Message

# ---------------------------------------------------------------------------------- limits


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tensors"):
        CodecLimits(max_tensors=0)


def test_oversize_message_is_rejected_on_encode_and_before_parsing_on_decode() -> None:
    limits = CodecLimits(max_message_bytes=4096)
    with pytest.raises(MessageTooLarge, match="max_message_bytes=4096"):
        encode(One(t=torch.zeros(4096, dtype=torch.uint8)), limits=limits)
    with pytest.raises(MessageTooLarge):  # garbage, but the size is checked first
        decode(b"\xc1" * 4097, limits=limits)
    assert isinstance(decode(encode(One(t=torch.zeros(100))), limits=limits), One)


def test_oversize_header_is_rejected() -> None:
    limits = CodecLimits(max_header_bytes=1024)
    big = Plain(name="n" * 2000, count=1)
    with pytest.raises(MessageTooLarge, match="header"):
        encode(big, limits=limits)
    with pytest.raises(MessageTooLarge, match="max_header_bytes=1024"):
        decode(encode(big), limits=limits)


def test_tensor_count_and_dims_are_bounded() -> None:
    many = sample(named={str(i): torch.zeros(1) for i in range(4)})  # 5 tensors with t
    with pytest.raises(MalformedMessage, match="max_tensors=4"):
        encode(many, limits=CodecLimits(max_tensors=4))
    with pytest.raises(MalformedMessage, match="max_tensors=4"):
        decode(encode(many), limits=CodecLimits(max_tensors=4))
    with pytest.raises(MalformedMessage, match="max_tensor_dims"):
        encode(One(t=torch.zeros([1] * 9)))
    with pytest.raises(MalformedMessage, match="shape"):
        decode(encode(One(t=torch.zeros(1, 1, 1))), limits=CodecLimits(max_tensor_dims=2))


# ------------------------------------------------------------------------- encode rejects


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"count": "3"}, "count: expected int, got str"),
        ({"count": True}, "count: expected int, got bool"),
        ({"maybe": 3}, "maybe: expected NoneType | str, got int"),
        ({"t": [1.0]}, "t: expected a tensor"),
        ({"t": torch.zeros(2, dtype=torch.complex64)}, "unsupported dtype"),
        ({"t": torch.eye(3).to_sparse()}, "dense"),
        ({"t": torch.empty(2, device="meta")}, "dense"),
        ({"named": {"a": 1}}, r"named\['a'\]: expected a tensor"),
        ({"meta": {"t": torch.zeros(1)}}, "tensors go in Tensor"),
        ({"meta": {"gpu": {0: 1}}}, "keys must be str"),
        ({"meta": {"x": {1, 2}}}, "cannot send a set"),
        ({"ids": [2**70]}, "cannot pack header"),
    ],
)
def test_encode_rejects_values_that_do_not_fit_the_schema(
    overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(MalformedMessage, match=reason):
        encode(sample(**overrides))


def test_encode_rejects_unregistered_messages() -> None:
    @dataclass(kw_only=True, slots=True)
    class Stray(Message):
        name: str

    with pytest.raises(UnknownMessageType, match="Stray"):
        encode(Stray(name="x"))


def test_float_fields_accept_ints() -> None:
    decoded = decode(encode(sample(scale=2)))
    assert isinstance(decoded, Sample) and decoded.scale == 2
