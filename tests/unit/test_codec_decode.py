"""Strict decode: every kind of bad bytes is refused with a CodecError that says why, nothing
from the input is ever run (no msgpack extensions, no pickle), and fuzzed input fails cleanly."""

from __future__ import annotations

import ast
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from codec_cases import (
    Named,
    One,
    Plain,
    Sample,
    framed,
    header_of,
    one_header,
    packed,
    raw_message,
    sample,
)

from conveyor.platform import codec
from conveyor.platform.codec import (
    PREFIX_BYTES,
    CodecError,
    CodecLimits,
    MalformedMessage,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
    decode,
    encode,
    message_type,
)
from conveyor.platform.messages import Batch, Message, ShardTask, message

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
        "v": 2, "type": "Batch", "job_id": "j", "batch_id": "b", "shard_id": "s", "epoch": 0,
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


def test_shard_task_v4_partitions_are_checked_and_v3_is_refused() -> None:
    header = {
        "v": 4, "type": "ShardTask", "job_id": "j", "shard_id": "s", "epoch": 0, "index": 0,
        "split": "train", "dataset_uri": "builtin://x", "sample_ids": [1, 2, 3],
        "micro_batch_size": 2, "seed": 0, "preprocess": {}, "released_at": 0.0,
        "partitions": [3, 0], "incarnation": 1,
    }  # fmt: skip
    decoded = decode(packed(header))
    assert isinstance(decoded, ShardTask) and decoded.partitions == [3, 0]
    assert decoded.incarnation == 1
    with pytest.raises(MalformedMessage, match="partitions"):
        decode(packed({**header, "partitions": [1, "0"]}))
    with pytest.raises(MalformedMessage, match="3 partitions for 2 batches"):
        decode(packed({**header, "partitions": [0, 1, 2]}))
    with pytest.raises(MalformedMessage, match="partitions must be >= 0"):
        decode(packed({**header, "partitions": [0, -1]}))
    v3 = {k: v for k, v in header.items() if k != "partitions"} | {"v": 3, "routing": [1.0]}
    with pytest.raises(UnsupportedVersion, match="ShardTask version 3, supported: 4"):
        decode(packed(v3))


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


def test_message_type_names_the_type_from_the_header_alone() -> None:
    data = encode(sample())
    assert message_type(data) == Sample.TYPE
    assert message_type(bytearray(data)[: PREFIX_BYTES + 40]) == Sample.TYPE  # the rest unread
    assert message_type(packed({"v": 1, "type": "tests.codec.Unknown"})) == (
        "tests.codec.Unknown"  # known or not is decode's to say
    )


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x05\x00",
        packed([1, "tests.codec.Sample"]),  # not a map
        packed({"type": "tests.codec.Sample", "v": 1}),  # not the encoder's order
        packed({"v": 1, "type": 7}),
        packed({"v": 1}),
        framed(b"\xc1"),  # a byte msgpack never uses
        packed({"v": msgpack.ExtType(1, b"x"), "type": "tests.codec.Sample"}),
    ],
)
def test_message_type_is_none_for_what_does_not_start_like_a_message(data: bytes) -> None:
    assert message_type(data) is None
    with pytest.raises(CodecError):
        decode(data)
