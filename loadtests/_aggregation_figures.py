"""The pure helpers of bench_aggregation.py (tested by tests/unit/test_bench_aggregation.py):
step windows, bytes per contribution and per step, ratios, medians, accuracy deltas, the
top-k reduction and the JSON line printed last."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# -- pure helpers (tests/unit/test_bench_aggregation.py) ----------------------------------------


@dataclass(frozen=True, slots=True)
class StepWindow:
    """Optimizer steps over the part of a run after its warm-up."""

    steps: int
    seconds: float
    median_interval_s: float | None
    """Median time between two consecutive steps of the window."""

    @property
    def per_step_s(self) -> float:
        return self.seconds / self.steps if self.steps else math.nan


def step_window(closes: Sequence[tuple[int, float]], warmup_steps: int) -> StepWindow | None:
    """``closes``: (version, closed_at) of the steps that applied samples (a step of only empty
    contributions changes nothing and is left out by the caller). The window runs from the
    close of the last warm-up step (version ``warmup_steps``, else the first one after it) to
    the last close; its steps are the closes after its start. None when it holds no step."""
    ordered = sorted(closes)
    start = next((i for i, c in enumerate(ordered) if c[0] >= warmup_steps), None)
    if start is None or start == len(ordered) - 1:
        return None
    window = ordered[start:]
    intervals = [b[1] - a[1] for a, b in itertools.pairwise(window)]
    return StepWindow(
        steps=len(window) - 1,
        seconds=window[-1][1] - window[0][1],
        median_interval_s=statistics.median(intervals),
    )


def default_warmup(total_steps: int) -> int:
    """Warm-up steps left out of a Conveyor job's window: 10%, at least 2."""
    return max(2, total_steps // 10)


def mean_contribution_bytes(contributions: Iterable[tuple[int, int]]) -> float | None:
    """Mean ``grad_bytes`` of the contributions with samples, from (grad_bytes, num_samples)
    pairs (an empty contribution sends no slice). None when there is none."""
    sizes = [nbytes for nbytes, samples in contributions if samples > 0]
    return statistics.fmean(sizes) if sizes else None


def step_bytes(closes: Iterable[Sequence[str]], grad_bytes: Mapping[str, int]) -> list[int]:
    """Gradient bytes of each applied step: the sum over the contribution ids it applied."""
    return [sum(grad_bytes.get(cid, 0) for cid in ids) for ids in closes]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None when none is)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def accuracy_deltas(dense: Sequence[float | None], topk: Sequence[float | None]) -> list[float]:
    """Per repeat, eval-accuracy points lost by top-k: ``100 * (dense - topk)``."""
    return [
        100.0 * (d - t) for d, t in zip(dense, topk, strict=True) if d is not None and t is not None
    ]


def max_topk_reduction(ratio_kept: float, value_bytes: int = 2, index_bytes: int = 4) -> float:
    """The most top-k at ``ratio_kept`` can save over fp32: dense 4 bytes per element vs
    ``ratio_kept * (value + index)`` bytes (before rounding k up)."""
    return 4.0 / (ratio_kept * (value_bytes + index_bytes))


def result_json(
    *,
    extras: Mapping[str, float | None],
    step_vs_ddp: float | None,
    bytes_reduction: float | None,
    accuracy_delta: float | None,
) -> dict[str, float | None]:
    """The final JSON object: ``extras`` first, the three headline figures last (rounded)."""

    def rounded(value: float | None) -> float | None:
        return None if value is None or math.isnan(value) else round(value, 4)

    result = {key: rounded(value) for key, value in extras.items()}
    for key in ("step_vs_ddp_gloo", "topk_bytes_reduction", "topk_accuracy_delta"):
        result.pop(key, None)
    result["step_vs_ddp_gloo"] = rounded(step_vs_ddp)
    result["topk_bytes_reduction"] = rounded(bytes_reduction)
    result["topk_accuracy_delta"] = rounded(accuracy_delta)
    return result
