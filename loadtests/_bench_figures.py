"""Helpers shared by the load tests: throughput and data-wait windows over a job's progress
after its warm-up, and the formatting of figures (MiB, percentages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Progress:
    """Training progress at one moment: cumulative counters since the job started."""

    at_s: float
    """When (seconds, any clock shared by the points of one run)."""
    step: int
    """Optimizer steps applied."""
    samples: int
    """Samples trained (in applied steps)."""


@dataclass(frozen=True, slots=True)
class Window:
    """Throughput over the part of a run after its warm-up steps."""

    samples: int
    seconds: float
    first_step: int
    """Step count at the window's start (>= the warm-up)."""
    last_step: int

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def window_after(points: Sequence[Progress], warmup_steps: int) -> Window | None:
    """Samples and wall time from the first point with ``step >= warmup_steps`` to the first
    point that shows the final sample count. None when fewer than two such points exist."""
    ordered = sorted(points, key=lambda p: p.at_s)
    start = next((p for p in ordered if p.step >= warmup_steps), None)
    if start is None or not ordered:
        return None
    final_samples = max(p.samples for p in ordered)
    end = next(p for p in ordered if p.samples == final_samples)
    if end.at_s <= start.at_s:
        return None
    return Window(
        samples=end.samples - start.samples,
        seconds=end.at_s - start.at_s,
        first_step=start.step,
        last_step=end.step,
    )


@dataclass(frozen=True, slots=True)
class WaitPoint:
    """A trainer's cumulative time accounts at one moment."""

    at_s: float
    step: int
    wait_s: float
    """Exposed data wait so far (time the step loop was blocked on its input)."""
    busy_s: float
    """Wait plus compute so far, as the trainer accounts them (its own step-time figure)."""


@dataclass(frozen=True, slots=True)
class WaitWindow:
    """Exposed data wait over the part of a run after its warm-up steps."""

    wait_s: float
    busy_s: float
    seconds: float
    """Wall time of the window."""

    @property
    def wait_per_wall(self) -> float:
        """Exposed wait / wall time: the share of step time spent waiting for data."""
        return self.wait_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def busy_per_wall(self) -> float:
        """(wait + compute) / wall time: below 1, the step loop spent time in neither (thread
        hand-offs, bookkeeping, checkpoint captures)."""
        return self.busy_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_per_busy(self) -> float:
        """Exposed wait / (wait + compute), the trainer's own definition."""
        return self.wait_s / self.busy_s if self.busy_s > 0 else 0.0


def wait_window_after(points: Sequence[WaitPoint], warmup_steps: int) -> WaitWindow | None:
    """Wait and busy time from the first point with ``step >= warmup_steps`` to the last
    point. None when fewer than two such points exist."""
    ordered = [p for p in sorted(points, key=lambda p: p.at_s) if p.step >= warmup_steps]
    if len(ordered) < 2:
        return None
    start, end = ordered[0], ordered[-1]
    return WaitWindow(
        wait_s=end.wait_s - start.wait_s,
        busy_s=end.busy_s - start.busy_s,
        seconds=end.at_s - start.at_s,
    )


def mib(num_bytes: float | None) -> str:
    """``123.4`` (MiB) or ``-`` for None."""
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.0f}"


def pct(ratio: float | None) -> str:
    """``12.3%`` or ``-`` for None."""
    return "-" if ratio is None else f"{ratio:.1%}"
