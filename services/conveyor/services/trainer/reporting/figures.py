"""One trainer's numbers in one job and how they are reported: counters, time accounting,
stage latencies, the step-time breakdown, GPU state; the data of progress events and the
info of heartbeats (what the coordinator allocates by)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from conveyor.services.trainer.compute.engine import MicroResult
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.data.prefetch import ReadyBatch
from conveyor.services.trainer.reporting.metrics import TrainerMetrics, open_gpu_probe
from conveyor.services.trainer.reporting.tally import TrainerTally
from conveyor.services.trainer.reporting.timing import StageLatencies, StepTimes, WaitMeter


class Figures:
    """The figures of one trainer in one job (see the module docstring)."""

    def __init__(
        self, settings: TrainerSettings, metrics: TrainerMetrics, device: torch.device
    ) -> None:
        self.metrics = metrics
        self.device = device
        self.tally = TrainerTally()
        self.meter = WaitMeter(window_s=settings.rate_window_s)
        self.stages = StageLatencies(window=settings.stage_window)
        self.step_times = StepTimes(window=settings.stage_window)
        self._gpu = open_gpu_probe(device)

    def batch_done(self, item: ReadyBatch, result: MicroResult) -> None:
        """A batch was trained or evaluated: account it and end its span."""
        item.timestamps["compute_end"] = time.time()
        self.stages.add_batch(item.timestamps, result.compute_s)
        train = item.split == "train"
        self.meter.add(compute_s=result.compute_s, samples=result.samples if train else 0)
        self.metrics.compute.observe(result.compute_s)
        self.metrics.batches.labels(split=item.split, outcome="done").inc()
        item.span.end()

    def batches_dropped(self, items: Iterable[ReadyBatch], outcome: str) -> None:
        """Batches left without work of this trainer (done elsewhere, copies, outside)."""
        for item in items:
            if item.span.is_recording():
                item.span.set_attribute("conveyor.outcome", outcome)
                item.span.end()
            self.metrics.batches.labels(split=item.split, outcome=outcome).inc()

    def progress(self, *, epoch: int, version: int | None) -> dict[str, Any]:
        """The data of a ``progress`` event (worker_id is added by the reporter): this
        trainer's own figures (the coordinator reports the job's; no ``consumed_batches``)."""
        rates = self.meter.recent()
        tally = self.tally
        return {
            "epoch": epoch,
            "step": version or 0,
            "samples_trained": tally.samples_trained,
            "batches_trained": tally.batches_trained,
            "eval_batches": tally.eval_batches,
            "duplicates": tally.duplicates,
            "contributions": tally.contributions,
            "empty_contributions": tally.empty_contributions,
            "rejected_contributions": tally.rejected,
            "grad_bytes": tally.grad_bytes,
            "loss": tally.loss,
            "samples_per_second": rates.samples_per_second,
            "data_wait_ratio": rates.data_wait_ratio,
            "data_wait_ratio_job": self.meter.ratio,
            "stage_latency_s": self.stages.percentile(50),
            "stage_latency_p95_s": self.stages.percentile(95),
        }

    def heartbeat(
        self, *, epoch: int, version: int | None, queues: dict[str, int]
    ) -> dict[str, Any]:
        """The ``info`` of a heartbeat: ``samples_per_second`` is the compute throughput
        (what the allocation is proportional to), then the wall throughput, the step-time
        breakdown, ``queues`` as given, and GPU state when there is a GPU."""
        rates = self.meter.recent()
        info: dict[str, Any] = {
            "device": str(self.device),
            "version": version,
            "epoch": epoch,
            "samples_per_second": rates.compute_samples_per_second,
            "throughput_samples_per_second": rates.samples_per_second,
            "data_wait_ratio": rates.data_wait_ratio,
            "step_time_s": self.step_times.means(),
            **queues,
        }
        if self._gpu is not None:
            reading = self._gpu.read()
            self.metrics.set_gpu(reading)
            info["gpu"] = dict(reading)
            info["gpu"]["torch_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        if rates.data_wait_ratio is not None:
            self.metrics.data_wait_ratio.set(rates.data_wait_ratio)
        self.metrics.samples_per_second.set(rates.samples_per_second)
        return info
