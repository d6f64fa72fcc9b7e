"""Scheduling trainers to jobs: the trainer pool and the schedule, pure folds with no I/O.

Every trainer and the gateway fold the jobs topic into a
:class:`~conveyor.training.jobview.JobsView`, which keeps the pool (:class:`TrainerPool`, from
:class:`TrainerPresence` records) beside the jobs. :func:`schedule` is a function of that state
alone (not of the order in which a reader met the jobs topic's partitions), so every process
that has read the same records computes the same schedule; a trainer hosts the job the schedule
places it on (departure 26 in docs/architecture.md).

The rules, in this order:

1. Jobs are ranked by priority (higher first), then submission time, then id.
2. A job that has started (a trainer joined it) keeps its minimum: no job is stopped for
   another, even one of a higher priority.
3. A started job also keeps the trainers beyond its minimum that it holds (live trainers that
   report it, up to its most), except those a job of a *higher* priority needs (rules 4-5):
   an elastic job shrinks for a higher priority, and only for one; a job of the same or a
   lower priority waits for its trainers like any other.
4. Waiting jobs get their minimum in rank order while the pool has it: spare trainers first,
   then the extras of started jobs of lower priority (the lowest-ranked holder first). The
   first one that does not fit waits, and so does every job ranked after it (FIFO within a
   priority, no overtaking): these are the queue, in rank order.
5. Trainers left over go to the admitted jobs in rank order: first up to what each wants
   (``distribution.trainers``; a job short of it may also take lower-priority extras), then up
   to its most (``max_trainers``, spare trainers only). An elastic job thus grows when
   trainers free up.
6. Placement is sticky: a trainer already on a job stays while the job's count keeps it
   (lowest ids first); the others, lowest id first, fill the jobs in rank order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.platform.messages import TrainerPresence


@dataclass(frozen=True, kw_only=True, slots=True)
class Demand:
    """What one servable job asks of the pool."""

    job_id: str
    priority: int
    """Higher is served first."""
    submitted_at: float
    """Unix seconds of its JobSubmitted (the FIFO order within a priority)."""
    fewest: int
    """Trainers it needs to run (``min_trainers``, else ``trainers``)."""
    wanted: int
    """Trainers it asks for (``trainers``)."""
    most: int
    """Trainers it may grow to (``max_trainers``, else ``trainers``)."""

    def __post_init__(self) -> None:
        assert 1 <= self.fewest <= self.wanted <= self.most, self

    @classmethod
    def of_spec(cls, job_id: str, spec: Mapping[str, Any], submitted_at: float) -> Demand:
        """The demand of a spec as the gateway validated it (``JobSpec.to_dict``); a field
        absent from an older spec takes the spec's default."""
        distribution = spec.get("distribution") or {}
        wanted = _positive(distribution.get("trainers"), 1)
        fewest = min(_positive(distribution.get("min_trainers"), wanted), wanted)
        most = max(_positive(distribution.get("max_trainers"), wanted), wanted)
        priority = spec.get("priority")
        return cls(
            job_id=job_id,
            priority=priority if isinstance(priority, int) else 0,
            submitted_at=submitted_at,
            fewest=fewest,
            wanted=wanted,
            most=most,
        )

    @property
    def rank(self) -> tuple[int, float, str]:
        return -self.priority, self.submitted_at, self.job_id


def _positive(value: object, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return default


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Where every live trainer goes, and the jobs that wait."""

    placement: Mapping[str, str]
    """worker id -> the job it trains; a live trainer not in it stays idle."""
    queue: tuple[str, ...]
    """Ids of the jobs waiting for their minimum, in the order they will be served."""
    pool: tuple[str, ...]
    """The live trainers, sorted."""

    @property
    def pool_size(self) -> int:
        return len(self.pool)

    @property
    def idle(self) -> list[str]:
        """Live trainers placed on no job."""
        return [worker for worker in self.pool if worker not in self.placement]

    def trainers_of(self, job_id: str) -> list[str]:
        """The trainers placed on the job, sorted."""
        return sorted(worker for worker, job in self.placement.items() if job == job_id)

    def position(self, job_id: str) -> int | None:
        """1-based place of the job in the queue; None when it is not waiting."""
        return self.queue.index(job_id) + 1 if job_id in self.queue else None


def schedule(
    demands: Iterable[Demand], started: frozenset[str], pool: Mapping[str, str | None]
) -> Schedule:
    """The schedule of the module's rules.

    ``demands``: the servable jobs (planned or running, not terminal, no cancel asked);
    ``started``: the ids of those a trainer joined; ``pool``: live worker id -> the job it
    reports hosting (None: idle).
    """
    ranked = sorted(demands, key=lambda demand: demand.rank)
    counts: dict[str, int] = {}
    extras: dict[str, int] = {}
    """Trainers a started job holds beyond its minimum: a higher priority may take them."""
    spare = len(pool)
    for demand in ranked:  # rule 2
        if demand.job_id in started and spare > 0:
            counts[demand.job_id] = min(demand.fewest, spare)
            spare -= counts[demand.job_id]
    for demand in ranked:  # rule 3
        if demand.job_id in counts:
            holding = sum(1 for job in pool.values() if job == demand.job_id)
            kept = min(holding, demand.most) - counts[demand.job_id]
            extras[demand.job_id] = max(0, min(kept, spare))
            counts[demand.job_id] += extras[demand.job_id]
            spare -= extras[demand.job_id]
    claims = _Claims(ranked, counts, extras, spare)
    queue: list[str] = []
    for demand in ranked:  # rule 4
        if demand.job_id in counts:
            continue
        if not queue and claims.available(demand) >= demand.fewest:
            counts[demand.job_id] = 0
            claims.take(demand, demand.fewest)
        else:
            queue.append(demand.job_id)
    for demand in ranked:  # rule 5
        if demand.job_id in counts:
            claims.take(demand, min(demand.wanted - counts[demand.job_id],
                                    claims.available(demand)))  # fmt: skip
    for demand in ranked:
        if demand.job_id in counts:
            claims.take(demand, min(demand.most - counts[demand.job_id], claims.spare),
                        spare_only=True)  # fmt: skip
    return Schedule(
        placement=_place(ranked, counts, pool), queue=tuple(queue), pool=tuple(sorted(pool))
    )


class _Claims:
    """Moves trainers into ``counts``: from the spare ones first, then from the extras of
    started jobs of a lower priority than the claimant, the lowest-ranked holder first."""

    def __init__(
        self, ranked: list[Demand], counts: dict[str, int], extras: dict[str, int], spare: int
    ) -> None:
        self._ranked, self._counts, self._extras, self.spare = ranked, counts, extras, spare

    def _lower(self, demand: Demand) -> list[Demand]:
        return [other for other in reversed(self._ranked)
                if other.priority < demand.priority and self._extras.get(other.job_id)]  # fmt: skip

    def available(self, demand: Demand) -> int:
        """Trainers ``demand`` could get: spare ones and lower-priority extras."""
        return self.spare + sum(self._extras[other.job_id] for other in self._lower(demand))

    def take(self, demand: Demand, count: int, *, spare_only: bool = False) -> None:
        """Give ``demand`` ``count`` more trainers (``count`` <= what it may claim)."""
        if count <= 0:
            return
        from_spare = min(count, self.spare)
        self.spare -= from_spare
        self._counts[demand.job_id] += count
        left = count - from_spare
        assert not (spare_only and left), (demand, count)
        for other in self._lower(demand):
            taken = min(left, self._extras[other.job_id])
            self._extras[other.job_id] -= taken
            self._counts[other.job_id] -= taken
            left -= taken
        assert left == 0, (demand, count)


def _place(
    ranked: list[Demand], counts: Mapping[str, int], pool: Mapping[str, str | None]
) -> dict[str, str]:
    """Rule 5: keep who is on a job while its count allows, then fill from the idle ones."""
    placement: dict[str, str] = {}
    for demand in ranked:
        staying = sorted(worker for worker, job in pool.items() if job == demand.job_id)
        for worker in staying[: counts.get(demand.job_id, 0)]:
            placement[worker] = demand.job_id
    free = iter(sorted(worker for worker in pool if worker not in placement))
    for demand in ranked:
        placed = sum(1 for job in placement.values() if job == demand.job_id)
        for _ in range(counts.get(demand.job_id, 0) - placed):
            placement[next(free)] = demand.job_id
    return placement


@dataclass(slots=True)
class TrainerPool:
    """The live trainers, folded from :class:`TrainerPresence` records in log order.

    ``clock`` is the newest ``at`` of any record of the jobs topic the reader applied (the log's
    clock, not the reader's), so liveness is a function of the records read.
    """

    clock: float = 0.0
    _last: dict[str, TrainerPresence] = field(default_factory=dict)

    def observe(self, at: float) -> None:
        """Move the log's clock to a record's time (never backwards)."""
        self.clock = max(self.clock, at)

    def apply(self, presence: TrainerPresence) -> None:
        """Fold one presence; a leaving trainer is out of the pool at once."""
        self.observe(presence.at)
        previous = self._last.get(presence.worker_id)
        if previous is None or presence.at >= previous.at:
            self._last[presence.worker_id] = presence

    def live(self) -> dict[str, str | None]:
        """Live worker id -> the job it reports hosting (None: idle)."""
        return {
            worker: presence.job_id
            for worker, presence in self._last.items()
            if not presence.leaving and presence.at + presence.ttl_s >= self.clock
        }
