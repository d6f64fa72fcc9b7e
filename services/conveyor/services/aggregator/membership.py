"""Who trains a job right now, and how many micro-batches each trainer takes per step.

Liveness compares the sender's clock (Heartbeat ``at``, Contribution ``sent_at``) with the
coordinator's wall clock, so a replayed log does not make long-dead trainers look alive; the
member timeout must therefore exceed the clock skew between machines (NTP keeps it far below
the default 10 s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.platform.messages import Heartbeat, TrainerState


@dataclass(slots=True)
class Member:
    """The latest news from one trainer."""

    worker_id: str
    last_seen_at: float
    """Sender time (unix s) of its latest heartbeat or contribution."""
    samples_per_second: float | None = None
    """Its own compute throughput from its latest heartbeat."""
    data_wait_ratio: float | None = None
    batches_partitions: tuple[int, ...] = ()
    """Partitions of the job's batches topic its consumer owns, from its latest heartbeat."""


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _data_wait_ratio(state: TrainerState) -> float | None:
    """``data_wait_ratio``, else ``step_time_s["data_wait"]`` over the sum of the step's parts."""
    if state.data_wait_ratio is not None and math.isfinite(state.data_wait_ratio):
        return state.data_wait_ratio
    parts = [v for v in state.step_time_s.values() if math.isfinite(v) and v >= 0]
    wait, total = state.step_time_s.get("data_wait"), sum(parts)
    return wait / total if wait is not None and math.isfinite(wait) and total > 0 else None


class Membership:
    """Trainers of one job, from heartbeats and contributions (see the module docstring)."""

    __slots__ = ("_members", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"member timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._members: dict[str, Member] = {}

    def heartbeat(self, beat: Heartbeat) -> None:
        """Fold a heartbeat; a ``leaving`` one removes the member at once."""
        if beat.leaving:
            member = self._members.get(beat.worker_id)
            if member is not None and member.last_seen_at <= beat.at:
                del self._members[beat.worker_id]
            return
        member = self.seen(beat.worker_id, beat.at)
        if member.last_seen_at == beat.at:  # the newest news wins
            member.samples_per_second = _positive(beat.state.samples_per_second)
            member.data_wait_ratio = _data_wait_ratio(beat.state)
            member.batches_partitions = tuple(sorted(set(beat.state.batches_partitions)))

    def seen(self, worker_id: str, at: float) -> Member:
        """Record a sign of life of ``worker_id`` at sender time ``at``."""
        member = self._members.get(worker_id)
        if member is None:
            member = self._members[worker_id] = Member(worker_id=worker_id, last_seen_at=at)
        member.last_seen_at = max(member.last_seen_at, at)
        return member

    def live(self, now: float) -> list[Member]:
        """Members seen within the timeout, by worker id."""
        return sorted(
            (m for m in self._members.values() if now - m.last_seen_at <= self.timeout_s),
            key=lambda m: m.worker_id,
        )

    def data_wait_ratio(self) -> float | None:
        """Mean of the members' latest data-wait ratios (None when none reported one)."""
        members = self._members.values()
        ratios = [m.data_wait_ratio for m in members if m.data_wait_ratio is not None]
        return sum(ratios) / len(ratios) if ratios else None


def allocate(
    throughputs: Mapping[str, float | None], total: int, *, turn: int = 0
) -> dict[str, int]:
    """Micro-batches per worker for one step, summing to ``total``: proportional to throughput
    (largest remainder), at least 1 each while there are no more workers than ``total``.
    Unknown throughputs count as the mean of the known ones.

    More workers than ``total``: ``total`` of them get 1 and the rest 0, taking turns over the
    workers in the order of ``throughputs`` (step ``turn`` starts at ``turn * total``), so the
    global batch stays ``total`` micro-batches whatever the pool size, and every worker's
    batches (a worker receives its own share of the batches topic) are consumed within
    ``ceil(n / total)`` steps. The coordinator orders the workers as the routing spreads the
    batches over them (:meth:`Coordinator.allocation`), so a step's turn falls to the workers
    that hold its batches."""
    if total < 1:
        raise ValueError(f"total must be >= 1, got {total}")
    if not throughputs:
        return {}
    known = [v for v in (_positive(t) for t in throughputs.values()) if v is not None]
    default = sum(known) / len(known) if known else 1.0
    rates = {w: _positive(t) or default for w, t in throughputs.items()}
    if len(rates) >= total:
        order = list(rates)
        start = (turn * total) % len(order)
        chosen = {order[(start + i) % len(order)] for i in range(total)}
        return {w: int(w in chosen) for w in order}
    scale = total / sum(rates.values())
    ideal = {w: r * scale for w, r in rates.items()}
    counts = {w: max(1, math.floor(x)) for w, x in ideal.items()}
    while sum(counts.values()) > total:
        # take from whoever got the most above its share (never below 1)
        w = max((w for w in counts if counts[w] > 1), key=lambda w: (counts[w] - ideal[w], w))
        counts[w] -= 1
    while sum(counts.values()) < total:
        w = max(counts, key=lambda w: (ideal[w] - counts[w], w))
        counts[w] += 1
    return counts
