"""GPU readings through NVML (faked here: no GPU on the test machines) and their absence."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from conveyor.services.trainer.reporting.metrics import GpuProbe, TrainerMetrics, open_gpu_probe


class NVMLError(Exception):
    pass


def unsupported(handle: object) -> float:
    raise NVMLError("not supported")


FAKE_NVML = SimpleNamespace(
    NVMLError=NVMLError,
    NVML_TEMPERATURE_GPU=0,
    nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=87),
    nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=3 * 2**30, total=80 * 2**30),
    nvmlDeviceGetPowerUsage=unsupported,
    nvmlDeviceGetTemperature=lambda handle, sensor: 61,
)


def test_probe_reads_what_nvml_supports_and_feeds_the_gauges() -> None:
    reading = GpuProbe(FAKE_NVML, handle=object()).read()
    assert reading == {
        "gpu_utilization_ratio": 0.87,
        "gpu_memory_used_bytes": 3 * 2**30,
        "gpu_memory_total_bytes": 80 * 2**30,
        "gpu_temperature_celsius": 61.0,
    }  # no power field: this board does not report it
    metrics = TrainerMetrics()
    metrics.set_gpu(reading)
    assert metrics.gpu["gpu_temperature_celsius"]._value.get() == 61.0


def test_no_probe_without_a_gpu() -> None:
    assert open_gpu_probe(torch.device("cpu")) is None
