"""The scaling policy of the preprocessor pool: a pure fold of measurements into decisions.

No I/O and no clock of its own: the service measures (:class:`Signals`, times in seconds from
any one clock) and acts on the :class:`Verdict`. The rules, in order:

1. **Clamp.** A pool outside ``[floor, ceiling]`` is brought inside at once, where
   ``ceiling = min(max_replicas, shards partitions)`` (a preprocessor past the partition count
   would own no partition) and ``floor = min(min_replicas, ceiling)``.
2. **Up fast** when a running job's trainers wait for data more than
   ``target_data_wait_ratio``, shard tasks wait in the preprocessor group (work the pool has
   not taken) *and* the preprocessors are busy (their mean busy ratio at least
   ``saturated_busy_ratio``; without reports, the backlog alone decides): more preprocessors
   would take that work. Preprocessors busy a share ``b`` that leave trainers waiting a share
   ``w`` deliver about ``1 - w`` of what the trainers could use, so the pool goes to
   ``ceil(replicas * b / (1 - w))`` in one step (at least +1, at most ``max_up_factor``
   times, the ceiling, and one preprocessor per waiting task). The next step up waits
   ``up_interval_s``: the trainers' data wait is a recent-window figure and must first show
   the new replicas. Trainers that starve beside idle preprocessors hold the pool: the
   shortage is elsewhere (flow control, the broker, the trainers' fetch).
3. **Down slowly.** When no trainer waits more than ``calm_data_wait_ratio`` and either the
   work is gone (no running job, no waiting task), or every running job has more batches ready
   than ``surplus_batches_per_trainer`` per trainer (beyond what prefetch can hide), or the
   preprocessors are busy less than ``idle_busy_ratio`` (they wait for work most of the
   time), for a whole ``cooldown_s`` since it became so and since the last change: to the
   floor when the work is gone, else one replica fewer, but never down to a size at which
   trainers were seen starving while jobs run (that size is remembered until no job runs).
4. Anything else holds.

The gap between the two data-wait thresholds, the cooldown and the remembered starving size are
the hysteresis: a pool that fed its trainers is not shrunk back into starving them, so the
decisions per job are bounded by the distance between floor and ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the message registry brings torch into the watchdog
    from conveyor.platform.messages import JobSignals


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyConfig:
    """The policy's parameters (the settings' ``CONVEYOR_AUTOSCALER_*``)."""

    min_replicas: int
    """Fewest replicas (>= 0)."""
    max_replicas: int
    """Most replicas (>= min_replicas); the shards topic's partition count also bounds it."""
    target_data_wait_ratio: float = 0.05
    """Scale up while a job's trainers wait for data more than this share of their step time."""
    calm_data_wait_ratio: float = 0.01
    """Scale down only while every job's trainers wait less than this (< the target)."""
    up_interval_s: float = 20.0
    """Least seconds between two steps up: a new replica's start plus the data-wait window."""
    cooldown_s: float = 60.0
    """Seconds the pool must have been in surplus (and unchanged) before each step down."""
    surplus_batches_per_trainer: int = 16
    """Ready batches per trainer of a job beyond which its batches count as piling up."""
    max_up_factor: float = 4.0
    """Largest growth of one step up (replicas times this)."""
    saturated_busy_ratio: float = 0.7
    """Scale up only while the preprocessors' mean busy ratio is at least this."""
    idle_busy_ratio: float = 0.3
    """While jobs run, a pool busy less than this (and trainers calm) is in surplus."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if not 0.0 <= self.calm_data_wait_ratio < self.target_data_wait_ratio < 1.0:
            raise ValueError(
                "need 0 <= calm_data_wait_ratio < target_data_wait_ratio < 1, got "
                f"{self.calm_data_wait_ratio}, {self.target_data_wait_ratio}"
            )
        if self.up_interval_s < 0 or self.cooldown_s < 0:
            raise ValueError("up_interval_s and cooldown_s must be >= 0")
        if self.surplus_batches_per_trainer < 0 or self.max_up_factor <= 1.0:
            raise ValueError("need surplus_batches_per_trainer >= 0 and max_up_factor > 1")
        if not 0.0 <= self.idle_busy_ratio < self.saturated_busy_ratio <= 1.0:
            raise ValueError(
                "need 0 <= idle_busy_ratio < saturated_busy_ratio <= 1, got "
                f"{self.idle_busy_ratio}, {self.saturated_busy_ratio}"
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class Signals:
    """One measurement of the pool and its work."""

    at: float
    """When it was taken (seconds, the caller's clock)."""
    replicas: int
    """Replicas the driver reports."""
    partitions: int
    """Partitions of the shards topic."""
    shards_lag: int
    """Shard tasks released and not committed by the preprocessor group."""
    jobs: Sequence[JobSignals]
    """The running jobs."""
    busy_ratio: float | None = None
    """Mean busy ratio of the preprocessors that reported recently (None: none did)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Verdict:
    """What to do: ``action`` is ``up``, ``down``, ``clamp`` or ``hold``."""

    action: str
    target: int
    """Replicas to have (the current count for ``hold``)."""
    reason: str


class ScalingPolicy:
    """The fold: :meth:`decide` once per measurement, in time order."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._last_change_at: float | None = None
        self._last_up_at: float | None = None
        self._surplus_since: float | None = None
        self._surplus_gone = False
        """Whether the surplus since ``_surplus_since`` is the work being gone."""
        self._starved_at: int | None = None
        """Largest pool size at which trainers starved while jobs ran; forgotten when none run."""

    def decide(self, signals: Signals) -> Verdict:
        """The verdict for ``signals``; updates the fold's memory when the verdict changes the
        pool (the caller is expected to carry it out)."""
        config, now, replicas = self.config, signals.at, signals.replicas
        ceiling = max(0, min(config.max_replicas, signals.partitions))
        floor = min(config.min_replicas, ceiling)
        if not signals.jobs:
            self._starved_at = None
        if not floor <= replicas <= ceiling:
            target = min(max(replicas, floor), ceiling)
            return self._change("clamp", now, target,
                                f"{replicas} replicas outside [{floor}, {ceiling}] "
                                f"(min/max {config.min_replicas}/{config.max_replicas}, "
                                f"{signals.partitions} partitions)")  # fmt: skip
        waits = [job.data_wait_ratio for job in signals.jobs if job.data_wait_ratio is not None]
        worst = max(waits, default=None)
        if worst is not None and worst > config.target_data_wait_ratio and signals.shards_lag:
            busy = signals.busy_ratio
            if busy is None or busy >= config.saturated_busy_ratio:
                return self._starving(signals, worst, ceiling)
            self._surplus_since = None
            return Verdict(action="hold", target=replicas,
                           reason=f"data wait {worst:.1%} but the preprocessors are busy only "
                                  f"{busy:.0%}: more would not feed the trainers")  # fmt: skip
        if self._in_surplus(signals, worst):
            return self._surplus(signals, floor)
        self._surplus_since = None
        return Verdict(action="hold", target=replicas, reason="within the thresholds")

    def _starving(self, signals: Signals, worst: float, ceiling: int) -> Verdict:
        config, now, replicas = self.config, signals.at, signals.replicas
        self._surplus_since = None
        busy = 1.0 if signals.busy_ratio is None else signals.busy_ratio
        why = (f"data wait {worst:.1%} > {config.target_data_wait_ratio:.1%} with "
               f"{signals.shards_lag} shard tasks waiting")  # fmt: skip
        if signals.busy_ratio is not None:
            why += f", preprocessors {busy:.0%} busy"
        # Within up_interval_s of a step up the data wait still describes the smaller pool.
        measured = self._last_up_at is None or now - self._last_up_at >= config.up_interval_s
        if measured:
            self._starved_at = max(self._starved_at or 0, replicas)
        if replicas >= ceiling:
            return Verdict(action="hold", target=replicas, reason=f"{why}; at the ceiling")
        if not measured:
            return Verdict(action="hold", target=replicas,
                           reason=f"{why}; the last step up is not measured yet")  # fmt: skip
        share = max(1.0 - worst, 1.0 / config.max_up_factor)
        target = max(math.ceil(replicas * busy / share), replicas + 1)
        target = min(target, ceiling, replicas + signals.shards_lag)
        self._last_up_at = now
        return self._change("up", now, target, why)

    def _in_surplus(self, signals: Signals, worst: float | None) -> bool:
        if worst is not None and worst >= self.config.calm_data_wait_ratio:
            return False
        if not signals.jobs:
            return signals.shards_lag == 0
        if any(job.data_wait_ratio is None for job in signals.jobs):
            return False
        busy = signals.busy_ratio
        if busy is not None and busy < self.config.idle_busy_ratio:
            return True
        per_trainer = self.config.surplus_batches_per_trainer
        return all(job.batches_lag > per_trainer * job.trainers for job in signals.jobs)

    def _surplus(self, signals: Signals, floor: int) -> Verdict:
        config, now, replicas = self.config, signals.at, signals.replicas
        gone = not signals.jobs
        # The work going away starts a cooldown of its own: a next job may be on its way.
        if self._surplus_since is None or gone != self._surplus_gone:
            self._surplus_since, self._surplus_gone = now, gone
        why = "the work is gone" if gone else self._surplus_why(signals)
        since = max(self._surplus_since, self._last_change_at or self._surplus_since)
        if replicas <= floor or now - since < config.cooldown_s:
            return Verdict(action="hold", target=replicas, reason=f"{why}; cooling down")
        if gone:
            target = floor
        else:
            target = max(replicas - 1, floor, (self._starved_at or 0) + 1)
            if target >= replicas:
                return Verdict(action="hold", target=replicas,
                               reason=f"{why}; trainers starved at {self._starved_at} "
                                      "replicas")  # fmt: skip
        self._surplus_since = now
        return self._change("down", now, target, f"{why} for {now - since:.0f} s")

    def _surplus_why(self, signals: Signals) -> str:
        busy = signals.busy_ratio
        if busy is not None and busy < self.config.idle_busy_ratio:
            return f"the preprocessors are busy only {busy:.0%}"
        return "batches pile up beyond the prefetch window"

    def _change(self, action: str, now: float, target: int, reason: str) -> Verdict:
        self._last_change_at = now
        return Verdict(action=action, target=target, reason=reason)
