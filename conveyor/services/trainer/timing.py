"""Where a trainer's time goes: exposed data wait vs compute, stage latencies, recent rates.

All durations are seconds. ``data_wait_ratio = wait / (wait + compute)`` where *wait* is the
time the step loop spent waiting for its next ready batch (what prefetch did not hide) and
*compute* the time it spent working on batches (copies to the device run beside it and are
not counted).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from conveyor.libs.jobview import percentile

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


class WaitMeter:
    """Exposed data wait and compute time, over the whole job and over a recent window.

    The window holds ``(at, wait_s, compute_s, samples)`` entries younger than ``window_s``;
    ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, *, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._now = clock
        self._recent: deque[tuple[float, float, float, int]] = deque()
        self.wait_s = 0.0
        """Exposed data wait over the job so far."""
        self.compute_s = 0.0
        """Compute time over the job so far."""
        self.samples = 0
        """Samples trained over the job so far."""

    def add(self, *, wait_s: float = 0.0, compute_s: float = 0.0, samples: int = 0) -> None:
        """Account one wait and/or one piece of work (negative values are rejected)."""
        if wait_s < 0 or compute_s < 0 or samples < 0:
            raise ValueError("durations and samples must be >= 0")
        self.wait_s += wait_s
        self.compute_s += compute_s
        self.samples += samples
        now = self._now()
        self._recent.append((now, wait_s, compute_s, samples))
        self._expire(now)

    @property
    def ratio(self) -> float | None:
        """Job-wide data-wait ratio."""
        return ratio(self.wait_s, self.compute_s)

    def recent(self) -> tuple[float | None, float]:
        """(data-wait ratio, samples per second) over the recent window."""
        now = self._now()
        self._expire(now)
        if not self._recent:
            return None, 0.0
        wait = sum(entry[1] for entry in self._recent)
        compute = sum(entry[2] for entry in self._recent)
        samples = sum(entry[3] for entry in self._recent)
        elapsed_s = max(wait + compute, 1e-9)
        return ratio(wait, compute), samples / elapsed_s

    def _expire(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self._window_s:
            self._recent.popleft()


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
