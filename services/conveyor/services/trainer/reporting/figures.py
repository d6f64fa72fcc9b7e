"""One trainer's figures in one job, in one object: :class:`TrainerFigures` counts what the step
loop reports (contributions, batches, bytes, loss), accounts where its time goes, keeps its
batches' stage latencies, feeds the process's Prometheus metrics, and produces the data of
progress events and the info of heartbeats (what the coordinator allocates by).

The job's authoritative figures (applied batches, steps, epoch results) come from the
coordinator; these are this process's share, from the moment it joined.

All durations are seconds. ``data_wait_ratio = wait / (wait + busy)`` where *wait* is the time
the step loop spent waiting for its next ready batch (what prefetch did not hide) and *busy*
the time it spent on everything else of a step: compute (forward/backward, gradient encoding,
loading parameters, evaluation) and the gradient plane (sending slices, waiting for the next
parameter version). Copies to the device run beside it and are not counted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.platform.messages import TrainerState
from conveyor.services.trainer.compute.engine import MicroResult
from conveyor.services.trainer.data.prefetch import ReadyBatch
from conveyor.services.trainer.reporting.metrics import TrainerMetrics, open_gpu_probe
from conveyor.training.jobview import percentile

STAGES = ("read", "augment", "queue", "h2d", "compute")
"""Stage names in progress events, in pipeline order."""

_STAGE_SPANS: dict[str, tuple[str, str]] = {
    "read": ("read_start", "read_end"),
    "augment": ("read_end", "augment_end"),
    "queue": ("sent", "received"),
    "h2d": ("received", "h2d_end"),
}
"""Stage -> (start stamp, end stamp) in Batch.timestamps; compute is measured directly."""

STEP_PARTS = ("data_wait", "h2d", "compute", "grad_send", "param_wait")
"""The parts of a step's time in heartbeats and progress events (``step_time_s``)."""


class TrainerFigures:
    """The figures of one trainer in one job (see the module docstring). Each method accounts
    one thing the step loop did, in the counters here and in the Prometheus metrics."""

    def __init__(
        self,
        metrics: TrainerMetrics,
        device: torch.device,
        *,
        rate_window_s: float,
        stage_window: int,
    ) -> None:
        self.metrics = metrics
        self.device = device
        self.meter = WaitMeter(window_s=rate_window_s)
        self.stages = StageLatencies(window=stage_window)
        self.step_times = StepTimes(window=stage_window)
        self._gpu = open_gpu_probe(device)
        self.samples_trained = 0
        """Samples of this trainer's applied contributions."""
        self.batches_trained = 0
        """Train batches of this trainer's applied contributions."""
        self.eval_batches = 0
        """Eval batches this trainer evaluated and reported."""
        self.duplicates = 0
        """Deliveries dropped because the batch was done already or is in memory here."""
        self.contributions = 0
        """Non-empty contributions sent."""
        self.empty_contributions = 0
        """Empty contributions sent (sync mode, no batch ready in time)."""
        self.overlapped_steps = 0
        """Local mode's inner steps run while the last window's delta travelled."""
        self.rejected = 0
        """Contributions rejected (their batches were recomputed)."""
        self.grad_bytes = 0
        """Gradient payload bytes sent (all slices of all contributions)."""
        self.loss: float | None = None
        """Mean per-sample loss of the latest applied contribution."""

    # -- batches in -----------------------------------------------------------------------

    def data_waited(self, wait_s: float) -> None:
        """The step loop waited ``wait_s`` for a ready batch (exposed data wait)."""
        self.meter.add(wait_s=wait_s)
        self.metrics.data_wait.observe(wait_s)

    def batches_waiting(self, *, held: int, ready: int) -> None:
        """Batches held for their epoch and prefetched on the device, now."""
        self.metrics.held_batches.set(held)
        self.metrics.ready_batches.set(ready)

    def record_skipped(self) -> None:
        """A record on the batches topic was not a batch of the job."""
        self.metrics.rejected.inc()

    def duplicate_dropped(self) -> None:
        """A delivery was dropped: its batch is done already or in memory here."""
        self.duplicates += 1

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

    def eval_sent(self) -> None:
        """An eval batch's result was sent."""
        self.eval_batches += 1

    # -- steps ----------------------------------------------------------------------------

    def params_waited(self, wait_s: float) -> None:
        """The step loop waited ``wait_s`` until a step could start on new parameters."""
        self.meter.add(sync_s=wait_s)

    def params_loaded(self, version: int, load_s: float) -> None:
        """Parameter version ``version`` was loaded into the model in ``load_s``."""
        self.meter.add(compute_s=load_s)
        self.metrics.version.set(version)

    def steps_overlapped(self, steps: int) -> None:
        """Local mode: ``steps`` inner steps ran while the last window's delta travelled."""
        self.overlapped_steps += steps
        self.metrics.overlapped_steps.inc(steps)

    def empty_sent(self) -> None:
        """An empty contribution was sent (sync mode: no batch in time)."""
        self.empty_contributions += 1

    def contribution_sent(
        self,
        *,
        grad_bytes: int,
        data_wait_s: float,
        h2d_s: float,
        batches_compute_s: float,
        encode_s: float,
        grad_send_s: float,
        param_wait_s: float,
    ) -> None:
        """A non-empty contribution was sent: its gradient's bytes and its step's time
        (``batches_compute_s`` of the micro-batches is accounted by :meth:`batch_done`)."""
        self.contributions += 1
        self.grad_bytes += grad_bytes
        self.meter.add(compute_s=encode_s, sync_s=grad_send_s)
        self.step_times.add(
            data_wait=data_wait_s,
            h2d=h2d_s,
            compute=batches_compute_s + encode_s,
            grad_send=grad_send_s,
            param_wait=param_wait_s,
        )
        self.metrics.grad_bytes.inc(grad_bytes)
        self.metrics.grad_send.observe(grad_send_s)
        self.metrics.param_wait.observe(param_wait_s)

    def contribution_applied(self, *, samples: int, batches: int, loss_sum: float) -> None:
        """One of this trainer's contributions was applied (``batches == 0``: an empty one)."""
        self.samples_trained += samples
        self.batches_trained += batches
        if samples:
            self.loss = loss_sum / samples
        self.metrics.samples.inc(samples)
        self.metrics.contributions.labels(outcome="applied" if batches else "empty").inc()

    def contribution_rejected(self) -> None:
        """One of this trainer's contributions was rejected."""
        self.rejected += 1
        self.metrics.contributions.labels(outcome="rejected").inc()

    # -- reports --------------------------------------------------------------------------

    def progress(self, *, epoch: int, version: int | None) -> dict[str, Any]:
        """The fields of a :class:`~conveyor.platform.messages.TrainerProgress` but its ids
        (the reporter adds them): this trainer's own figures (the coordinator reports the
        job's; no ``consumed_batches``)."""
        rates = self.meter.recent()
        return {
            "epoch": epoch,
            "step": version or 0,
            "samples_trained": self.samples_trained,
            "batches_trained": self.batches_trained,
            "eval_batches": self.eval_batches,
            "duplicates": self.duplicates,
            "contributions": self.contributions,
            "empty_contributions": self.empty_contributions,
            "rejected_contributions": self.rejected,
            "grad_bytes": self.grad_bytes,
            "loss": self.loss,
            "samples_per_second": rates.samples_per_second,
            "data_wait_ratio": rates.data_wait_ratio,
            "data_wait_ratio_job": self.meter.ratio,
            "stage_latency_s": self.stages.percentile(50),
            "stage_latency_p95_s": self.stages.percentile(95),
            "step_time_s": self.step_times.means(),
        }

    def heartbeat(
        self,
        *,
        epoch: int,
        version: int | None,
        queues: dict[str, int],
        batches_partitions: list[int],
    ) -> TrainerState:
        """The state a heartbeat carries: ``samples_per_second`` is the compute throughput
        (what the allocation is proportional to), then the wall throughput, the step-time
        breakdown, ``queues`` (outstanding, ready, queued, held, in flight), the partitions
        the routing weights, and GPU state when there is a GPU."""
        rates = self.meter.recent()
        gpu: dict[str, float] = {}
        if self._gpu is not None:
            reading = self._gpu.read()
            self.metrics.set_gpu(reading)
            gpu = {**reading, "torch_allocated_bytes": torch.cuda.memory_allocated(self.device)}
        if rates.data_wait_ratio is not None:
            self.metrics.data_wait_ratio.set(rates.data_wait_ratio)
        self.metrics.samples_per_second.set(rates.samples_per_second)
        return TrainerState(
            device=str(self.device),
            version=version,
            epoch=epoch,
            samples_per_second=rates.compute_samples_per_second,
            throughput_samples_per_second=rates.samples_per_second,
            data_wait_ratio=rates.data_wait_ratio,
            step_time_s=self.step_times.means(),
            batches_partitions=batches_partitions,
            gpu=gpu,
            **queues,
        )


def ratio(wait_s: float, compute_s: float) -> float | None:
    """wait / (wait + compute), or None before anything was measured."""
    total = wait_s + compute_s
    return wait_s / total if total > 0 else None


@dataclass(frozen=True, slots=True)
class Rates:
    """Recent figures of a :class:`WaitMeter`."""

    data_wait_ratio: float | None
    """wait / (wait + busy); None before anything was measured."""
    samples_per_second: float
    """Samples over the time of the step loop (wall throughput)."""
    compute_samples_per_second: float
    """Samples over compute time only: what this trainer could do without waits (the
    throughput the coordinator's allocation is proportional to)."""


class WaitMeter:
    """Exposed data wait, compute and gradient-plane time, over the job and a recent window.

    The window holds ``(at, wait_s, compute_s, sync_s, samples)`` entries younger than
    ``window_s``; ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, *, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._now = clock
        self._recent: deque[tuple[float, float, float, float, int]] = deque()
        self.wait_s = 0.0
        """Exposed data wait over the job so far."""
        self.compute_s = 0.0
        """Compute time over the job so far."""
        self.sync_s = 0.0
        """Gradient-plane time (sending, waiting for parameters) over the job so far."""
        self.samples = 0
        """Samples trained over the job so far."""

    def add(
        self, *, wait_s: float = 0.0, compute_s: float = 0.0, sync_s: float = 0.0, samples: int = 0
    ) -> None:
        """Account one wait and/or one piece of work (negative values are rejected)."""
        if wait_s < 0 or compute_s < 0 or sync_s < 0 or samples < 0:
            raise ValueError("durations and samples must be >= 0")
        self.wait_s += wait_s
        self.compute_s += compute_s
        self.sync_s += sync_s
        self.samples += samples
        now = self._now()
        self._recent.append((now, wait_s, compute_s, sync_s, samples))
        self._expire(now)

    @property
    def ratio(self) -> float | None:
        """Job-wide data-wait ratio."""
        return ratio(self.wait_s, self.compute_s + self.sync_s)

    def recent(self) -> Rates:
        """The figures over the recent window."""
        now = self._now()
        self._expire(now)
        wait = sum(entry[1] for entry in self._recent)
        compute = sum(entry[2] for entry in self._recent)
        sync = sum(entry[3] for entry in self._recent)
        samples = sum(entry[4] for entry in self._recent)
        return Rates(
            data_wait_ratio=ratio(wait, compute + sync),
            samples_per_second=samples / (wait + compute + sync) if samples else 0.0,
            compute_samples_per_second=samples / compute if samples and compute > 0 else 0.0,
        )

    def _expire(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self._window_s:
            self._recent.popleft()


class StepTimes:
    """Mean seconds per step of each part of :data:`STEP_PARTS` over the last ``window``
    steps (h2d overlaps the others: it runs in the copy thread)."""

    def __init__(self, *, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._steps: deque[dict[str, float]] = deque(maxlen=window)

    def add(self, **parts: float) -> None:
        """One step's parts (missing ones count 0; unknown names raise ValueError)."""
        unknown = set(parts) - set(STEP_PARTS)
        if unknown:
            raise ValueError(f"unknown step parts {sorted(unknown)}")
        self._steps.append({name: parts.get(name, 0.0) for name in STEP_PARTS})

    def means(self) -> dict[str, float]:
        """{part: mean seconds per step}; zeros before the first step."""
        count = len(self._steps)
        return {
            name: sum(step[name] for step in self._steps) / count if count else 0.0
            for name in STEP_PARTS
        }


class StageLatencies:
    """Per-stage latencies of the most recent ``window`` batches."""

    def __init__(self, *, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples: dict[str, deque[float]] = {stage: deque(maxlen=window) for stage in STAGES}

    def add_batch(self, timestamps: Mapping[str, float], compute_s: float | None) -> None:
        """Record one batch's stages from its stamps (stages with a missing stamp are skipped;
        clock skew between machines can make a stage negative: clamped to 0)."""
        for stage, (start, end) in _STAGE_SPANS.items():
            if start in timestamps and end in timestamps:
                self._samples[stage].append(max(0.0, timestamps[end] - timestamps[start]))
        if compute_s is not None:
            self._samples["compute"].append(compute_s)

    def percentile(self, q: float) -> dict[str, float]:
        """{stage: q-th percentile} of the stages with at least one sample."""
        return {
            stage: percentile(sorted(values), q)
            for stage, values in self._samples.items()
            if values
        }
