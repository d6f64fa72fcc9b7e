"""The codec: round trips, zero-copy decode, limits, and strict rejection of bad bytes."""

from __future__ import annotations

import ast
import dataclasses
import gc
import pickle
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from torch import Tensor

from conveyor.libs import codec
from conveyor.libs.codec import (
    ALIGN_BYTES,
    DTYPES,
    PREFIX_BYTES,
    CodecError,
    CodecLimits,
    MalformedMessage,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
    decode,
    encode,
)
from conveyor.libs.messages import (
    Batch,
    DeadLetter,
    Heartbeat,
    JobEvent,
    Message,
    ShardTask,
    message,
)


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


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    original = random_tensor(dtype, (3, 5, 7))
    decoded = roundtrip_tensor(original)
    assert decoded.dtype == dtype
    assert decoded.shape == (3, 5, 7)
    assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_scalars_and_empty_tensors_round_trip(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    scalar = random_tensor(dtype, (), seed=1)
    decoded = roundtrip_tensor(scalar)
    assert decoded.shape == () and decoded.dtype == dtype
    assert torch.equal(decoded, scalar)
    for shape in [(0,), (0, 3), (2, 0, 4)]:
        empty = roundtrip_tensor(torch.empty(shape, dtype=dtype))
        assert empty.shape == shape and empty.dtype == dtype


@pytest.mark.parametrize(
    "shape", [(1,), (7,), (3, 1, 5), (1, 1, 1, 1, 1, 1, 1, 1), (13, 17), (2, 3, 5, 7, 11)]
)
def test_odd_shapes_round_trip(shape: tuple[int, ...]) -> None:
    original = random_tensor(torch.int16, shape)
    assert torch.equal(roundtrip_tensor(original), original)


@pytest.mark.parametrize(
    "make",
    [
        lambda base: base.t(),
        lambda base: base[:, ::3],
        lambda base: base[1:, 2:],
        lambda base: base[:1].expand(5, 12),
        lambda base: base.reshape(2, 3, 2, 5).permute(0, 2, 3, 1),
    ],
)
def test_non_contiguous_tensors_round_trip(make: Any) -> None:
    tensor = make(torch.arange(60, dtype=torch.float64).reshape(5, 12))
    assert not tensor.is_contiguous()
    decoded = roundtrip_tensor(tensor)
    assert decoded.is_contiguous()
    assert torch.equal(decoded, tensor)


def test_message_with_every_field_kind_round_trips() -> None:
    original = sample(named={"a": torch.zeros(0, 2), "b": torch.tensor(7), "c": torch.ones(3)})
    decoded = decode(encode(original))
    assert isinstance(decoded, Sample)
    for field in dataclasses.fields(Sample):
        if field.name not in ("t", "named"):
            assert getattr(decoded, field.name) == getattr(original, field.name), field.name
    assert torch.equal(decoded.t, original.t)
    assert list(decoded.named) == ["a", "b", "c"]
    for key, tensor in original.named.items():
        assert decoded.named[key].dtype == tensor.dtype
        assert torch.equal(decoded.named[key], tensor)


def test_empty_tensor_dict_and_requires_grad_tensor() -> None:
    weight = torch.randn(4, requires_grad=True)
    decoded = decode(encode(sample(t=weight, named={})))
    assert isinstance(decoded, Sample)
    assert decoded.named == {}
    assert torch.equal(decoded.t, weight.detach())


def test_message_without_tensor_bytes_is_just_the_prefixed_header() -> None:
    data = encode(Plain(name="p", count=1))
    assert int.from_bytes(data[:PREFIX_BYTES], "little") == len(data) - PREFIX_BYTES
    expected = {"v": 1, "type": "tests.codec.Plain", "name": "p", "count": 1}
    assert msgpack.unpackb(data[PREFIX_BYTES:]) == expected
    assert decode(data) == Plain(name="p", count=1)


def test_wire_layout_is_prefix_header_pad_and_aligned_tensor_bytes() -> None:
    t = torch.arange(6, dtype=torch.int16)
    named = {"a": torch.ones(3, dtype=torch.float64)}
    data = encode(sample(t=t, named=named))
    header_len = int.from_bytes(data[:PREFIX_BYTES], "little")
    header_end = PREFIX_BYTES + header_len
    header = msgpack.unpackb(data[PREFIX_BYTES:header_end])
    assert list(header)[:2] == ["v", "type"]
    assert list(header)[2:] == [field.name for field in dataclasses.fields(Sample)]
    payload_start = header_end + -header_end % ALIGN_BYTES
    assert data[header_end:payload_start] == bytes(payload_start - header_end)
    assert header["t"] == {"dtype": "int16", "shape": [6], "offset": 0, "nbytes": 12}
    assert header["named"] == {"a": {"dtype": "float64", "shape": [3], "offset": 64, "nbytes": 24}}
    assert data[payload_start : payload_start + 12] == t.numpy().tobytes()
    assert data[payload_start + 64 :] == named["a"].numpy().tobytes()
    assert len(data) == payload_start + 64 + 24


def test_header_fields_may_come_in_any_order() -> None:
    header = header_of(encode(sample(t=torch.zeros(0), named={})))
    reordered = dict(reversed(list(header.items())))
    decoded = decode(packed(reordered))
    assert isinstance(decoded, Sample) and decoded.ids == [5, 1, 9] and decoded.named == {}


def test_tensor_subclasses_and_loosely_typed_fields_take_the_checked_path() -> None:
    weight = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    decoded = decode(encode(sample(t=weight, maybe="set", scale=1)))
    assert isinstance(decoded, Sample)
    assert type(decoded.t) is torch.Tensor and decoded.t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (decoded.maybe, decoded.scale) == ("set", 1)


def test_v1_schemas_round_trip() -> None:
    batch = Batch(
        job_id="j1",
        batch_id="j1-e0-s3-b2",
        shard_id="j1-e0-s3",
        epoch=0,
        split="train",
        sample_ids=[4, 8, 15],
        x=torch.randint(0, 256, (3, 1, 8, 8), dtype=torch.uint8),
        y=torch.tensor([1, 2, 3]),
        timestamps={"read": 1.5, "sent": 2},
    )
    decoded = decode(encode(batch))
    assert isinstance(decoded, Batch)
    assert (decoded.batch_id, decoded.sample_ids, decoded.timestamps) == (
        "j1-e0-s3-b2",
        [4, 8, 15],
        {"read": 1.5, "sent": 2},
    )
    assert torch.equal(decoded.x, batch.x) and torch.equal(decoded.y, batch.y)
    plain_messages: list[Message] = [
        DeadLetter(
            source_topic="t", partition=2, offset=99, key=None, reason="bad", payload=b"\x01",
            failed_at=1.0,
        ),
        JobEvent(job_id="j1", event="submitted", at=3.0, data={"spec": {"epochs": 2}}),
        ShardTask(
            job_id="j1", shard_id="s", epoch=1, index=0, split="eval", dataset_uri="builtin://x",
            sample_ids=list(range(10)), micro_batch_size=4, seed=7, preprocess={"augment": []},
        ),
        ShardTask(
            job_id="j1", shard_id="s", epoch=1, index=0, split="train", dataset_uri="builtin://x",
            sample_ids=[3], micro_batch_size=4, seed=7, preprocess={}, routing=[0.5, 0, 0.5],
        ),
        Heartbeat(job_id="j1", worker_id="w", role="trainer", at=1.0, info={"gpu": None}),
    ]  # fmt: skip
    for original in plain_messages:
        assert decode(encode(original)) == original


def test_accepts_bytes_bytearray_and_memoryview_slices() -> None:
    data = encode(sample())
    for form in (bytes(data), bytearray(data), memoryview(b"xyz" + data)[3:]):
        decoded = decode(form)
        assert isinstance(decoded, Sample)
        assert torch.equal(decoded.t, sample().t)


# ------------------------------------------------------------------------------- zero copy


def test_decoded_tensors_are_aligned_views_of_the_input() -> None:
    data = encode(sample())
    decoded = decode(data)
    assert isinstance(decoded, Sample)
    start, end = buffer_range(data)
    for tensor in [decoded.t, *decoded.named.values()]:
        nbytes = tensor.numel() * tensor.element_size()
        assert start <= tensor.data_ptr() and tensor.data_ptr() + nbytes <= end
        assert (tensor.data_ptr() - start) % ALIGN_BYTES == 0


def test_decoded_tensor_aliases_a_mutable_buffer_and_keeps_it_alive() -> None:
    data = bytearray(encode(One(t=torch.zeros(4, dtype=torch.int32))))
    decoded = decode(data)
    assert isinstance(decoded, One)
    data[-4:] = (123).to_bytes(4, "little")
    assert decoded.t.tolist() == [0, 0, 0, 123]
    del data
    gc.collect()
    assert decoded.t.tolist() == [0, 0, 0, 123]


def test_decoding_bytes_raises_no_warning() -> None:
    # torch warns once per process about read-only buffers: check in a fresh one, where any
    # warning is an error.
    script = (
        "import torch; from conveyor.libs.codec import decode, encode; "
        "from conveyor.libs.messages import Batch; "
        "x = torch.zeros(1, 1, 2, 2, dtype=torch.uint8); y = torch.zeros(1, dtype=torch.int64); "
        "b = Batch(job_id='j', batch_id='b', shard_id='s', epoch=0, split='train', "
        "sample_ids=[0], x=x, y=y, timestamps={}); "
        "m = decode(encode(b)); assert m.y.tolist() == [0]"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


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


# ------------------------------------------------------------------------- decode rejects


@pytest.mark.parametrize(
    ("data", "error", "reason"),
    [
        (b"", MalformedMessage, "truncated header"),
        (packed([1, 2]), MalformedMessage, "not a map"),
        (packed({"v": 1}), MalformedMessage, "no string 'type'"),
        (packed({"v": 1, "type": "Nope"}), UnknownMessageType, "Nope"),
        (
            packed({"v": 2, "type": "tests.codec.Plain", "name": "a", "count": 1}),
            UnsupportedVersion,
            "version 2",
        ),
        (
            packed({"v": "1", "type": "tests.codec.Plain", "name": "a", "count": 1}),
            MalformedMessage,
            "no int 'v'",
        ),
        (
            packed({"v": 1, "type": "tests.codec.Plain", "name": "a"}),
            MalformedMessage,
            "missing fields count$",
        ),
        (
            packed({"v": 1, "type": "tests.codec.Plain", "name": "a", "count": 1, "x": 0}),
            MalformedMessage,
            "unknown fields 'x'$",
        ),
        (
            packed({"v": 1, "type": "tests.codec.Plain", "name": "a", "cnt": 1}),
            MalformedMessage,
            "missing fields count; unknown fields 'cnt'",
        ),
        (
            packed({"v": 1, "type": "tests.codec.Plain", "name": 1.5, "count": 1}),
            MalformedMessage,
            "name: expected str, got float",
        ),
        (
            packed({"v": 1, "type": "tests.codec.Plain", "name": {}, "count": 1}),
            MalformedMessage,
            "name: expected str, got dict",
        ),
        (
            packed({"v": 1, "type": "tests.codec.Plain", "name": "a", "count": 1}) + b"\x00",
            MalformedMessage,
            "its header and tensors make",
        ),
        (packed({1: 2}), MalformedMessage, "undecodable"),  # strict_map_key
    ],
)
def test_decode_rejects_bad_headers(data: bytes, error: type[CodecError], reason: str) -> None:
    with pytest.raises(error, match=reason):
        decode(data)


@pytest.mark.parametrize("cut", range(PREFIX_BYTES))
def test_a_truncated_length_prefix_is_malformed(cut: int) -> None:
    data = encode(Plain(name="p", count=1))
    with pytest.raises(MalformedMessage, match=r"truncated header: .* length prefix"):
        decode(data[:cut])


def test_the_length_prefix_must_frame_exactly_one_header() -> None:
    head: bytes = msgpack.packb({"v": 1, "type": "tests.codec.Plain", "name": "a", "count": 1})
    assert decode(framed(head)) == Plain(name="a", count=1)
    prefix = len(head).to_bytes(PREFIX_BYTES, "little")
    short = (len(head) - 1).to_bytes(PREFIX_BYTES, "little")
    long = (len(head) + 1).to_bytes(PREFIX_BYTES, "little")
    with pytest.raises(MalformedMessage, match="truncated header: it ends at byte"):
        decode(long + head)  # claims one byte more than the message has
    with pytest.raises(MalformedMessage, match="undecodable"):
        decode(short + head)  # the header's last byte is left out of the slice
    with pytest.raises(MalformedMessage, match="undecodable"):
        decode(long + head + b"\x00")  # a second msgpack object inside the header
    with pytest.raises(MalformedMessage, match="its header and tensors make"):
        decode(prefix + head + b"\x00")  # a stray byte after the header


def test_a_header_length_over_the_limit_is_too_large_only_if_the_bytes_are_there() -> None:
    limits = CodecLimits(max_header_bytes=16)
    data = encode(Plain(name="p" * 20, count=1))
    with pytest.raises(MessageTooLarge, match="max_header_bytes=16"):
        decode(data, limits=limits)
    claims_more = (2**32 - 1).to_bytes(PREFIX_BYTES, "little") + data[PREFIX_BYTES:]
    with pytest.raises(MalformedMessage, match="truncated header"):
        decode(claims_more, limits=limits)


def test_header_limit_must_fit_the_length_prefix() -> None:
    assert CodecLimits(max_header_bytes=2**32 - 1).max_header_bytes == 2**32 - 1
    with pytest.raises(ValueError, match="max_header_bytes must be < 4 GiB"):
        CodecLimits(max_header_bytes=2**32)


def test_a_type_registered_after_a_failed_decode_decodes() -> None:
    name = "tests.codec.Late"
    data = packed({"v": 1, "type": name, "n": 2})
    with pytest.raises(UnknownMessageType, match="Late"):
        decode(data)

    @message(name, version=1)
    @dataclass(kw_only=True, slots=True)
    class Late(Message):
        n: int

    decoded = decode(data)
    assert isinstance(decoded, Late) and decoded.n == 2
    assert decode(encode(Late(n=3))) == Late(n=3)


def test_decode_checks_item_types_and_dict_keys() -> None:
    good = header_of(encode(sample(t=torch.zeros(0), named={})))
    for field, value, reason in [
        ("ids", [1, "2"], "ids: items must be int"),
        ("ids", [1, True], "ids: items must be int"),
        ("meta", {b"k": 1}, "keys must be str"),
        ("t", 5, "a tensor must be a map"),
        ("named", [], "expected a dict"),
    ]:
        header = {**good, field: value}
        with pytest.raises(MalformedMessage, match=reason):
            decode(packed(header))


@pytest.mark.parametrize(
    ("desc", "payload", "reason"),
    [
        ({"dtype": "complex64"}, bytes(8), "unsupported dtype"),
        ({"dtype": 5}, bytes(8), "unsupported dtype"),
        ({"nbytes": 12}, bytes(12), "do not hold"),
        ({"shape": [-2]}, bytes(8), "shape"),
        ({"shape": [True, 2]}, bytes(8), "shape"),
        ({"shape": "2"}, bytes(8), "shape"),
        ({"offset": 2}, bytes(16), "misaligned"),
        ({"offset": -64}, bytes(8), "overlaps"),
        ({"offset": 64}, bytes(8), "past the end"),
        ({"offset": "0"}, bytes(8), "must be ints"),
        ({}, bytes(4), "past the end"),
        ({}, bytes(9), "its header and tensors make"),
        ({"extra": 1}, bytes(8), "a tensor must be a map"),
    ],
)
def test_decode_rejects_inconsistent_tensor_descriptors(
    desc: dict[str, Any], payload: bytes, reason: str
) -> None:
    assert isinstance(decode(raw_message(one_header(), bytes(8))), One)  # the baseline is valid
    with pytest.raises(MalformedMessage, match=reason):
        decode(raw_message(one_header(**desc), payload))


def test_decode_rejects_overlapping_tensors() -> None:
    desc = {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    header = {"v": 1, "type": "tests.codec.Named", "named": {"a": desc, "b": desc}}
    with pytest.raises(MalformedMessage, match=r"named\['b'\]: offset 0 overlaps"):
        decode(raw_message(header, bytes(8)))
    header["named"] = {"a": desc, "b": {**desc, "offset": 8}}
    decoded = decode(raw_message(header, bytes(16)))
    assert isinstance(decoded, Named) and list(decoded.named) == ["a", "b"]


def test_decode_rejects_bool_tensors_holding_other_bytes() -> None:
    header = one_header(dtype="bool", shape=[4], nbytes=4)
    decoded = decode(raw_message(header, b"\x00\x01\x01\x00"))
    assert isinstance(decoded, One) and decoded.t.tolist() == [False, True, True, False]
    with pytest.raises(MalformedMessage, match="bool"):
        decode(raw_message(header, b"\x00\x02\x01\x00"))


def test_decode_runs_the_schema_checks() -> None:
    header = {
        "v": 1, "type": "Batch", "job_id": "j", "batch_id": "b", "shard_id": "s", "epoch": 0,
        "split": "test", "sample_ids": [1], "timestamps": {},
        "x": {"dtype": "uint8", "shape": [1, 1, 2, 2], "offset": 0, "nbytes": 4},
        "y": {"dtype": "int64", "shape": [1], "offset": 64, "nbytes": 8},
    }  # fmt: skip
    with pytest.raises(MalformedMessage, match="split must be one of"):
        decode(raw_message(header, bytes(72)))
    header["split"] = "train"
    assert isinstance(decode(raw_message(header, bytes(72))), Batch)
    header["x"] = {"dtype": "uint8", "shape": [1, 4], "offset": 0, "nbytes": 4}
    with pytest.raises(MalformedMessage, match=r"x must be uint8 \[B,C,H,W\]"):
        decode(raw_message(header, bytes(72)))


def test_shard_task_v2_routing_is_checked_and_v1_is_refused() -> None:
    header = {
        "v": 2, "type": "ShardTask", "job_id": "j", "shard_id": "s", "epoch": 0, "index": 0,
        "split": "train", "dataset_uri": "builtin://x", "sample_ids": [1], "micro_batch_size": 1,
        "seed": 0, "preprocess": {}, "released_at": 0.0, "routing": [1, 0.5],
    }  # fmt: skip
    decoded = decode(packed(header))
    assert isinstance(decoded, ShardTask) and decoded.routing == [1, 0.5]
    with pytest.raises(MalformedMessage, match="routing"):
        decode(packed({**header, "routing": [1, "0.5"]}))
    with pytest.raises(MalformedMessage, match="routing weights"):
        decode(packed({**header, "routing": [0.0, -1.0]}))
    v1 = {k: v for k, v in header.items() if k != "routing"} | {"v": 1}
    with pytest.raises(UnsupportedVersion, match="ShardTask version 1, supported: 2"):
        decode(packed(v1))


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(5, b"payload"),
        msgpack.ExtType(7, b""),
        msgpack.Timestamp(1, 0),
    ],
)
def test_extension_types_are_rejected(ext: object) -> None:
    data = packed({"v": 1, "type": "tests.codec.Plain", "name": ext, "count": 1})
    with pytest.raises(MalformedMessage):
        decode(data)
    nested = header_of(encode(sample(t=torch.zeros(0), named={})))
    nested["meta"] = {"x": [ext]}
    with pytest.raises(MalformedMessage):
        decode(packed(nested))


def test_pickle_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    for name in ("loads", "load", "dumps", "dump", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, refuse)
    decoded = decode(encode(sample()))
    assert isinstance(decoded, Sample) and torch.equal(decoded.t, sample().t)
    sources = sorted(Path(codec.__file__).parent.glob("*.py"))  # every module of the package
    assert len(sources) > 1
    for source in sources:
        tree = ast.parse(source.read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        imported |= {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        # no torch.load either
        assert "pickle" not in imported and not attributes & {"load", "loads"}, source


# -------------------------------------------------------------------------------- fuzzing


def test_every_truncation_is_malformed() -> None:
    data = encode(sample())
    for cut in range(len(data)):
        with pytest.raises(MalformedMessage):
            decode(data[:cut])


def test_random_bytes_are_malformed() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        data = rng.randbytes(rng.randrange(0, 300))
        with pytest.raises(MalformedMessage):
            decode(data)
    for _ in range(500):  # plausible starts: a length prefix that fits, a map header, garbage
        head = bytes([0x80 | rng.randrange(16)]) + rng.randbytes(rng.randrange(0, 200))
        data = framed(head) + rng.randbytes(rng.randrange(0, 100))
        with pytest.raises(MalformedMessage):
            decode(data)


def test_mutated_messages_fail_only_with_codec_errors() -> None:
    rng = random.Random(99)
    original = encode(sample())
    outcomes: dict[str, int] = {}
    for _ in range(3000):
        data = bytearray(original)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode(data)
            outcome = "decoded"  # a flipped byte inside tensor data is still a valid message
        except CodecError as exc:
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes["decoded"] > 0 and outcomes["MalformedMessage"] > 0
