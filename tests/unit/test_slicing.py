"""The flat parameter layout and its K slices: round trips, balance, version 0, and the
running statistics (BatchNorm buffers) that travel after the parameters."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from conveyor.training.jobspec import JobSpec
from conveyor.training.models import build_model
from conveyor.training.slicing import ParamLayout, build_job_model, check_buffers, slice_bounds

SPEC = {
    "name": "s",
    "model": {"name": "small_cnn", "num_classes": 10, "channels": [4, 8]},
    "dataset": {"uri": "builtin://sklearn-digits"},
    "training": {
        "epochs": 1, "global_batch_size": 8, "micro_batch_size": 4,
        "optimizer": {"name": "sgd", "lr": 0.1}, "seed": 7,
    },
}  # fmt: skip


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("small_cnn", in_channels=1, num_classes=10, image_size=(8, 8), channels=[4])


@pytest.mark.parametrize(("numel", "k"), [(10, 3), (7, 7), (3, 5), (1_000_003, 4), (0, 2)])
def test_slice_bounds_cover_the_vector_and_balance(numel: int, k: int) -> None:
    bounds = slice_bounds(numel, k)
    assert len(bounds) == k
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == numel


def test_slice_bounds_formula() -> None:
    assert slice_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ValueError):
        slice_bounds(10, 0)


def test_flatten_and_load_round_trip() -> None:
    model = small_model()
    layout = ParamLayout.from_model(model)
    expected = sum(p.numel() for p in model.parameters())
    assert layout.numel == expected
    assert [e.name for e in layout.entries] == [n for n, _ in model.named_parameters()]
    flat = layout.flatten_params(model)
    assert flat.dtype == torch.float32 and flat.shape == (expected,)
    # entries point at the right elements
    for entry, (_, param) in zip(layout.entries, model.named_parameters(), strict=True):
        assert torch.equal(flat[entry.offset : entry.offset + entry.numel], param.reshape(-1))
    # load a different vector, read it back; slicing and concatenating changes nothing
    new = torch.arange(expected, dtype=torch.float32) / expected
    layout.load_flat(model, new)
    assert torch.equal(layout.flatten_params(model), new)
    parts = [new[a:b] for a, b in layout.slice_bounds(3)]
    assert torch.equal(torch.cat(parts), new)
    with pytest.raises(ValueError):
        layout.load_flat(model, new[:-1])


def test_flatten_grads_zero_where_missing() -> None:
    model = small_model()
    layout = ParamLayout.from_model(model)
    assert torch.count_nonzero(layout.flatten_grads(model)) == 0
    x = torch.randn(2, 1, 8, 8)
    model(x).sum().backward()
    grads = layout.flatten_grads(model)
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    assert torch.equal(grads, expected)


def test_layout_rejects_another_model() -> None:
    layout = ParamLayout.from_model(small_model())
    other = build_model("mlp", in_channels=1, num_classes=10, image_size=(8, 8))
    with pytest.raises(ValueError, match="do not match"):
        layout.flatten_params(other)


def test_build_job_model_is_seeded_and_leaves_the_rng_alone() -> None:
    spec = JobSpec.from_dict(SPEC)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_job_model(spec, num_classes=10, sample_shape=(1, 8, 8))
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_job_model(spec, num_classes=10, sample_shape=[1, 8, 8])
    layout = ParamLayout.from_model(a)
    assert torch.equal(layout.flatten_params(a), layout.flatten_params(b))
    # the same as the brief's recipe: manual_seed(seed) then build_model
    torch.manual_seed(7)
    c = build_model("small_cnn", in_channels=1, num_classes=10, image_size=(8, 8), channels=[4, 8])
    assert torch.equal(layout.flatten_params(a), layout.flatten_params(c))


def test_build_job_model_checks_dataset_and_state() -> None:
    spec = JobSpec.from_dict(SPEC)
    with pytest.raises(ValueError, match="num_classes is 10 but the dataset has 3"):
        build_job_model(spec, num_classes=3, sample_shape=(1, 8, 8))
    batch = {**SPEC, "model": {"name": "resnet18", "width": 4}}
    resnet = build_job_model(JobSpec.from_dict(batch), num_classes=10, sample_shape=(1, 8, 8))
    assert ParamLayout.from_model(resnet).has_statistics
    topk = {**batch, "distribution": {"compression": {"kind": "topk", "ratio": 0.1}}}
    with pytest.raises(ValueError, match="travel with the gradients uncompressed"):
        build_job_model(JobSpec.from_dict(topk), num_classes=10, sample_shape=(1, 8, 8))
    local = {**batch, "distribution": {"mode": "local", "sync_every_steps": 4}}
    with pytest.raises(ValueError, match="not as local mode's parameter deltas"):
        build_job_model(JobSpec.from_dict(local), num_classes=10, sample_shape=(1, 8, 8))
    group = JobSpec.from_dict({**SPEC, "model": {"name": "resnet18", "width": 4, "norm": "group"}})
    model = build_job_model(group, num_classes=10, sample_shape=(1, 8, 8), device="meta")
    assert not ParamLayout.from_model(model).has_statistics


def test_state_the_plane_cannot_carry_is_refused() -> None:
    spec = JobSpec.from_dict(SPEC)
    cumulative = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, momentum=None))
    with pytest.raises(ValueError, match="momentum=None"):
        check_buffers(cumulative, "net", spec)
    counter = nn.Linear(2, 2)
    counter.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    with pytest.raises(ValueError, match="integer state in buffer 'calls'"):
        check_buffers(counter, "net", spec)
    check_buffers(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), "net", spec)


def batch_norm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(108, 2))


def running_statistics(model: nn.Sequential) -> tuple[torch.Tensor, torch.Tensor]:
    """The running mean and variance of the BatchNorm2d layer of :func:`batch_norm_model`."""
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm2d)
    assert bn.running_mean is not None and bn.running_var is not None
    return bn.running_mean, bn.running_var


def test_statistics_follow_the_parameters_and_are_sent_times_the_samples() -> None:
    model = batch_norm_model()
    layout = ParamLayout.from_model(model)
    params = sum(p.numel() for p in model.parameters())
    names = [e.name for e in layout.entries if e.statistic]
    assert names == ["1.running_mean", "1.running_var"]  # not num_batches_tracked (int)
    assert layout.numel == params + 6
    model.train()
    model(torch.randn(5, 1, 8, 8) * 3 + 1).sum().backward()  # moves the running statistics
    with pytest.raises(ValueError, match="num_samples"):
        layout.flatten_grads(model)
    sent = layout.flatten_grads(model, 5)
    mean, var = running_statistics(model)
    grads = [p.grad.reshape(-1) for p in model.parameters()]  # type: ignore[union-attr]
    assert torch.equal(sent[:params], torch.cat(grads))
    assert torch.equal(sent[params:], torch.cat([mean, var]) * 5)
    # the flat vector carries them both ways
    flat = layout.flatten_params(model)
    assert torch.equal(flat[params:], torch.cat([mean, var]))
    fresh = batch_norm_model()
    layout.load_flat(fresh, flat)
    assert torch.equal(running_statistics(fresh)[1], var)
    # slice-relative ranges: slice [params - 2, params + 4) holds the 3 means from its
    # element 2 and the first variance
    assert layout.statistic_ranges(params - 2, params + 4) == [(2, 5), (5, 6)]
    assert layout.statistic_ranges(0, params) == []
