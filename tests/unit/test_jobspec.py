"""The job spec: every validation rule, its error location, and the shipped examples."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.training.jobspec import JobSpec
from conveyor.training.jobspec.distribution import OVERLAP_MIN_GRADIENT_BYTES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

BASE: dict[str, Any] = {
    "name": "digits-cnn",
    "model": {"name": "small_cnn", "num_classes": 10},
    "dataset": {"uri": "builtin://sklearn-digits"},
    "training": {
        "epochs": 2,
        "global_batch_size": 64,
        "micro_batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    },
}


def spec_with(path: str, value: Any) -> dict[str, Any]:
    """BASE with the dotted ``path`` set to ``value`` (sections created as needed)."""
    data = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


def errors_of(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(data)
    return [(tuple(error["loc"]), error["msg"]) for error in info.value.errors()]


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = JobSpec.model_validate(BASE)
    assert spec.model.options == {"num_classes": 10}
    assert spec.dataset.eval_fraction == 0.2
    assert spec.dataset.scheme == "builtin"
    assert spec.preprocess.normalize is None and spec.preprocess.augment == []
    assert spec.training.precision == "fp32" and spec.training.seed == 0
    assert spec.distribution.trainers == 1 and spec.distribution.mode == "sync"
    assert spec.distribution.allocation == "adaptive"
    assert spec.distribution.compression.kind == "none"
    assert spec.flow.max_lead_batches == 512  # 2 KiB batches of 8x8 digits: the most
    assert spec.resources.device == "auto"
    assert spec.micro_batches_per_step == 2
    assert spec.shard_size == 8 * 32  # the most a shard holds (a lead of 512 fits 64 of them)


@pytest.mark.parametrize(
    ("lead", "micro_batches"), [(1, 1), (16, 1), (32, 2), (64, 4), (127, 7), (128, 8), (4096, 8)]
)
def test_default_shards_let_the_lead_hold_16_tasks_of_1_to_8_micro_batches(
    lead: int, micro_batches: int
) -> None:
    spec = JobSpec.model_validate(spec_with("flow", {"max_lead_batches": lead}))
    assert spec.shard_size == micro_batches * spec.training.micro_batch_size
    given = spec_with("flow", {"max_lead_batches": lead, "shard_size": 96})
    assert JobSpec.model_validate(given).shard_size == 96  # a set size is kept


NPZ = "npz://data/digits"
"""An array dataset whose images are known only once read."""


@pytest.mark.parametrize(
    ("uri", "preprocess", "distribution", "lead"),
    [
        (NPZ, {"image_size": [64, 64], "channels": 3}, {}, 512),  # 384 KiB a batch: the most
        (NPZ, {"image_size": [64, 64], "channels": 1}, {}, 512),
        (NPZ, {"image_size": [128, 128]}, {}, 170),  # channels unknown: counted as 3
        (NPZ, {"image_size": [224, 224], "channels": 3}, {}, 64),  # 4.6 MiB a batch: the least
        (NPZ, {}, {}, 64),  # the images' size is not in the spec
        ("builtin://sklearn-digits", {}, {}, 512),  # 1x8x8: the URI says
        ("synthetic://?n=500&shape=3x224x224", {}, {}, 64),  # 4.6 MiB a batch
        ("synthetic://?n=500&shape=160x160", {}, {}, 327),  # HxW: one channel, 800 KiB
        ("synthetic://?n=500", {}, {}, 512),  # the default 3x32x32
        ("synthetic://?n=500&shape=3xbig", {}, {}, 64),  # refused when planned; unsized here
        (NPZ, {}, {"mode": "local", "sync_every_steps": 100}, 400),  # two windows of 2 x 100
        (NPZ, {}, {"mode": "local", "sync_every_steps": 8, "overlap_steps": 2}, 64),
        (NPZ, {}, {"mode": "local", "sync_every_steps": 20}, 80),
    ],
)
def test_a_default_lead_holds_256_mib_of_batches_and_two_windows(
    uri: str, preprocess: dict[str, Any], distribution: dict[str, Any], lead: int
) -> None:
    data = spec_with("preprocess", preprocess)
    data["dataset"] = {"uri": uri}
    data["distribution"] = distribution
    spec = JobSpec.model_validate(data)
    assert spec.flow.max_lead_batches == spec.lead_batches == lead
    assert JobSpec.from_dict(spec.to_dict()) == spec  # the resolved lead travels with the spec
    # A lead the spec sets is kept, and still checked against the window.
    data["flow"] = {"max_lead_batches": 150}
    if distribution.get("sync_every_steps") == 100:
        assert "must hold one local-mode window" in str(errors_of(data))
    else:
        assert JobSpec.model_validate(data).lead_batches == 150


def test_to_dict_is_json_safe_and_round_trips() -> None:
    spec = JobSpec.model_validate(spec_with("training.optimizer", {"name": "adam", "lr": 1e-3}))
    data = spec.to_dict()
    assert data["training"]["optimizer"]["betas"] == [0.9, 0.999]
    assert data["model"] == {"name": "small_cnn", "num_classes": 10}
    assert JobSpec.from_dict(data) == spec


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_validate(name: str) -> None:
    spec = JobSpec.from_yaml((EXAMPLES / name).read_text())
    assert spec.training.global_batch_size % spec.training.micro_batch_size == 0
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_digits_example_matches_the_design() -> None:
    spec = JobSpec.from_yaml((EXAMPLES / "digits.yaml").read_text())
    assert spec.name == "digits-cnn"
    assert spec.dataset.uri == "builtin://sklearn-digits"
    assert spec.model.name == "small_cnn"
    assert spec.training.optimizer.name == "sgd" and spec.training.optimizer.momentum == 0.9
    assert spec.preprocess.normalize is not None and spec.preprocess.normalize.std == [0.5]


def test_synthetic_example_augments() -> None:
    spec = JobSpec.from_yaml((EXAMPLES / "synthetic.yaml").read_text())
    assert [a.name for a in spec.preprocess.augment] == ["random_crop", "hflip", "cpu_cost"]
    assert spec.dataset.scheme == "synthetic"


@pytest.mark.parametrize(
    ("path", "value", "loc", "fragment"),
    [
        ("name", "Digits CNN", ("name",), "pattern"),
        ("name", "x" * 65, ("name",), "at most 64"),
        ("dataset.uri", "http://example.com/x", ("dataset", "uri"), "unknown dataset scheme"),
        ("dataset.uri", "sklearn-digits", ("dataset", "uri"), "<scheme>://"),
        ("dataset.uri", "builtin://", ("dataset", "uri"), "no location"),
        ("dataset.eval_fraction", 0.6, ("dataset", "eval_fraction"), "less than or equal"),
        ("training.epochs", 0, ("training", "epochs"), "greater than or equal to 1"),
        ("training.micro_batch_size", 30, ("training", "micro_batch_size"), "multiple of"),
        ("training.precision", "fp8", ("training", "precision"), "'fp32' or 'bf16'"),
        ("training.optimizer.name", "lion", ("training", "optimizer", "name"), "'sgd'"),
        ("training.optimizer.lr", 0, ("training", "optimizer", "lr"), "greater than 0"),
        ("training.optimizer.lr", float("nan"), ("training", "optimizer", "lr"), "finite"),
        ("distribution.trainers", 0, ("distribution", "trainers"), "greater than or equal"),
        ("distribution.staleness", -1, ("distribution", "staleness"), "greater than or equal"),
        ("distribution.mode", "async", ("distribution", "mode"), "'sync', 'ssp' or 'local'"),
        ("distribution.allocation", "fair", ("distribution", "allocation"), "'adaptive' or"),
        ("resources.device", "tpu", ("resources", "device"), "pattern"),
        ("resources.memory_fraction", 1.5, ("resources", "memory_fraction"), "less than"),
        (
            "resources",
            {"device": "cpu", "memory_fraction": 0.5},
            ("resources", "memory_fraction"),
            "device cpu has none",
        ),
        ("checkpoint.uri", "ftp://x", ("checkpoint", "uri"), "file://"),
        ("checkpoint.keep_last", 0, ("checkpoint", "keep_last"), "greater than or equal"),
        ("flow.max_lead_batches", 0, ("flow", "max_lead_batches"), "greater than or equal"),
        ("flow.shard_size", 100, ("flow",), "multiple of training.micro_batch_size"),
        ("unknown_section", {}, ("unknown_section",), "Extra inputs are not permitted"),
        ("training.lr", 0.1, ("training", "lr"), "Extra inputs are not permitted"),
    ],
)
def test_each_rule_reports_its_field(
    path: str, value: Any, loc: tuple[str, ...], fragment: str
) -> None:
    errors = errors_of(spec_with(path, value))
    assert [error_loc for error_loc, _ in errors] == [loc]
    assert fragment in errors[0][1]


@pytest.mark.parametrize(
    ("distribution", "loc", "fragment"),
    [
        ({"trainers": 2, "min_trainers": 3}, "min_trainers", "(3) must be <= trainers (2)"),
        ({"trainers": 2, "max_trainers": 1}, "max_trainers", "(1) must be >= trainers (2)"),
    ],
)
def test_trainer_bounds_must_hold_trainers(
    distribution: dict[str, int], loc: str, fragment: str
) -> None:
    [(error_loc, msg)] = errors_of(spec_with("distribution", distribution))
    assert error_loc == ("distribution", loc) and fragment in msg


def test_trainer_bounds_and_priority_defaults() -> None:
    spec = JobSpec.model_validate(BASE)
    assert spec.priority == 0 and spec.distribution.trainer_bounds == (1, 1, 1)
    elastic = JobSpec.model_validate(
        spec_with("distribution", {"trainers": 2, "min_trainers": 1, "max_trainers": 4})
    )
    assert elastic.distribution.trainer_bounds == (1, 2, 4)
    assert errors_of({**BASE, "priority": 1001})[0][0] == ("priority",)


def test_global_batch_must_be_a_multiple_of_micro_batch() -> None:
    [(loc, msg)] = errors_of(spec_with("training.global_batch_size", 100))
    assert loc == ("training", "micro_batch_size")
    assert "global_batch_size (100) must be a multiple of micro_batch_size (32)" in msg


def test_micro_batch_larger_than_global_is_rejected() -> None:
    [(loc, _)] = errors_of(spec_with("training.micro_batch_size", 128))
    assert loc == ("training", "micro_batch_size")


@pytest.mark.parametrize(
    ("compression", "loc", "fragment"),
    [
        ({"kind": "topk"}, ("ratio",), "required when kind is topk"),
        ({"kind": "topk", "ratio": 0.0}, ("ratio",), "greater than 0"),
        ({"kind": "topk", "ratio": 1.5}, ("ratio",), "less than or equal to 1"),
        ({"kind": "fp16", "ratio": 0.1}, ("ratio",), "applies to kind topk only"),
        ({"kind": "zstd"}, ("kind",), "'topk'"),
    ],
)
def test_compression_rules(compression: dict[str, Any], loc: tuple[str], fragment: str) -> None:
    [(error_loc, msg)] = errors_of(spec_with("distribution.compression", compression))
    assert error_loc == ("distribution", "compression", *loc)
    assert fragment in msg


def test_topk_with_ratio_is_valid() -> None:
    compression = {"kind": "topk", "ratio": 0.01, "error_feedback": False}
    spec = JobSpec.model_validate(spec_with("distribution.compression", compression))
    assert spec.distribution.compression.ratio == 0.01
    assert spec.distribution.compression.error_feedback is False


@pytest.mark.parametrize(
    ("optimizer", "fragment"),
    [
        ({"name": "adam", "lr": 0.001, "momentum": 0.9}, "sgd only"),
        ({"name": "sgd", "lr": 0.1, "nesterov": True}, "momentum > 0"),
        ({"name": "adamw", "lr": 0.1, "betas": [0.9, 1.0]}, "[0, 1)"),
    ],
)
def test_optimizer_cross_field_rules(optimizer: dict[str, Any], fragment: str) -> None:
    [(loc, msg)] = errors_of(spec_with("training.optimizer", optimizer))
    assert loc[:3] == ("training", "optimizer", loc[2]) and loc[2] in {"nesterov", "betas"}
    assert fragment in msg


def test_normalize_lengths_and_std_must_agree() -> None:
    bad_len = spec_with("preprocess.normalize", {"mean": [0.5, 0.5], "std": [0.5]})
    [(loc, msg)] = errors_of(bad_len)
    assert loc == ("preprocess", "normalize", "std") and "std has 1 values but mean has 2" in msg
    zero_std = spec_with("preprocess.normalize", {"mean": [0.5], "std": [0.0]})
    [(loc, msg)] = errors_of(zero_std)
    assert loc == ("preprocess", "normalize", "std") and "> 0" in msg


def test_augment_is_a_tagged_union() -> None:
    [(loc, msg)] = errors_of(spec_with("preprocess.augment", [{"name": "rotate"}]))
    assert loc == ("preprocess", "augment", 0) and "random_crop" in msg
    [(loc, _)] = errors_of(spec_with("preprocess.augment", [{"name": "hflip", "p": 2}]))
    assert loc == ("preprocess", "augment", 0, "hflip", "p")
    ok = JobSpec.model_validate(spec_with("preprocess.augment", [{"name": "random_crop"}]))
    assert ok.preprocess.augment[0].name == "random_crop"


def test_model_options_must_be_plain_values() -> None:
    errors = errors_of(spec_with("model", {"name": "mlp", "hidden": {"a": 1}}))
    assert errors and all(loc[:2] == ("model", "hidden") for loc, _ in errors)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_devices_accepted(device: str) -> None:
    assert JobSpec.model_validate(spec_with("resources.device", device)).resources.device == device


def test_explicit_shard_size_wins() -> None:
    spec = JobSpec.model_validate(spec_with("flow.shard_size", 96))
    assert spec.shard_size == 96


def test_from_yaml_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="not valid YAML"):
        JobSpec.from_yaml("name: [unclosed")
    with pytest.raises(ValueError, match="mapping"):
        JobSpec.from_yaml("- a\n- b\n")
    with pytest.raises(ValidationError):
        JobSpec.from_yaml("name: x\n")


def test_spec_is_immutable() -> None:
    spec = JobSpec.model_validate(BASE)
    with pytest.raises(ValidationError):
        spec.name = "other"  # type: ignore[misc]


def test_the_readmes_distribution_snippet_validates() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in readme.split("```yaml")[1:]]
    snippet = next(block.split("```")[0] for block in blocks if "distribution:" in block)
    spec = JobSpec.from_yaml(
        "name: readme\nmodel: {name: small_cnn}\n"
        "dataset: {uri: 'builtin://sklearn-digits'}\n"
        "training: {epochs: 1, global_batch_size: 64, micro_batch_size: 32,"
        " optimizer: {name: sgd, lr: 0.1}}\n" + snippet
    )
    distribution = spec.distribution
    assert (distribution.trainers, distribution.aggregator_shards) == (2, 2)
    assert (distribution.mode, distribution.staleness, distribution.allocation) == (
        "sync",
        2,
        "adaptive",
    )
    assert (distribution.compression.kind, distribution.compression.ratio) == ("topk", 0.01)


def test_image_file_datasets_need_an_image_size() -> None:
    data = spec_with("dataset.uri", "imagefolder:///data/pets")
    assert errors_of(data) == [
        (("preprocess",), "Value error, imagefolder:// images have any size: set image_size "
                          "[H, W], the shape the preprocessors bring them to"),
    ]  # fmt: skip
    data["preprocess"] = {"image_size": [32, 32], "channels": 1}
    spec = JobSpec.model_validate(data)
    assert (spec.preprocess.image_size, spec.preprocess.channels) == ((32, 32), 1)
    assert spec.dataset.max_bad_samples == 10


@pytest.mark.parametrize(
    ("preprocess", "fragment"),
    [
        ({"image_size": [0, 8]}, "sides must be in [1, 4096]"),
        ({"channels": 2}, "Input should be 1 or 3"),
        ({"augment": [{"name": "resize"}, {"name": "random_resized_crop"}]}, "at most one of"),
        ({"augment": [{"name": "random_resized_crop", "scale": [0.5, 1.5]}]}, "at most 1"),
        ({"augment": [{"name": "random_resized_crop", "ratio": [2, 1]}]}, "0 < low <= high"),
        ({"augment": [{"name": "color_jitter", "hue": 0.6}]}, "less than or equal to 0.5"),
        ({"augment": [{"name": "resize", "fit": "pad"}]}, "'crop' or 'stretch'"),
    ],
)
def test_preprocess_rules(preprocess: dict[str, Any], fragment: str) -> None:
    messages = [message for _, message in errors_of(spec_with("preprocess", preprocess))]
    assert any(fragment in message for message in messages), messages


def test_tokens_train_language_models_only() -> None:
    tokens = spec_with("dataset.uri", "tokens:///data/owt.bin?vocab_size=256")
    [(loc, message)] = errors_of(tokens)
    assert loc == ("dataset",) and "tokens:// datasets train language models (gpt)" in message
    tokens["model"] = {"name": "gpt", "n_layer": 2}
    spec = JobSpec.model_validate(tokens)
    assert spec.language_model and not JobSpec.model_validate(BASE).language_model
    [(loc, message)] = errors_of(spec_with("model", {"name": "gpt"}))
    assert loc == ("dataset",) and "reads tokens:// datasets, not builtin://" in message
    [(loc, message)] = errors_of({**tokens, "preprocess": {"augment": [{"name": "hflip"}]}})
    assert loc == ("preprocess",) and "leave preprocess out" in message


def test_max_bad_samples_range() -> None:
    [(loc, _)] = errors_of(spec_with("dataset.max_bad_samples", -1))
    assert loc == ("dataset", "max_bad_samples")


@pytest.mark.parametrize(
    ("distribution", "loc", "fragment"),
    [
        ({"mode": "local"}, ("sync_every_steps",), "required when mode is local"),
        ({"mode": "local", "sync_every_steps": 0}, ("sync_every_steps",), "greater than or"),
        ({"mode": "sync", "sync_every_steps": 8}, ("sync_every_steps",), "mode local only"),
        (
            {"mode": "ssp", "outer_optimizer": {"name": "sgd", "lr": 0.7}},
            ("outer_optimizer",),
            "mode local only",
        ),
        (
            {"mode": "local", "sync_every_steps": 8,
             "outer_optimizer": {"name": "sgd", "lr": 0.7, "nesterov": True}},
            ("outer_optimizer", "nesterov"),
            "nesterov requires",
        ),
        (
            {"mode": "local", "sync_every_steps": 8, "overlap_backward": True},
            ("overlap_backward",),
            "applies to modes sync and ssp",
        ),
        ({"mode": "sync", "overlap_steps": 2}, ("overlap_steps",), "mode local only"),
        (
            {"mode": "local", "sync_every_steps": 4, "overlap_steps": 4},
            ("overlap_steps",),
            "must be less than sync_every_steps (4)",
        ),
        (
            {"mode": "local", "sync_every_steps": 4, "overlap_steps": -1},
            ("overlap_steps",),
            "greater than or",
        ),
    ],
)  # fmt: skip
def test_local_mode_rules(distribution: dict[str, Any], loc: tuple[str], fragment: str) -> None:
    [(error_loc, msg)] = errors_of(spec_with("distribution", distribution))
    assert error_loc == ("distribution", *loc)
    assert fragment in msg


@pytest.mark.parametrize(
    ("distribution", "gradient_bytes", "overlaps"),
    [
        ({"mode": "sync"}, OVERLAP_MIN_GRADIENT_BYTES, True),
        ({"mode": "ssp"}, 44_695_848, True),  # resnet18
        ({"mode": "sync"}, OVERLAP_MIN_GRADIENT_BYTES - 4, False),
        ({"mode": "sync"}, 95_784, False),  # the digits demo's small_cnn
        ({"mode": "sync", "overlap_backward": True}, 95_784, True),
        ({"mode": "sync", "overlap_backward": False}, 44_695_848, False),
        ({"mode": "local", "sync_every_steps": 8}, 44_695_848, False),
        ({"mode": "local", "sync_every_steps": 8, "overlap_backward": False}, 95_784, False),
    ],
)
def test_the_backward_overlaps_the_send_of_a_large_gradient_in_sync_and_ssp_unless_set(
    distribution: dict[str, Any], gradient_bytes: int, overlaps: bool
) -> None:
    spec = JobSpec.model_validate(spec_with("distribution", distribution))
    assert spec.distribution.overlaps_backward(gradient_bytes) is overlaps


def test_local_mode_defaults_to_an_outer_nesterov_and_needs_a_window_of_lead() -> None:
    spec = JobSpec.model_validate(
        spec_with("distribution", {"mode": "local", "sync_every_steps": 8})
    )
    outer = spec.distribution.outer
    assert (outer.name, outer.lr, outer.momentum, outer.nesterov) == ("sgd", 0.7, 0.5, True)
    data = spec_with("distribution", {"mode": "local", "sync_every_steps": 40})
    data["flow"] = {"max_lead_batches": 64}  # a window is 40 steps x 2 micro-batches = 80
    [(error_loc, msg)] = errors_of(data)
    assert error_loc == ("flow",) and "must hold one local-mode window" in msg
    # Overlapped steps take the next window's batches while the last window's wait.
    data = spec_with("distribution", {"mode": "local", "sync_every_steps": 30, "overlap_steps": 3})
    data["flow"] = {"max_lead_batches": 64}  # (30 + 3) x 2 = 66
    [(error_loc, msg)] = errors_of(data)
    assert error_loc == ("flow",) and "= 66" in msg
    data["flow"] = {"max_lead_batches": 66}
    assert JobSpec.model_validate(data).distribution.overlap_steps == 3


@pytest.mark.parametrize(
    ("distribution", "fragment"),
    [
        ({"trainers": 2}, "exactly one trainer"),
        ({"max_trainers": 2}, "exactly one trainer"),
        ({"mode": "ssp"}, "needs mode sync"),
        ({"compression": {"kind": "topk", "ratio": 0.01}}, "cannot use topk"),
    ],
)
def test_deterministic_is_refused_where_it_cannot_hold(
    distribution: dict[str, Any], fragment: str
) -> None:
    data = spec_with("distribution", {**distribution, "deterministic": True})
    [(error_loc, msg)] = errors_of(data)
    assert error_loc == ("distribution", "deterministic") and fragment in msg


def test_deterministic_needs_a_lead_of_one_step_and_is_off_by_default() -> None:
    assert JobSpec.model_validate(BASE).distribution.deterministic is False
    data = spec_with("distribution", {"deterministic": True, "compression": {"kind": "bf16"}})
    assert JobSpec.model_validate(data).distribution.deterministic
    data["training"]["global_batch_size"] = 128  # 4 micro-batches a step
    data["flow"] = {"max_lead_batches": 3}
    [(error_loc, msg)] = errors_of(data)
    assert error_loc == ("flow",) and "must hold one deterministic step: 4" in msg
