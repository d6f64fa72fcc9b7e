"""The trainer's CUDA path, on a machine with a GPU: copies through pinned memory on a side
stream, compute on the device matching the CPU's, bf16 autocast, and the GPU state (pynvml) in
heartbeats and metrics. Skipped where torch sees no CUDA device (the CI machines); run on a GPU
machine with `pytest tests/unit/test_trainer_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from conveyor.services.trainer.compute.engine import Engine, Normalizer
from conveyor.services.trainer.data.prefetch import DeviceCopier
from conveyor.services.trainer.plane.gradients import SliceEncoder
from conveyor.services.trainer.reporting.figures import TrainerFigures
from conveyor.services.trainer.reporting.metrics import TrainerMetrics, open_gpu_probe
from conveyor.training.compression import decode_slice
from conveyor.training.jobspec import CompressionSpec, NormalizeSpec
from conveyor.training.models import build_model
from conveyor.training.slicing import ParamLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return x, y


def engine(device: torch.device, *, bf16: bool = False) -> Engine:
    torch.manual_seed(0)
    model = build_model("small_cnn", in_channels=3, num_classes=10, image_size=(32, 32))
    model.to(device)
    layout = ParamLayout.from_model(model)
    normalize = NormalizeSpec(mean=[0.5, 0.4, 0.3], std=[0.25, 0.25, 0.25])
    return Engine(
        model,
        device,
        bf16=bf16,
        normalizer=Normalizer(normalize, 3, device),
        layout=layout,
        encoder=SliceEncoder(CompressionSpec(), layout.slice_bounds(2)),
    )


def step_gradient(
    compute: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The encoded, decoded gradient of ``batches`` accumulated on ``compute``'s device."""
    copier = DeviceCopier(compute.device)
    samples = 0
    for x, y in batches:
        x_dev, y_dev = copier(x, y)
        compute.accumulate(x_dev, y_dev)
        samples += int(y.shape[0])
    encoded, _ = compute.gradient(samples)
    return torch.cat(
        [decode_slice(s.encoding, s.values, s.indices, s.numel) for s in encoded.slices]
    )


def test_copies_go_through_pinned_memory_on_a_side_stream() -> None:
    copier = DeviceCopier(CUDA)
    assert copier.asynchronous  # the prefetcher runs it in its copy thread
    x, y = images(64, seed=1)
    stats_before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    x_dev, y_dev = copier(x, y)
    assert (x_dev.device.type, y_dev.device.type) == ("cuda", "cuda")
    assert (x_dev.dtype, y_dev.dtype) == (torch.uint8, torch.int64)
    assert torch.equal(x_dev.cpu(), x) and torch.equal(y_dev.cpu(), y)
    # The copy staged through page-locked host memory (the caching host allocator served it).
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) >= max(stats_before, 1)


def test_a_step_on_the_gpu_matches_the_cpu() -> None:
    batches = [images(32, seed=s) for s in range(3)]
    on_cpu = step_gradient(engine(CPU), batches)
    on_gpu = step_gradient(engine(CUDA), batches)
    assert on_gpu.device == CPU  # slices travel from host memory
    assert on_gpu.shape == on_cpu.shape
    # cuDNN convolutions run in TF32 on Ampere and later by PyTorch's default (10-bit mantissa):
    # compare the whole gradient's relative error, not each element's.
    relative_error = ((on_gpu - on_cpu).norm() / on_cpu.norm()).item()
    assert relative_error < 5e-3, relative_error
    in_bf16 = step_gradient(engine(CUDA, bf16=True), batches)
    cosine = torch.nn.functional.cosine_similarity(in_bf16, on_cpu, dim=0)
    assert cosine > 0.99, cosine


def test_heartbeats_and_metrics_carry_the_gpu_state() -> None:
    probe = open_gpu_probe(CUDA)
    assert probe is not None
    reading = probe.read()
    assert 0.0 <= reading["gpu_utilization_ratio"] <= 1.0
    assert 0 < reading["gpu_memory_used_bytes"] < reading["gpu_memory_total_bytes"]
    assert reading["gpu_temperature_celsius"] > 0
    figures = TrainerFigures(TrainerMetrics(), CUDA, rate_window_s=60.0, stage_window=8)
    queues = {"outstanding": 0, "ready_batches": 0, "queued_batches": 0, "held_batches": 0,
              "in_flight": 0}  # fmt: skip
    state = figures.heartbeat(epoch=0, version=0, queues=queues, batches_partitions=[0])
    assert state.device.startswith("cuda")
    assert state.gpu["gpu_memory_total_bytes"] == reading["gpu_memory_total_bytes"]
    assert "torch_allocated_bytes" in state.gpu
