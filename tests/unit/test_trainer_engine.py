"""The trainer's compute: summed-loss gradients, parameter versions in, encoded slices out,
evaluation on end-of-epoch snapshots, normalisation, devices, the simulated slow device."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from conveyor.services.trainer.compute.engine import (
    Engine,
    Normalizer,
    apply_resources,
    resolve_device,
)
from conveyor.services.trainer.plane.gradients import SliceEncoder
from conveyor.training.compression import decode_slice
from conveyor.training.jobspec import CompressionSpec, NormalizeSpec, ResourcesSpec
from conveyor.training.models import build_model
from conveyor.training.slicing import ParamLayout

CPU = torch.device("cpu")


def make_engine(
    compression: CompressionSpec | None = None, *, slices: int = 3, delay_s: float = 0.0
) -> Engine:
    torch.manual_seed(0)
    model = build_model(
        "small_cnn", in_channels=1, num_classes=10, image_size=(8, 8), channels=[8, 16]
    )
    layout = ParamLayout.from_model(model)
    encoder = SliceEncoder(compression or CompressionSpec(), layout.slice_bounds(slices))
    return Engine(
        model,
        CPU,
        bf16=False,
        normalizer=Normalizer(None, 1, CPU),
        layout=layout,
        encoder=encoder,
        simulated_delay_s=delay_s,
    )


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return x, y


def dense(engine: Engine) -> torch.Tensor:
    """The encoded gradient of the engine's accumulated micro-batches, decoded and joined."""
    encoded, _ = engine.gradient(1)
    return torch.cat(
        [decode_slice(s.encoding, s.values, s.indices, s.numel) for s in encoded.slices]
    )


def test_micro_batches_sum_to_the_gradient_of_the_whole_batch_summed_loss() -> None:
    x, y = batch(12, seed=1)
    parts, whole = make_engine(), make_engine()
    loss_parts = sum(parts.accumulate(x[a:b], y[a:b]).loss_sum for a, b in [(0, 5), (5, 12)])
    loss_whole = whole.accumulate(x, y).loss_sum
    assert loss_parts == pytest.approx(loss_whole, rel=1e-5)
    whole_grad = dense(whole)
    torch.testing.assert_close(dense(parts), whole_grad, rtol=1e-4, atol=1e-5)
    # The gradient is the summed loss's: 12 x the mean loss's.
    mean_model = make_engine().model
    torch.nn.functional.cross_entropy(mean_model(x.float() / 255.0), y).backward()  # type: ignore[no-untyped-call]
    mean_grad = ParamLayout.from_model(mean_model).flatten_grads(mean_model)
    torch.testing.assert_close(whole_grad, 12 * mean_grad, rtol=1e-4, atol=1e-5)


def test_dense_slices_are_the_flat_gradient_cut_at_the_layout_bounds() -> None:
    engine = make_engine(slices=4)
    engine.accumulate(*batch(8, seed=2))
    expected = engine.layout.flatten_grads(engine.model)
    encoded, _ = engine.gradient(8)
    bounds = engine.layout.slice_bounds(4)
    assert [s.numel for s in encoded.slices] == [stop - start for start, stop in bounds]
    assert all(s.encoding == "dense" and s.values.dtype == torch.float32 for s in encoded.slices)
    assert torch.equal(torch.cat([s.values for s in encoded.slices]), expected)
    assert encoded.nbytes == 4 * expected.numel() and encoded.feedback_inputs is None
    assert all(p.grad is None for p in engine.model.parameters())  # cleared for the next step


def test_fp16_slices_halve_the_bytes_and_decode_close_to_the_gradient() -> None:
    engine = make_engine(CompressionSpec(kind="fp16"))
    engine.accumulate(*batch(8, seed=3))
    expected = engine.layout.flatten_grads(engine.model)
    encoded, _ = engine.gradient(8)
    assert all(s.values.dtype == torch.float16 for s in encoded.slices)
    assert encoded.nbytes == 2 * expected.numel()
    joined = torch.cat([decode_slice("fp16", s.values, s.indices, s.numel) for s in encoded.slices])
    torch.testing.assert_close(joined, expected, rtol=1e-3, atol=1e-4)


def test_load_sets_a_version_and_snapshot_keeps_it_while_the_model_moves_on() -> None:
    engine = make_engine()
    layout = engine.layout
    version = torch.linspace(-1, 1, layout.numel)  # [N]
    engine.accumulate(*batch(4, seed=4))  # a gradient from before the load is discarded
    engine.load(version)
    assert torch.equal(layout.flatten_params(engine.model), version)
    assert all(p.grad is None for p in engine.model.parameters())
    snapshot = engine.snapshot(version)
    engine.load(torch.zeros(layout.numel))
    assert torch.equal(layout.flatten_params(snapshot), version)
    x, y = batch(16, seed=5)
    result = engine.evaluate(snapshot, x, y)
    logits = snapshot(x.float() / 255.0)
    assert result.samples == 16 and result.correct == int((logits.argmax(1) == y).sum())
    assert all(p.grad is None and not p.requires_grad for p in snapshot.parameters())


def test_bf16_autocast_keeps_fp32_gradients() -> None:
    engine = make_engine()
    engine.bf16 = True
    result = engine.accumulate(*batch(4, seed=6))
    encoded, _ = engine.gradient(8)
    assert result.samples == 4 and result.loss_sum > 0
    assert all(s.values.dtype == torch.float32 for s in encoded.slices)


def test_the_simulated_delay_is_slept_per_micro_batch_and_counted_as_compute() -> None:
    engine = make_engine(delay_s=0.05)
    x, y = batch(4, seed=7)
    started = time.perf_counter()
    results = [engine.accumulate(x, y), engine.accumulate(x, y)]
    assert time.perf_counter() - started >= 0.1
    assert all(r.compute_s >= 0.05 for r in results)
    with pytest.raises(ValueError, match="simulated_delay_s"):
        make_engine(delay_s=-1.0)


def test_normalizer_scales_then_standardises_per_channel() -> None:
    normalize = Normalizer(NormalizeSpec(mean=[0.5, 0.0], std=[0.5, 2.0]), 2, CPU)
    x = torch.tensor([[[[255]], [[255]]], [[[0]], [[0]]]], dtype=torch.uint8)  # [2,2,1,1]
    out = normalize(x)
    assert out.dtype == torch.float32
    assert out.flatten().tolist() == [1.0, 0.5, -1.0, 0.0]
    with pytest.raises(ValueError, match="3 values for 2"):
        Normalizer(NormalizeSpec(mean=[0.1] * 3, std=[1.0] * 3), 2, CPU)


def test_devices_and_resources(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_device("cpu") == CPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO):
            apply_resources(ResourcesSpec(threads=1, memory_fraction=0.5), CPU)
        assert torch.get_num_threads() == 1
        assert "memory_fraction caps GPU memory: not applied on cpu" in caplog.text
    finally:
        torch.set_num_threads(threads)


def test_token_batches_score_the_mean_next_token_loss_per_sequence() -> None:
    torch.manual_seed(0)
    gpt = build_model("gpt", in_channels=1, num_classes=32, image_size=(1, 8),
                      n_layer=1, n_head=2, n_embd=8)  # fmt: skip
    layout = ParamLayout.from_model(gpt)
    engine = Engine(gpt, CPU, bf16=False, normalizer=Normalizer(None, 1, CPU), layout=layout,
                    encoder=SliceEncoder(CompressionSpec(), layout.slice_bounds(2)))  # fmt: skip
    tokens = torch.randint(0, 32, (3, 9))
    x, y = tokens[:, :-1].to(torch.int32), tokens[:, 1:]  # [3,8] inputs, [3,8] targets
    result = engine.accumulate(x, y)
    per_token = torch.nn.functional.cross_entropy(gpt(x).flatten(0, 1), y.flatten()).item()
    assert result.loss_sum == pytest.approx(3 * per_token, rel=1e-5)  # 3 sequences' means
    assert result.samples == 3 and result.correct == 0  # no accuracy for next tokens
    evaluated = engine.evaluate(engine.snapshot(layout.flatten_params(gpt)), x, y)
    assert evaluated.loss_sum == pytest.approx(result.loss_sum, rel=1e-5)


def test_a_deterministic_job_turns_deterministic_algorithms_on_and_the_next_job_off() -> None:
    try:
        apply_resources(ResourcesSpec(), CPU, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        apply_resources(ResourcesSpec(), CPU)
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_seeded_micro_batch_draws_the_same_dropout_whatever_ran_before() -> None:
    """Deterministic mode seeds torch per micro-batch: a model's dropout then depends on the
    seed alone, not on what the process drew before (a resumed trainer drew other things)."""

    def gradient(seed: int, draws_before: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.Dropout(0.5),
            torch.nn.Linear(32, 10),
        )  # fmt: skip
        layout = ParamLayout.from_model(model)
        engine = Engine(model, CPU, bf16=False, normalizer=Normalizer(None, 1, CPU),
                        layout=layout, encoder=SliceEncoder(CompressionSpec(),
                                                            layout.slice_bounds(1)))  # fmt: skip
        torch.rand(draws_before)
        engine.accumulate(*batch(8, seed=9), seed)
        return dense(engine)

    assert torch.equal(gradient(seed=5, draws_before=0), gradient(seed=5, draws_before=7))
    assert not torch.equal(gradient(seed=5, draws_before=0), gradient(seed=6, draws_before=0))
