"""The codec's round trips: every dtype, shape and field kind, the wire layout, and decode's
zero-copy views of the received bytes."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from codec_cases import (
    One,
    Plain,
    Sample,
    buffer_range,
    header_of,
    packed,
    random_tensor,
    roundtrip_tensor,
    sample,
)
from heartbeats import heartbeat

from conveyor.platform.codec import ALIGN_BYTES, PREFIX_BYTES, decode, encode
from conveyor.platform.codec.tensors import DTYPES
from conveyor.platform.messages import (
    Batch,
    CoordinatorProgress,
    DeadLetter,
    JobPlanned,
    JobSubmitted,
    Message,
    ShardTask,
)

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
        JobSubmitted(job_id="j1", at=3.0, spec={"epochs": 2}, idempotency_key="k"),
        JobPlanned(
            job_id="j1", at=4.0, num_train=8, num_eval=2, num_classes=3, sample_shape=[1, 8, 8],
            train_batches_per_epoch=2, eval_batches_per_epoch=1, steps_per_epoch=1,
            shards_per_epoch=2, batches_topic="b", control_topic="c", batches_partitions=2,
        ),
        CoordinatorProgress(
            job_id="j1", at=5.0, consumed_batches=3, consumed_train_batches=2, version=2,
            step=2, epoch=0, samples_trained=16, loss=None, routing=[0.5, 0.5],
        ),
        ShardTask(
            job_id="j1", shard_id="s", epoch=1, index=0, split="eval", dataset_uri="builtin://x",
            sample_ids=list(range(10)), micro_batch_size=4, seed=7, preprocess={"augment": []},
        ),
        ShardTask(
            job_id="j1", shard_id="s", epoch=1, index=0, split="train", dataset_uri="builtin://x",
            sample_ids=[3], micro_batch_size=4, seed=7, preprocess={}, partitions=[2],
        ),
        heartbeat("j1", "w", at=1.0, version=3, step_time_s={"compute": 0.5},
                  batches_partitions=[0, 2], gpu={"gpu_utilization_ratio": 0.5}),
        heartbeat("j1", "w", at=2.0, leaving=True),
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
        "import torch; from conveyor.platform.codec import decode, encode; "
        "from conveyor.platform.messages import Batch; "
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
