"""The pure helpers of bench_checkpoint.py (tested by tests/unit/test_bench_checkpoint.py):
the warm-up, throughput windows from the StepCloses, stalls after a checkpointed step, losses,
ratios, medians and the JSON line printed last."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from loadtests._bench_figures import Progress, Window, window_after

# -- pure helpers (tests/unit/test_bench_checkpoint.py) -----------------------------------------


def default_warmup(total_steps: int) -> int:
    """Warm-up steps left out of a job's window: 10%, at least 2."""
    return max(2, total_steps // 10)


def close_window(closes: Sequence[tuple[int, float, int]], warmup_steps: int) -> Window | None:
    """Throughput window of a job from its StepCloses ``(version, closed_at, num_samples)``
    (any order): a step is a close that applied samples; from the close of the last warm-up
    step to the last close (:func:`~loadtests._bench_figures.window_after`). None when the
    window holds no step."""
    points: list[Progress] = []
    steps = samples = 0
    for _, closed_at, num_samples in sorted(closes):
        if num_samples <= 0:
            continue  # only empty contributions: nothing changed
        steps += 1
        samples += num_samples
        points.append(Progress(at_s=closed_at, step=steps, samples=samples))
    return window_after(points, warmup_steps)


def stall_excess(
    steps: Sequence[tuple[int, float]], checkpointed: Iterable[int], after_steps: int
) -> list[float]:
    """Per checkpointed version, what the ``after_steps`` steps after it took beyond as many
    typical steps (seconds; negative: faster). ``steps``: (version, closed_at) of the steps of a
    window (any order); typical = the median time between two of them. Versions not in
    ``steps`` or too close to the end are left out."""
    ordered = sorted(steps)
    if len(ordered) < 2:
        return []
    typical = statistics.median(b[1] - a[1] for a, b in itertools.pairwise(ordered))
    position = {version: i for i, (version, _) in enumerate(ordered)}
    found = []
    for version in checkpointed:
        i = position.get(version)
        if i is not None and i + after_steps < len(ordered):
            found.append(ordered[i + after_steps][1] - ordered[i][1] - after_steps * typical)
    return found


def losses(
    with_checkpoints: Sequence[float | None], without: Sequence[float | None]
) -> list[float]:
    """Per repeat, the share of throughput lost: ``1 - with / without`` (pairs with a missing
    or zero figure are left out)."""
    return [
        1.0 - w / wo
        for w, wo in zip(with_checkpoints, without, strict=True)
        if w is not None and wo
    ]


def ratios(ours: Sequence[float], raw: Sequence[float]) -> list[float]:
    """Per repeat, ours / raw (MB/s; a zero raw figure is left out)."""
    return [o / r for o, r in zip(ours, raw, strict=True) if r > 0]


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None nor NaN (None when none is)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def result_json(headline: Mapping[str, float | None], extras: Mapping[str, float | None]) -> str:
    """The last line: the three headline keys first, then the extras, rounded to 4 places."""

    def rounded(value: float | None) -> float | None:
        return None if value is None or math.isnan(value) else round(value, 4)

    result = {key: rounded(headline.get(key)) for key in
              ("checkpoint_throughput_loss", "save_vs_raw_put", "restore_vs_raw_get")}  # fmt: skip
    result.update({key: rounded(value) for key, value in extras.items() if key not in result})
    return json.dumps(result)
