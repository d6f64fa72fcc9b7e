"""Where a trainer's time goes: exposed data wait vs the rest of the step, stage latencies,
recent rates, and the per-step breakdown heartbeats carry.

All durations are seconds. ``data_wait_ratio = wait / (wait + busy)`` where *wait* is the time
the step loop spent waiting for its next ready batch (what prefetch did not hide) and *busy*
the time it spent on everything else of a step: compute (forward/backward, gradient encoding,
loading parameters, evaluation) and the gradient plane (sending slices, waiting for the next
parameter version). Copies to the device run beside it and are not counted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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


STEP_PARTS = ("data_wait", "h2d", "compute", "grad_send", "param_wait")
"""The parts of a step's time in heartbeats (``step_time_s``)."""


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
