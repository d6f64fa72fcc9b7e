"""Gradient accumulation, normalisation, optimizers and devices of the trainer's compute."""

from __future__ import annotations

import pytest
import torch

from conveyor.libs.jobspec import NormalizeSpec, OptimizerSpec, ResourcesSpec
from conveyor.libs.models import build_model
from conveyor.services.trainer.compute import (
    Engine,
    LocalUpdater,
    Normalizer,
    apply_resources,
    build_optimizer,
    resolve_device,
)

CPU = torch.device("cpu")


def make_engine(optimizer: OptimizerSpec) -> tuple[Engine, LocalUpdater]:
    torch.manual_seed(0)
    model = build_model(
        "small_cnn", in_channels=1, num_classes=10, image_size=(8, 8), channels=[8, 16]
    )
    engine = Engine(model, CPU, bf16=False, normalizer=Normalizer(None, 1, CPU))
    updater = LocalUpdater(model, build_optimizer(optimizer, list(model.parameters())))
    return engine, updater


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return x, y


@pytest.mark.parametrize(
    "optimizer",
    [
        OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.01),
    ],
)
def test_two_micro_batches_make_the_same_update_as_one_double_batch(
    optimizer: OptimizerSpec,
) -> None:
    x, y = batch(12, seed=1)
    sizes = [(0, 5), (5, 12)]  # unequal micro-batches: the mean is by sample count
    accumulated, accumulated_updater = make_engine(optimizer)
    whole, whole_updater = make_engine(optimizer)
    for _ in range(3):  # several steps, so optimizer state (momentum, moments) matters too
        loss_parts = sum(accumulated.accumulate(x[a:b], y[a:b]).loss_sum for a, b in sizes)
        accumulated_updater.apply(12)
        loss_whole = whole.accumulate(x, y).loss_sum
        whole_updater.apply(12)
        assert loss_parts == pytest.approx(loss_whole, rel=1e-5)
    for (name, p_acc), (_, p_whole) in zip(
        accumulated.model.named_parameters(), whole.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p_acc, p_whole, rtol=1e-5, atol=1e-6, msg=name)
        assert p_acc.grad is None  # cleared for the next step


def test_evaluate_counts_correct_predictions_on_a_snapshot_without_gradients() -> None:
    engine, updater = make_engine(OptimizerSpec(name="sgd", lr=0.5))
    x, y = batch(16, seed=2)
    snapshot = engine.snapshot()
    before = [p.clone() for p in snapshot.parameters()]
    engine.accumulate(x, y)
    updater.apply(16)  # the live model moves on; the snapshot must not
    result = engine.evaluate(snapshot, x, y)
    logits = snapshot(x.float() / 255.0)
    assert result.samples == 16
    assert result.correct == int((logits.argmax(1) == y).sum())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot.parameters(), strict=True))
    assert all(p.grad is None for p in snapshot.parameters())


def test_bf16_autocast_runs_on_cpu() -> None:
    engine, _ = make_engine(OptimizerSpec(name="adam", lr=0.01))
    engine.bf16 = True
    result = engine.accumulate(*batch(4, seed=3))
    assert result.samples == 4 and result.loss_sum > 0


def test_normalizer_scales_then_standardises_per_channel() -> None:
    normalize = Normalizer(NormalizeSpec(mean=[0.5, 0.0], std=[0.5, 2.0]), 2, CPU)
    x = torch.tensor([[[[255]], [[255]]], [[[0]], [[0]]]], dtype=torch.uint8)  # [2,2,1,1]
    out = normalize(x)
    assert out.dtype == torch.float32
    assert out.flatten().tolist() == [1.0, 0.5, -1.0, 0.0]
    with pytest.raises(ValueError, match="3 values for 2"):
        Normalizer(NormalizeSpec(mean=[0.1] * 3, std=[1.0] * 3), 2, CPU)


def test_optimizers_follow_the_spec() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = build_optimizer(OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True), params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] is True
    adam = build_optimizer(OptimizerSpec(name="adam", lr=0.1, betas=(0.8, 0.9)), params)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["betas"] == (0.8, 0.9)
    adamw = build_optimizer(OptimizerSpec(name="adamw", lr=0.1, weight_decay=0.05), params)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["weight_decay"] == 0.05


def test_devices_and_resources() -> None:
    assert resolve_device("cpu") == CPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
    threads = torch.get_num_threads()
    try:
        apply_resources(ResourcesSpec(threads=1, memory_fraction=0.5), CPU)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_simulated_delay_slows_every_micro_batch_and_counts_as_compute() -> None:
    engine, _ = make_engine(OptimizerSpec(name="sgd", lr=0.1))
    engine.simulated_delay_s = 0.05
    x, y = batch(4, seed=3)
    trained = engine.accumulate(x, y)
    evaluated = engine.evaluate(engine.snapshot(), x, y)
    assert trained.compute_s >= 0.05 and evaluated.compute_s >= 0.05
    assert trained.samples == evaluated.samples == 4
    with pytest.raises(ValueError, match="simulated_delay_s"):
        Engine(engine.model, CPU, bf16=False, normalizer=engine.normalize, simulated_delay_s=-1)
