"""Slice optimizers equal the full-model optimizer; learning-rate schedule values."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from conveyor.training.jobspec import LrScheduleSpec, OptimizerSpec
from conveyor.training.models import build_model
from conveyor.training.optim import SliceOptimizer, build_optimizer, lr_at, staleness_momentum
from conveyor.training.slicing import ParamLayout


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        {"name": "sgd", "lr": 0.1},
        {"name": "adam", "lr": 1e-3, "weight_decay": 1e-2},
        {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "betas": [0.8, 0.99]},
    ],
)
def test_slices_equal_full_model_optimizer(optimizer: dict[str, Any]) -> None:
    spec = OptimizerSpec.model_validate(optimizer)
    torch.manual_seed(0)
    model = build_model("small_cnn", in_channels=1, num_classes=10, image_size=(8, 8), channels=[4])
    layout = ParamLayout.from_model(model)
    full = build_optimizer(spec, model.parameters())
    flat = layout.flatten_params(model)
    bounds = layout.slice_bounds(3)
    slices = [SliceOptimizer(spec, flat[a:b]) for a, b in bounds]
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(16, 1, 8, 8, generator=generator)
        y = torch.randint(0, 10, (16,), generator=generator)
        full.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
        loss.backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():
            p.grad.div_(16)  # type: ignore[union-attr]
        grads = layout.flatten_grads(model)
        lr = spec.lr * (0.5 if step % 2 else 1.0)  # schedules change the lr between steps
        for group in full.param_groups:
            group["lr"] = lr
        full.step()
        for (a, b), sliced in zip(bounds, slices, strict=True):
            sliced.step(grads[a:b], lr)
    expected = layout.flatten_params(model)
    got = torch.cat([s.values for s in slices])
    assert not torch.equal(expected, flat)  # the steps did something
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_staleness_momentum_and_a_step_at_a_given_momentum() -> None:
    assert staleness_momentum(0.9, 0) == 0.9
    assert staleness_momentum(0.9, 1) == pytest.approx(0.45)
    assert staleness_momentum(0.9, 2) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="staleness"):
        staleness_momentum(0.9, -1)
    sliced = SliceOptimizer(OptimizerSpec(name="sgd", lr=0.1, momentum=0.9), torch.zeros(2))
    g1, g2 = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
    sliced.step(g1, 0.1)  # buffer = g1
    sliced.step(g2, 0.1, momentum=0.45)  # buffer = 0.45 * g1 + g2
    expected = -0.1 * g1 - 0.1 * (0.45 * g1 + g2)
    torch.testing.assert_close(sliced.values, expected)
    sliced.step(g2, 0.1)  # the job's 0.9 again: buffer = 0.9 * (0.45 * g1 + g2) + g2
    expected -= 0.1 * (0.9 * (0.45 * g1 + g2) + g2)
    torch.testing.assert_close(sliced.values, expected)


def test_slice_optimizer_rejects_wrong_gradient() -> None:
    sliced = SliceOptimizer(OptimizerSpec(name="sgd", lr=0.1), torch.zeros(4))
    with pytest.raises(ValueError):
        sliced.step(torch.zeros(5), 0.1)


def test_constant_with_warmup() -> None:
    spec = LrScheduleSpec(warmup_steps=4)
    assert [lr_at(spec, 1.0, s, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(LrScheduleSpec(), 0.3, 999, 10) == 0.3


def test_cosine() -> None:
    spec = LrScheduleSpec(name="cosine", warmup_steps=2, min_lr=0.1)
    # after warmup: t = step - 2 over T = 10 - 2 = 8 steps
    assert lr_at(spec, 1.0, 0, 10) == pytest.approx(0.5)
    assert lr_at(spec, 1.0, 2, 10) == pytest.approx(1.0)
    assert lr_at(spec, 1.0, 6, 10) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2)
    assert lr_at(spec, 1.0, 10, 10) == pytest.approx(0.1)
    assert lr_at(spec, 1.0, 50, 10) == pytest.approx(0.1)  # past the end: stays at min_lr


def test_step_decay() -> None:
    spec = LrScheduleSpec(name="step", step_size=3, gamma=0.5, min_lr=0.1)
    values = [lr_at(spec, 1.0, s, 100) for s in range(10)]
    assert values == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125])
    assert lr_at(spec, 1.0, 30, 100) == pytest.approx(0.1)  # floor


def test_schedule_spec_validation() -> None:
    with pytest.raises(ValueError, match="step_size is required"):
        LrScheduleSpec(name="step")
    with pytest.raises(ValueError, match="step_size applies"):
        LrScheduleSpec(name="cosine", step_size=3)
    with pytest.raises(ValueError):
        lr_at(LrScheduleSpec(), 1.0, -1, 10)
