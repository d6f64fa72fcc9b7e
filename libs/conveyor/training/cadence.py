"""How often a job's progress goes to the jobs topic (trainers' and the coordinator's events).

The jobs topic is the stack's event log: every service replays it at start, and the embedded
broker keeps all of it in memory. At a fixed half second a day-long job of four trainers wrote
~860k progress events (~490 MB) to it. A user watches a job's first seconds closely and an
hours-old job's figures move slowly, so the interval grows with the job's age: a
``PROGRESS_STRETCH``-th of it, within the least and the most (at the defaults, 0.5 s and 5 s:
one every 0.5 s for the first 30 s, ~140 events from there to 5 min, then one per 5 s). The
coordinator's events also carry the batches the job consumed, which the sharder releases shard
tasks by: they come at least every quarter of the flow-control lead's worth of consumption.
"""

from __future__ import annotations

from collections import deque

PROGRESS_STRETCH = 60.0
"""The interval is the job's age divided by this, within its bounds."""


def progress_interval_s(age_s: float, *, least_s: float, most_s: float) -> float:
    """Least seconds between two progress events ``age_s`` seconds into a job: ``least_s``,
    or the age over :data:`PROGRESS_STRETCH` once that is longer, at most ``most_s``."""
    return min(most_s, max(least_s, age_s / PROGRESS_STRETCH))


def coordinator_progress_interval_s(
    age_s: float,
    *,
    least_s: float,
    most_s: float,
    lead_batches: int,
    batches_per_s: float,
) -> float:
    """:func:`progress_interval_s`, but no longer than a quarter of ``lead_batches`` (the
    job's ``flow.max_lead_batches``) takes to consume at ``batches_per_s`` (the recent rate;
    0: unknown, no bound), so the sharder's releases keep ahead of the trainers."""
    interval = progress_interval_s(age_s, least_s=least_s, most_s=most_s)
    if batches_per_s > 0:
        interval = min(interval, max(least_s, lead_batches / (4.0 * batches_per_s)))
    return interval


def check_progress_intervals(least_s: float, most_s: float) -> None:
    """ValueError unless ``most_s >= least_s`` (the services' settings validate with it)."""
    if most_s < least_s:
        raise ValueError(
            f"progress_max_interval_s ({most_s}) must be at least progress_interval_s ({least_s})"
        )


class ConsumptionRate:
    """The job's recent rate of consumption, from the consumed-batches count at each progress
    event: the highest of the last ``window`` intervals that consumed anything. Intervals that
    consumed nothing (a pause, steps without data) are left out, so that consumption resuming
    at full speed is never met by an interval stretched while it paused. Not thread-safe."""

    def __init__(self, window: int = 8) -> None:
        self._rates: deque[float] = deque(maxlen=window)
        self._last: tuple[float, int] | None = None

    def published(self, now: float, consumed_batches: int) -> None:
        """Note a progress event with ``consumed_batches`` at ``now`` (monotonic s)."""
        if self._last is not None:
            at, consumed = self._last
            if now > at and consumed_batches > consumed:
                self._rates.append((consumed_batches - consumed) / (now - at))
        self._last = (now, consumed_batches)

    @property
    def batches_per_s(self) -> float:
        """0 while no interval consumed anything."""
        return max(self._rates, default=0.0)
