"""Prometheus metrics of the trainer and the GPU's state (pynvml) when there is a GPU.

Metrics are process-wide (one job at a time per process), so no job label: labels stay
bounded. Without a GPU or NVML, :func:`open_gpu_probe` returns None and no GPU metric or
heartbeat field is produced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from conveyor.platform.telemetry import counter, gauge, histogram

logger = logging.getLogger(__name__)

SERVICE = "trainer"


class TrainerMetrics:
    """The collectors (shared by every instance: the registry is process-wide)."""

    def __init__(self) -> None:
        self.batches = counter(
            SERVICE,
            "batches_total",
            "Batches finished, by split and outcome.",
            ["split", "outcome"],
        )
        self.samples = counter(SERVICE, "samples_total", "Samples of applied contributions.")
        self.contributions = counter(
            SERVICE,
            "contributions_total",
            "Contributions by outcome (applied, rejected, empty).",
            ["outcome"],
        )
        self.rejected = counter(
            SERVICE, "rejected_records_total", "Records on a batches topic that were not batches."
        )
        self.grad_bytes = counter(
            SERVICE, "grad_bytes_total", "Gradient payload bytes sent (all slices)."
        )
        self.data_wait = histogram(
            SERVICE, "data_wait_seconds", "Exposed data wait of the step loop per batch."
        )
        self.compute = histogram(
            SERVICE, "compute_seconds", "Forward/backward (or eval) time per batch."
        )
        self.grad_send = histogram(
            SERVICE,
            "grad_send_seconds",
            "From the first gradient slice sent to the contribution acknowledged, per step.",
        )
        self.param_wait = histogram(
            SERVICE,
            "param_wait_seconds",
            "From the contribution sent to the next parameter version loaded, per step.",
        )
        self.overlapped_steps = counter(
            SERVICE,
            "overlapped_steps_total",
            "Local mode's inner steps run while the last window's delta travelled.",
        )
        self.version = gauge(SERVICE, "param_version", "Parameter version loaded last.")
        self.data_wait_ratio = gauge(
            SERVICE, "data_wait_ratio", "Recent exposed data wait / (wait + the rest of the step)."
        )
        self.samples_per_second = gauge(SERVICE, "samples_per_second", "Recent throughput.")
        self.held_batches = gauge(SERVICE, "held_batches", "Batches waiting for their epoch.")
        self.ready_batches = gauge(SERVICE, "ready_batches", "Batches prefetched on the device.")
        self.gpu = {
            name: gauge(SERVICE, name, doc)
            for name, doc in (
                ("gpu_utilization_ratio", "GPU busy share over the last sample period (0..1)."),
                ("gpu_memory_used_bytes", "GPU memory in use (all processes)."),
                ("gpu_memory_total_bytes", "GPU memory in total."),
                ("gpu_power_watts", "GPU power draw."),
                ("gpu_temperature_celsius", "GPU core temperature."),
            )
        }

    def set_gpu(self, reading: dict[str, float]) -> None:
        for name, value in reading.items():
            collector = self.gpu.get(name)
            if collector is not None:
                collector.set(value)


class GpuProbe:
    """Reads utilisation, memory, power and temperature of one GPU through NVML."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    def read(self) -> dict[str, float]:
        """Current readings (metric names -> values); fields NVML cannot give are left out."""
        nvml, handle = self._nvml, self._handle
        reading: dict[str, float] = {}
        readers: dict[str, Callable[[], float]] = {
            "gpu_utilization_ratio": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,
            "gpu_memory_used_bytes": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used,
            "gpu_memory_total_bytes": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total,
            "gpu_power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "gpu_temperature_celsius": lambda: nvml.nvmlDeviceGetTemperature(
                handle, nvml.NVML_TEMPERATURE_GPU
            ),
        }
        for name, read in readers.items():
            try:
                reading[name] = float(read())
            except nvml.NVMLError:
                continue  # not supported on this GPU (power on some boards, for one)
        return reading


def open_gpu_probe(device: torch.device) -> GpuProbe | None:
    """A probe for ``device``, or None on a CPU device or where NVML is unavailable."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return GpuProbe(pynvml, _nvml_handle(pynvml, index))
    except Exception as exc:  # ImportError, NVMLError: no probe, no GPU fields
        logger.info("GPU state unavailable (%s); heartbeats carry no GPU fields", exc)
        return None


def _nvml_handle(nvml: Any, index: int) -> Any:
    # NVML numbers GPUs physically while torch's index follows CUDA_VISIBLE_DEVICES: match by
    # UUID when torch knows it, else assume the two orders agree.
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except nvml.NVMLError:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(index)
