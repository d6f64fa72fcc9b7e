"""Prometheus metrics of the aggregator (``conveyor_aggregator_...``); no per-job labels."""

from __future__ import annotations

from conveyor.platform.telemetry import LATENCY_BUCKETS_S, counter, gauge, histogram

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 1000)
"""Histogram buckets of applied staleness (versions)."""

REJECTION_REASONS = (
    "stale",
    "duplicate batches",
    "invalid batch ids",
    "invalid sample ids",
    "over the global batch",
    "training finished",
)


def rejection_label(reason: str) -> str:
    """The bounded label value of a rejection reason (its text may carry versions)."""
    return next((known for known in REJECTION_REASONS if reason.startswith(known)), "other")


class AggregatorMetrics:
    """The collectors, created once per process (tests build several services: shared)."""

    def __init__(self) -> None:
        self.steps = counter(
            "aggregator", "steps_total", "Versions applied and published by this process's slices."
        )
        self.step_seconds = histogram(
            "aggregator",
            "step_seconds",
            "Per slice and version: from holding every input of the step to its ParamSlice "
            "acknowledged by the broker (decode, optimizer step, publish).",
            buckets=LATENCY_BUCKETS_S,
        )
        self.grad_bytes = counter(
            "aggregator", "grad_bytes_total", "Gradient payload bytes received (GradSlices)."
        )
        self.staleness = histogram(
            "aggregator",
            "staleness",
            "Staleness (current - base version) of every contribution this coordinator applied.",
            buckets=STALENESS_BUCKETS,
        )
        self.rejections = counter(
            "aggregator",
            "rejections_total",
            "Contributions this coordinator rejected, by reason.",
            ["reason"],
        )
        self.held_slices = gauge(
            "aggregator", "held_slices", "Gradient slices buffered, waiting for their StepClose."
        )
        self.served_jobs = gauge(
            "aggregator", "served_jobs", "Jobs whose gradient plane this process serves."
        )
        self.control_rest_seconds = counter(
            "aggregator",
            "control_rest_seconds_total",
            "Time the control reader paused after a StepClose while the step's members "
            "computed (resting.py), instead of sending empty fetches.",
        )
        self.checkpoint_write_seconds = histogram(
            "aggregator",
            "checkpoint_write_seconds",
            "Writing one slice's state of a checkpoint to the object store.",
            buckets=LATENCY_BUCKETS_S,
        )
