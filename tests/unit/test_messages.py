"""Message registry, field specs derived from annotations, v1 schema checks and topic names."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from conveyor.platform.codec import decode, encode
from conveyor.platform.messages import (
    Batch,
    Contribution,
    DeadLetter,
    FieldKind,
    Heartbeat,
    JobFailed,
    JobPlanned,
    JobSubmitted,
    Message,
    ShardTask,
    Topics,
    message,
    registered_messages,
    sample_ids_tensor,
    schema_for,
)


def unique_name() -> str:
    return f"tests.messages.{uuid.uuid4().hex[:8]}"


def test_schemas_are_registered_with_name_and_version() -> None:
    registry = registered_messages()
    classes = (DeadLetter, ShardTask, Batch, Heartbeat, JobSubmitted, JobPlanned, JobFailed,
               Contribution)  # fmt: skip
    for cls in classes:
        assert registry[cls.__name__] is cls
        assert cls.__name__ == cls.TYPE
    versions = {cls.TYPE: cls.VERSION for cls in classes}
    # ShardTask v2: + routing; v3: + incarnation; v4: partitions instead of routing.
    # Contribution v2: + epoch, sample_ids;
    # v3: + inner_steps; v4: + the step's stamps; v5: + carried_steps. Batch v2: + token sequences
    assert versions == {
        "DeadLetter": 1, "ShardTask": 4, "Batch": 2, "Heartbeat": 2, "JobSubmitted": 1,
        "JobPlanned": 1, "JobFailed": 1, "Contribution": 5,
    }  # fmt: skip


def test_batch_field_specs_follow_the_annotations() -> None:
    schema = schema_for("Batch")
    assert schema is not None and schema.cls is Batch and schema.version == 2
    specs = {spec.name: spec for spec in schema.fields}
    assert list(specs) == [
        "job_id", "batch_id", "shard_id", "epoch", "split", "sample_ids", "x", "y", "timestamps",
    ]  # fmt: skip
    assert specs["x"].kind is FieldKind.TENSOR and specs["y"].kind is FieldKind.TENSOR
    assert specs["sample_ids"].types == frozenset({list})
    assert specs["sample_ids"].item_types == frozenset({int})
    assert specs["timestamps"].types == frozenset({dict})
    assert specs["timestamps"].item_types == frozenset({float, int})
    assert specs["epoch"].types == frozenset({int}) and not specs["epoch"].nested
    assert schema_for("NoSuchMessage") is None


@dataclass(kw_only=True, slots=True)
class Annotated(Message):
    maybe_bytes: bytes | None
    number: int | str
    floats: list[float]
    matrix: list[list[int]]
    anything: Any
    config: dict[str, Any]
    maybe_ids: list[int] | None
    weights: dict[str, Tensor]


def test_field_specs_of_unions_nesting_and_tensor_dicts() -> None:
    message(unique_name(), version=3)(Annotated)
    schema = schema_for(Annotated.TYPE)
    assert schema is not None and Annotated.VERSION == 3
    specs = {spec.name: spec for spec in schema.fields}
    assert specs["maybe_bytes"].types == frozenset({bytes, type(None)})
    assert specs["number"].types == frozenset({int, str})
    assert specs["floats"].item_types == frozenset({float, int})
    assert specs["matrix"].types == frozenset({list}) and specs["matrix"].item_types is None
    assert specs["matrix"].nested
    assert specs["anything"].types is None and specs["anything"].nested
    assert specs["config"].types == frozenset({dict}) and specs["config"].nested
    assert specs["maybe_ids"].types == frozenset({list, type(None)})
    assert specs["maybe_ids"].item_types == frozenset({int})
    assert specs["weights"].kind is FieldKind.TENSOR_DICT


def test_duplicate_name_is_rejected_and_the_first_class_stays() -> None:
    name = unique_name()

    @message(name, version=1)
    @dataclass(kw_only=True, slots=True)
    class First(Message):
        a: int

    with pytest.raises(ValueError, match="already taken"):

        @message(name, version=2)
        @dataclass(kw_only=True, slots=True)
        class Second(Message):
            a: int

    assert registered_messages()[name] is First
    with pytest.raises(ValueError, match="already taken"):
        message("Batch", version=3)(First)


def test_registration_rejects_bad_classes() -> None:
    @dataclass(kw_only=True)
    class NoSlots(Message):
        a: int

    @dataclass(slots=True)
    class Positional(Message):
        a: int

    @dataclass(kw_only=True, slots=True)
    class Reserved(Message):
        type: str

    class NotADataclass(Message):
        pass

    @dataclass(kw_only=True, slots=True)
    class NotAMessage:
        a: int

    for cls, reason in [
        (NoSlots, "slots=True"),
        (Positional, "kw_only=True"),
        (Reserved, "reserved"),
        (NotADataclass, "@dataclass"),
        (NotAMessage, "must subclass Message"),
    ]:
        name = unique_name()
        with pytest.raises(ValueError, match=reason):
            message(name, version=1)(cls)
        assert name not in registered_messages()
    with pytest.raises(ValueError, match="version"):
        message(unique_name(), version=0)
    with pytest.raises(ValueError, match="name"):
        message("", version=1)


@dataclass(kw_only=True, slots=True)
class TensorList(Message):
    tensors: list[Tensor]


@dataclass(kw_only=True, slots=True)
class IntKeys(Message):
    table: dict[int, str]


@dataclass(kw_only=True, slots=True)
class OptionalTensor(Message):
    t: Tensor | None


@dataclass(kw_only=True, slots=True)
class SetField(Message):
    s: set[int]


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (TensorList, "TensorList.tensors: unsupported field type"),
        (IntKeys, "dict keys must be str"),
        (OptionalTensor, "OptionalTensor.t: unsupported field type"),
        (SetField, "SetField.s: unsupported field type"),
    ],
)
def test_registration_rejects_annotations_the_codec_cannot_carry(
    cls: type[Message], reason: str
) -> None:
    name = unique_name()
    with pytest.raises(TypeError, match=reason):
        message(name, version=1)(cls)
    assert name not in registered_messages()


def make_batch(**overrides: Any) -> Batch:
    fields: dict[str, Any] = {
        "job_id": "j",
        "batch_id": "b",
        "shard_id": "s",
        "epoch": 0,
        "split": "train",
        "sample_ids": [1, 2],
        "x": torch.zeros(2, 1, 4, 4, dtype=torch.uint8),
        "y": torch.zeros(2, dtype=torch.int64),
        "timestamps": {},
    }
    fields.update(overrides)
    return Batch(**fields)


def test_batch_checks_its_contract() -> None:
    assert make_batch().x.shape == (2, 1, 4, 4)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"split": "test"}, "split"),
        ({"x": torch.zeros(2, 1, 4, 4)}, "x must be uint8"),
        ({"x": torch.zeros(2, 16, dtype=torch.uint8)}, "x must be uint8"),
        ({"y": torch.zeros(2, dtype=torch.int32)}, "y must be int64"),
        ({"y": torch.zeros(3, dtype=torch.int64)}, "y must be int64"),
        ({"sample_ids": [1]}, "1 sample_ids for 2 rows"),
    ]
    for overrides, reason in cases:
        with pytest.raises(ValueError, match=reason):
            make_batch(**overrides)


def contribution(**overrides: Any) -> Contribution:
    fields: dict[str, Any] = {
        "job_id": "j", "contribution_id": "w:0", "worker_id": "w", "base_version": 0,
        "num_samples": 3, "batch_ids": ["j:e1:train:00000:b000"], "epoch": 1,
        "sample_ids": sample_ids_tensor([7, 7, 2]), "loss_sum": 1.0, "grad_bytes": 8,
        "sent_at": 0.0,
    }  # fmt: skip
    fields.update(overrides)
    return Contribution(**fields)


def test_contribution_carries_the_sample_ids_it_was_computed_on() -> None:
    assert sample_ids_tensor([7, 7, 2]).dtype == torch.int32
    assert sample_ids_tensor([2**31]).dtype == torch.int64  # ids past int32 (synthetic://)
    assert sample_ids_tensor([]).shape == (0,)
    for ids in ([7, 7, 2], [2**40, 0, 1]):
        sent = contribution(sample_ids=sample_ids_tensor(ids))
        received = decode(encode(sent))
        assert isinstance(received, Contribution) and received.epoch == 1
        assert received.sample_ids.tolist() == ids  # repeats kept, in order
        assert received.sample_ids.dtype == sent.sample_ids.dtype
    assert contribution(num_samples=0, batch_ids=[], sample_ids=sample_ids_tensor([])).epoch == 1
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_samples": 2}, r"\[num_samples=2\], got torch.int32 \[3\]"),
        ({"sample_ids": torch.tensor([7.0, 7.0, 2.0])}, "int32/int64"),
        ({"sample_ids": torch.zeros(1, 3, dtype=torch.int64)}, "int32/int64"),
        ({"epoch": -1}, "epoch must be >= 0"),
        ({"inner_steps": [2, 0]}, "every inner step has >= 1 pass"),
    ]
    for overrides, reason in cases:
        with pytest.raises(ValueError, match=reason):
            contribution(**overrides)
    assert contribution().inner_steps == []  # sync and ssp: one step
    window = decode(encode(contribution(inner_steps=[1, 2])))
    assert isinstance(window, Contribution) and window.inner_steps == [1, 2]


def test_shard_task_checks_split_and_batch_size() -> None:
    fields: dict[str, Any] = {
        "job_id": "j", "shard_id": "s", "epoch": 0, "index": 0, "split": "eval",
        "dataset_uri": "builtin://sklearn-digits", "sample_ids": [1], "micro_batch_size": 8,
        "seed": 0, "preprocess": {},
    }  # fmt: skip
    assert ShardTask(**fields).split == "eval"
    with pytest.raises(ValueError, match="split"):
        ShardTask(**{**fields, "split": "validation"})
    with pytest.raises(ValueError, match="micro_batch_size"):
        ShardTask(**{**fields, "micro_batch_size": 0})
    assert ShardTask(**fields).partitions == []  # by the key's hash
    assert ShardTask(**fields, partitions=[3]).partitions == [3]  # one per batch
    with pytest.raises(ValueError, match="2 partitions for 1 batches"):
        ShardTask(**fields, partitions=[0, 1])
    with pytest.raises(ValueError, match="partitions must be >= 0"):
        ShardTask(**fields, partitions=[-1])


def test_topic_names() -> None:
    topics = Topics("conveyor.")
    assert (topics.jobs, topics.shards, topics.dlq) == (
        "conveyor.jobs",
        "conveyor.shards",
        "conveyor.dlq",
    )
    assert topics.batches("job-42") == "conveyor.job.job-42.batches"
    assert topics.grads("job-42") == "conveyor.job.job-42.grads"
    assert topics.params("job-42") == "conveyor.job.job-42.params"
    assert topics.control("job-42") == "conveyor.job.job-42.control"
    assert topics.job_topics("a_1") == (
        "conveyor.job.a_1.batches",
        "conveyor.job.a_1.grads",
        "conveyor.job.a_1.params",
        "conveyor.job.a_1.control",
    )
    assert Topics("t0123abcd.").dlq == "t0123abcd.dlq"
    assert Topics("").jobs == "jobs"


def test_group_ids_carry_the_topic_prefix() -> None:
    topics = Topics("conveyor.")
    assert topics.sharder_group == "conveyor-sharder"
    assert topics.preprocessor_group == "conveyor-preprocessors"
    assert topics.trainer_group("j1") == "conveyor-trainer.j1"
    assert topics.aggregator_group("j1") == "conveyor-aggregator.j1"
    assert Topics("team-b.").trainer_group("j1") == "team-b-trainer.j1"
    assert Topics("").trainer_group("j1") == "conveyor-trainer.j1"
    assert Topics("").preprocessor_group == "conveyor-preprocessors"


def test_topic_layout() -> None:
    topics = Topics("conveyor.")
    shared = topics.global_topics(jobs_partitions=4, shards_partitions=8)
    assert [(t.name, t.partitions) for t in shared] == [
        ("conveyor.jobs", 4), ("conveyor.shards", 8), ("conveyor.autoscaler", 1),
        ("conveyor.dlq", 1),
    ]  # fmt: skip
    per_job = topics.job_topic_specs("j1", batches_partitions=6, slices=3)
    assert {t.name: t.partitions for t in per_job} == {
        "conveyor.job.j1.batches": 6, "conveyor.job.j1.control": 1,
        "conveyor.job.j1.grads": 3, "conveyor.job.j1.params": 3,
    }  # fmt: skip
    assert {t.name for t in per_job} == set(topics.job_topics("j1"))
    with pytest.raises(ValueError, match="partitions"):
        topics.job_topic_specs("j1", batches_partitions=2, slices=0)


@pytest.mark.parametrize("prefix", ["con veyor.", "conveyor/", "x" * 101])
def test_invalid_topic_prefix_is_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Topics(prefix)


@pytest.mark.parametrize("job_id", ["", "a.b", "a/b", "ü", "x" * 129])
def test_invalid_job_id_is_rejected(job_id: str) -> None:
    with pytest.raises(ValueError, match="job id"):
        Topics("conveyor.").batches(job_id)
