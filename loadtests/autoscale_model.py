"""A fluid model of the pipeline for bench_autoscale.py's ``--model`` part: the same three
policies on a simulated clock, where this machine cannot show them (two shared cores cannot
run a preprocessor pool that outgrows one core beside a trainer).

Every ``DT_S``: running preprocessors make ``rate`` samples/s each (a new one only after
``start_s``), up to the flow-control lead ahead of the trainer; the trainer takes up to
``demand`` samples/s from what is ready; the data wait of the step is the share of the demand it
did not get, and the trainers report its mean over the last ``window_s`` (as they do). Shard
tasks wait (the preprocessor group's lag) while the lead is not filled. The autoscaler is the
real :class:`~conveyor.services.autoscaler.policy.ScalingPolicy`, asked every ``interval_s``;
the lag-only policy polls every ``poll_s`` and asks for ``ceil(lag / threshold)`` replicas
(KEDA's Kafka scaler through the HPA, whose scale-down waits its 300 s stabilization).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from conveyor.platform.messages import JobSignals
from conveyor.services.autoscaler.policy import PolicyConfig, ScalingPolicy, Signals

DT_S = 0.5


@dataclass(frozen=True, slots=True)
class Pipeline:
    demand: float = 1200.0
    """Samples/s the trainers can use."""
    rate: float = 300.0
    """Samples/s one preprocessor makes."""
    start_s: float = 8.0
    """From the decision to a new preprocessor's first batch (process start, group join)."""
    work: int = 120_000
    """Samples the job trains."""
    lead: int = 4096
    """Samples the sharder releases ahead of the trainers (flow control)."""
    shard: int = 64
    """Samples per shard task."""
    batch: int = 32
    window_s: float = 10.0
    """The trainers' data-wait window."""


@dataclass(frozen=True, slots=True)
class Outcome:
    seconds_to_fed: float | None
    preprocessor_seconds: float
    job_seconds: float
    decisions: int
    peak_replicas: int


def simulate(policy: str, pipe: Pipeline, *, peak: int, idle_s: float, threshold: int = 2,
             poll_s: float = 30.0, interval_s: float = 2.0) -> Outcome:  # fmt: skip
    """Run the job under ``policy`` (``autoscaler``, ``fixed`` or ``lag_only``), then
    ``idle_s`` seconds without work (counted in the preprocessor-seconds: a pool costs while
    it waits for the next job)."""
    scaler = ScalingPolicy(PolicyConfig(min_replicas=1, max_replicas=peak))
    ready_at = [0.0] * (peak if policy == "fixed" else 1)  # when each replica produces
    ready = done = 0.0
    waits: deque[float] = deque(maxlen=int(pipe.window_s / DT_S))
    now, fed_at, used, decisions, last_poll, last_down_wish = 0.0, None, 0.0, 0, 0.0, None
    peak_seen = len(ready_at)
    ended: float | None = None
    while ended is None or now < ended + idle_s:
        if ended is None and done >= pipe.work:
            ended = now
        producing = sum(1 for at in ready_at if at <= now)
        room = pipe.lead - ready
        ready += min(producing * pipe.rate * DT_S, max(0.0, room))
        if ended is None:
            taken = min(pipe.demand * DT_S, ready, pipe.work - done)
            ready -= taken
            done += taken
            waits.append(1.0 - taken / (pipe.demand * DT_S))
        else:
            ready = 0.0  # the job's batches go with its topics
        wait = sum(waits) / len(waits)
        used += len(ready_at) * DT_S
        if fed_at is None and len(waits) == waits.maxlen and wait < 0.05:
            fed_at = now
        lag = (
            0
            if ended is not None
            else max(0, math.ceil((pipe.lead - ready) / pipe.shard) - producing)
        )
        target = len(ready_at)
        if policy == "autoscaler" and now % interval_s < DT_S / 2:
            jobs = [] if ended is not None else [JobSignals(
                job_id="j", trainers=1, data_wait_ratio=min(1.0, wait),
                batches_lag=int(ready / pipe.batch),
            )]  # fmt: skip
            target = scaler.decide(Signals(at=now, replicas=len(ready_at), partitions=8,
                                           shards_lag=lag, jobs=jobs)).target  # fmt: skip
        elif policy == "lag_only" and now - last_poll >= poll_s:
            last_poll = now
            wish = min(peak, max(1, math.ceil(lag / threshold)))
            if wish >= len(ready_at):
                target, last_down_wish = wish, None
            else:  # the HPA's scale-down stabilization
                last_down_wish = last_down_wish if last_down_wish is not None else now
                target = wish if now - last_down_wish >= 300 else len(ready_at)
        if target != len(ready_at):
            decisions += 1
            if target > len(ready_at):
                ready_at += [now + pipe.start_s] * (target - len(ready_at))
            else:
                ready_at = ready_at[:target]
            peak_seen = max(peak_seen, target)
        now += DT_S
    assert ended is not None
    return Outcome(seconds_to_fed=fed_at, preprocessor_seconds=used, job_seconds=ended,
                   decisions=decisions, peak_replicas=peak_seen)  # fmt: skip
