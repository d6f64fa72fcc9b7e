"""The records of ``Topics.autoscaler``: what the autoscaler decided, from which measurements,
which dead services its supervisor (the local driver) started again, and how busy each
preprocessor is (the preprocessors' own reports, one of the policy's inputs).

The gateway folds the topic into ``GET /v1/autoscaler``; people read it to see why the pool has
the size it has.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from conveyor.platform.messages.registry import Message, Record, message

SCALING_ACTIONS = ("start", "up", "down", "hold", "clamp")
"""``ScalingDecision.action``: ``start`` (the state when the autoscaler starts), ``up`` and
``down`` (the policy changed the pool), ``clamp`` (the pool was outside min/max or the
partition count) and ``hold`` (a state report with no change, at most one per
``report_every_s``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class JobSignals(Record):
    """What the autoscaler measured about one running job."""

    job_id: str
    """The job."""
    trainers: int
    """Trainers whose progress report is recent enough to count."""
    data_wait_ratio: float | None
    """Mean of those trainers' recent exposed data wait / step time (None: no fresh report)."""
    batches_lag: int
    """Batches published and not yet committed by the job's trainers' group."""

    def __post_init__(self) -> None:
        if self.trainers < 0 or self.batches_lag < 0:
            raise ValueError("trainers and batches_lag must be >= 0")
        _check_ratio("data_wait_ratio", self.data_wait_ratio)


@message("ScalingDecision", version=2)
@dataclass(kw_only=True, slots=True)
class ScalingDecision(Message):
    """One decision of the autoscaler about one pool, with every input it was made from."""

    worker_id: str
    """The autoscaler process."""
    service: str
    """The pool it sizes (``preprocessor``)."""
    driver: str
    """How it sizes it: ``local``, ``docker`` or ``kubernetes``."""
    action: str
    """One of :data:`SCALING_ACTIONS`."""
    replicas_before: int
    """Replicas the driver reported before the decision."""
    replicas_after: int
    """Replicas asked for (equal to ``replicas_before`` for ``start`` and ``hold``)."""
    min_replicas: int
    """Configured floor."""
    max_replicas: int
    """Configured ceiling, before the partition bound."""
    partitions: int
    """Partitions of the shards topic: the most preprocessors that can work at once."""
    reason: str
    """Why, in words (the rule that fired and its numbers)."""
    shards_lag: int
    """Shard tasks released and not yet committed by the preprocessor group."""
    shards_per_second: float | None
    """Shard tasks the group committed per second since the previous measurement."""
    jobs: list[JobSignals]
    """The running jobs' measurements."""
    busy_ratio: float | None
    """Mean busy ratio of the preprocessors that reported recently (None: none did)."""
    preprocessors_reporting: int
    """Preprocessors whose busy report was recent enough to count."""
    decided_at: float = dataclasses.field(default_factory=time.time)
    """Unix time in seconds."""

    def __post_init__(self) -> None:
        if self.action not in SCALING_ACTIONS:
            raise ValueError(f"action must be one of {SCALING_ACTIONS}, got {self.action!r}")
        counts = (self.replicas_before, self.replicas_after, self.min_replicas, self.shards_lag,
                  self.preprocessors_reporting)  # fmt: skip
        if min(counts) < 0:
            raise ValueError("replica counts and lags must be >= 0")
        _check_ratio("busy_ratio", self.busy_ratio)


@message("PreprocessorLoad", version=1)
@dataclass(kw_only=True, slots=True)
class PreprocessorLoad(Message):
    """How busy one preprocessor was over its recent window; each preprocessor publishes one
    every ``CONVEYOR_PREPROCESSOR_LOAD_REPORT_S`` and one with ``leaving`` when it stops.

    Busy is the share of its worker slots' time spent reading and preprocessing shards
    (``conveyor_preprocessor_busy_ratio``): near 1, more work would wait for a slot; near 0,
    the process waits for work.
    """

    worker_id: str
    """The preprocessor."""
    busy_ratio: float
    """Busy slot-seconds / (slots x window seconds), in [0, 1]."""
    slots: int
    """Shard tasks it works on at once (its ``concurrency``)."""
    leaving: bool = False
    """It stops: its report no longer counts."""
    at: float = dataclasses.field(default_factory=time.time)
    """When it was measured, unix time in seconds."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("PreprocessorLoad.worker_id must not be empty")
        if self.slots < 1:
            raise ValueError(f"PreprocessorLoad.slots must be >= 1, got {self.slots}")
        _check_ratio("busy_ratio", self.busy_ratio)


def _check_ratio(name: str, ratio: float | None) -> None:
    if ratio is not None and not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {ratio}")


@message("ServiceRestarted", version=1)
@dataclass(kw_only=True, slots=True)
class ServiceRestarted(Message):
    """The supervisor found a service process dead and started it again."""

    worker_id: str
    """The autoscaler process whose supervisor did it."""
    instance: str
    """The process's name in the stack (``trainer``, ``preprocessor-2``)."""
    old_pid: int
    """The pid that died."""
    new_pid: int
    """The pid started in its place."""
    restarts: int
    """Times this instance was restarted since the supervisor started."""
    backoff_s: float
    """How long the supervisor waited after noticing the death before starting it again."""
    restarted_at: float = dataclasses.field(default_factory=time.time)
    """Unix time in seconds."""
