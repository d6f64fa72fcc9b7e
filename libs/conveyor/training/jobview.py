"""The job-state view of ``conveyor.jobs``.

Used by every service that needs to know the jobs (the gateway serves it, the trainer picks
its job from it). :class:`JobsView` is pure logic, no I/O: it is fed every :class:`JobEvent`
in log order (per job the order is the partition's, because events are keyed by job id);
:class:`~conveyor.training.joblog.JobLogReader` reads the topic and feeds it.

Fold rules (the view dispatches on the event's type):

- :class:`JobSubmitted` creates the job (``pending``); a second one for the same id (a retried
  publish, or two gateways racing on one Idempotency-Key) is ignored: the first one wins.
- States only move forward: pending -> planned -> running -> completed | failed | cancelled.
  A progress event implies running. Terminal states are final: later events are ignored.
- Events for a job never submitted are ignored.
- :class:`JobResumed` revives a failed or cancelled job under its id: ``pending`` again, the
  cancel request, reason, plan, summary and trainer reports cleared (epoch results and the
  coordinator's totals kept); ``incarnation`` (the event's) counts the resumes. A job it names
  that the view does not know is created from its spec (a resume after the jobs topic was
  lost); one that is not terminal ignores it.
- :class:`TrainerProgress` counters are each trainer's own; the view keeps the latest report
  per worker and sums counters and rates over workers (step and epoch: the maximum). Once a
  :class:`CoordinatorProgress` (the job's own totals, from the aggregator that closes its
  steps) is in, the counters, step, epoch and loss come from it alone (adding it to the
  trainers' would count every sample twice); rates and data wait still come from the trainers.
- ``stage_latency_s`` ({stage: seconds}) of each trainer report is kept in a bounded window
  per stage, from which :meth:`JobView.stage_percentiles` computes p50/p90/p99. When the job
  ends its windows give way to those percentiles (a view holds every job it ever saw).
- A view built with ``serving=False`` (the job hosts and the autoscaler: they never serve a job
  through the API) keeps no stage windows, and a job that ends there keeps no trainer reports
  or coordinator totals, and no spec either with ``ended_specs=False`` (every host but the
  checkpointer, which commits a completed job's final checkpoint after the end), only what
  says how it ended (state, reason, plan, epochs, summary): a host folds every job of the
  stack's life, and those parts were most of what an ended job held. A resume brings the spec
  back from its event.
- :class:`TrainerPresence` records (keyed by worker, not job) go to the trainer pool
  (:class:`~conveyor.training.scheduling.TrainerPool`); every record moves the pool's clock.
  :meth:`JobsView.schedule` places the pool's trainers on the jobs
  (:mod:`conveyor.training.scheduling`).
"""

from __future__ import annotations

import builtins
import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from conveyor.platform.messages import (
    CancelRequested,
    CoordinatorProgress,
    EpochCompleted,
    JobCancelled,
    JobCompleted,
    JobEvent,
    JobFailed,
    JobPlanned,
    JobResumed,
    JobSubmitted,
    SamplesSkipped,
    TrainerJoined,
    TrainerPresence,
    TrainerProgress,
)
from conveyor.platform.messages.job_events import MAX_SKIPPED_REASONS
from conveyor.training.scheduling import Demand, Schedule, TrainerPool, schedule

logger = logging.getLogger(__name__)

JobState = Literal["pending", "planned", "running", "completed", "failed", "cancelled"]
JOB_STATES: Final[tuple[JobState, ...]] = (
    "pending", "planned", "running", "completed", "failed", "cancelled",
)  # fmt: skip
TERMINAL_STATES: Final[frozenset[JobState]] = frozenset({"completed", "failed", "cancelled"})
_RANK: Final[dict[JobState, int]] = {state: rank for rank, state in enumerate(JOB_STATES)}

_SUMMED_COUNTERS = ("samples_trained", "batches_consumed", "consumed_train_batches")


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated ``q`` percentile (0..100) of non-empty ascending values."""
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@dataclass(slots=True)
class WorkerProgress:
    """The latest progress report of one trainer."""

    worker_id: str
    at: float
    epoch: int = 0
    step: int = 0
    samples_trained: int = 0
    batches_consumed: int = 0
    consumed_train_batches: int = 0
    loss: float | None = None
    samples_per_second: float = 0.0
    data_wait_ratio: float | None = None
    step_time_s: dict[str, float] = field(default_factory=dict)
    """Mean seconds per part of the trainer's recent steps."""


@dataclass(slots=True)
class JobView:
    """Everything the gateway knows about one job. Mutated only by :class:`JobsView`."""

    job_id: str
    name: str
    spec: dict[str, Any]
    idempotency_key: str | None
    submitted_at: float
    updated_at: float
    stage_window: int
    state: JobState = "pending"
    seq: int = 0
    """Events applied to this job so far (an SSE event id)."""
    cancel_requested: bool = False
    reason: str | None = None
    plan: JobPlanned | None = None
    summary: dict[str, Any] | None = None
    loss: float | None = None
    """Loss of the most recent progress report."""
    workers: dict[str, WorkerProgress] = field(default_factory=dict)
    coordinator: WorkerProgress | None = None
    """The latest report of the job's coordinator (job totals), if any."""
    epochs: dict[int, dict[str, Any]] = field(default_factory=dict)
    """epoch -> {eval_loss, eval_accuracy, train_loss} from epoch_completed."""
    skipped_ids: set[int] = field(default_factory=set)
    """Distinct samples the preprocessors left out (samples_skipped: failed validation)."""
    skipped_reasons: list[str] = field(default_factory=list)
    """``<file>: <reason>`` of the first of them (at most ``MAX_SKIPPED_REASONS``)."""
    stage_samples_s: dict[str, deque[float]] = field(default_factory=dict)
    """Per stage, the latencies of the recent trainer reports (none where the view does not
    track stages); dropped when the job ends, which keeps their percentiles instead."""
    stage_summary: dict[str, dict[str, float]] | None = None
    """:meth:`stage_percentiles` as the job ended: what it returns until new reports come (a
    resume), so an ended job holds a few numbers per stage instead of its windows."""
    demand: Demand | None = None
    """What it asks of the trainer pool (from its spec)."""
    incarnation: int = 0
    """Resumes so far (0: never resumed); hosts take a job again in each incarnation."""
    resumed_from: int | None = None
    """The checkpoint version of the latest resume."""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def servable(self) -> bool:
        """Planned or running, not terminal, no cancel asked: trainers may work on it."""
        return (
            self.state in ("planned", "running")
            and self.plan is not None
            and (not self.cancel_requested)
        )

    def progress(self) -> dict[str, Any]:
        """Job-level progress: the coordinator's totals (before its first report, the trainers'
        counters summed), step/epoch maxima, the trainers' summed rates and mean data wait."""
        reports = list(self.workers.values())
        counted = reports if self.coordinator is None else [self.coordinator]
        totals: dict[str, Any] = {
            name: sum(getattr(report, name) for report in counted) for name in _SUMMED_COUNTERS
        }
        waits = [r.data_wait_ratio for r in reports if r.data_wait_ratio is not None]
        training = self.spec.get("training")
        training = training if isinstance(training, dict) else {}
        epochs_total = _integer(training.get("epochs")) or 0
        total_steps = None if self.plan is None else self.plan.steps_per_epoch * epochs_total
        max_steps = _integer(training.get("max_steps"))
        if max_steps is not None and (total_steps is None or max_steps < total_steps):
            total_steps = max_steps
        return {
            "epoch": max((r.epoch for r in counted), default=0),
            "epochs": epochs_total,
            "step": max((r.step for r in counted), default=0),
            "total_steps": total_steps,
            **totals,
            "loss": self.loss,
            "samples_per_second": sum(r.samples_per_second for r in reports),
            "data_wait_ratio": sum(waits) / len(waits) if waits else None,
            "step_time_s": _mean_parts([r.step_time_s for r in reports if r.step_time_s]),
            "workers": sorted(self.workers),
        }

    def stage_percentiles(self) -> dict[str, dict[str, float]]:
        """Per stage: count, p50, p90, p99, max and last of the recent reports (seconds)."""
        if not self.stage_samples_s and self.stage_summary is not None:
            return self.stage_summary
        result: dict[str, dict[str, float]] = {}
        for stage, window in sorted(self.stage_samples_s.items()):
            ordered = sorted(window)
            result[stage] = {
                "count": float(len(ordered)),
                "p50": percentile(ordered, 50),
                "p90": percentile(ordered, 90),
                "p99": percentile(ordered, 99),
                "max": ordered[-1],
                "last": window[-1],
            }
        return result


class JobsView:
    """All jobs, folded from the jobs topic. Not thread-safe: one event loop owns it."""

    def __init__(
        self, *, stage_window: int = 256, serving: bool = True, ended_specs: bool = True
    ) -> None:
        """``stage_window``: the latest reports kept per stage while a job runs; ``serving``
        False (a service that never serves jobs through the API) keeps no stage windows and
        lets an ended job go of its reports, and of its spec unless ``ended_specs`` (see the
        module docstring)."""
        if stage_window < 1:
            raise ValueError("stage_window must be >= 1")
        self._serving = serving
        self._ended_specs = ended_specs
        self._stage_window = stage_window if serving else 0
        self._jobs: dict[str, JobView] = {}
        self._by_key: dict[str, str] = {}
        self.pool = TrainerPool()
        """The live trainers (from TrainerPresence records)."""

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: str) -> JobView | None:
        return self._jobs.get(job_id)

    def job_for_key(self, idempotency_key: str) -> JobView | None:
        """The job first submitted with this Idempotency-Key, if any."""
        job_id = self._by_key.get(idempotency_key)
        return None if job_id is None else self._jobs.get(job_id)

    def list(self, *, state: JobState | None = None, limit: int = 100) -> list[JobView]:
        """Newest submission first (ties: later in the log first), optionally one state only."""
        chosen = (job for job in self._jobs.values() if state is None or job.state == state)
        return _newest_first(chosen)[:limit]

    def unfinished(self) -> builtins.list[JobView]:
        """The jobs not in a terminal state, newest submission first (as :meth:`list`)."""
        return _newest_first(job for job in self._jobs.values() if not job.terminal)

    def counts_by_state(self) -> dict[JobState, int]:
        counts: dict[JobState, int] = dict.fromkeys(JOB_STATES, 0)
        for job in self._jobs.values():
            counts[job.state] += 1
        return counts

    def schedule(self) -> Schedule:
        """Where the pool's trainers go now and the queue (:func:`scheduling.schedule`)."""
        servable = [job for job in self._jobs.values() if job.servable and job.demand]
        return schedule(
            (job.demand for job in servable if job.demand is not None),
            # Started: a trainer joined. Not the running state, which the coordinator's
            # progress also sets (the aggregators host every job, placed on trainers or not).
            frozenset(job.job_id for job in servable if job.workers),
            self.pool.live(),
        )

    def apply_presence(self, presence: TrainerPresence) -> None:
        """Fold a trainer's presence into the pool."""
        self.pool.apply(presence)

    def apply(self, event: JobEvent) -> JobView | None:
        """Fold one event; returns the changed job, or None when the event changed nothing."""
        self.pool.observe(event.at)
        if isinstance(event, JobSubmitted):
            return self._submit(event)
        if isinstance(event, JobResumed):
            return self._resume(event)
        job = self._jobs.get(event.job_id)
        if job is None or job.terminal:
            return None
        if not _apply(job, event):
            return None
        job.seq += 1
        job.updated_at = max(job.updated_at, event.at)
        if job.terminal and job.stage_samples_s:
            job.stage_summary, job.stage_samples_s = job.stage_percentiles(), {}
        if job.terminal and not self._serving:
            job.workers, job.coordinator = {}, None
            if not self._ended_specs:
                job.spec = {}
        return job

    def _resume(self, event: JobResumed) -> JobView | None:
        job = self._jobs.get(event.job_id)
        if job is None:
            job = self._submit(JobSubmitted(job_id=event.job_id, spec=event.spec, at=event.at))
            assert job is not None
        elif not job.terminal:
            return None
        else:
            job.seq += 1
        job.state, job.cancel_requested, job.reason = "pending", False, None
        job.plan, job.summary, job.workers = None, None, {}
        job.spec = event.spec  # the submitted spec; a host's view let it go when the job ended
        job.incarnation = event.incarnation
        job.resumed_from = event.checkpoint_version
        job.updated_at = max(job.updated_at, event.at)
        return job

    def _submit(self, event: JobSubmitted) -> JobView | None:
        if event.job_id in self._jobs:
            return None
        job = JobView(
            job_id=event.job_id,
            name=str(event.spec.get("name", "")),
            spec=event.spec,
            idempotency_key=event.idempotency_key,
            submitted_at=event.at,
            updated_at=event.at,
            stage_window=self._stage_window,
            seq=1,
            demand=Demand.of_spec(event.job_id, event.spec, event.at),
        )
        self._jobs[event.job_id] = job
        if event.idempotency_key is not None:
            self._by_key.setdefault(event.idempotency_key, event.job_id)
        return job


def _newest_first(jobs: Iterable[JobView]) -> list[JobView]:
    ordered = list(jobs)[::-1]  # dicts keep log order: later in the log first on ties
    ordered.sort(key=lambda job: job.submitted_at, reverse=True)  # stable
    return ordered


def _mean_parts(reports: list[dict[str, float]]) -> dict[str, float]:
    """Per part, the mean over the trainers that report it (seconds per step)."""
    parts = sorted({part for report in reports for part in report})
    return {
        part: sum(values) / len(values)
        for part in parts
        if (values := [r[part] for r in reports if part in r and math.isfinite(r[part])])
    }


def _integer(value: object) -> int | None:
    """An int field of the (user-written) spec, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _advance(job: JobView, state: JobState) -> bool:
    if _RANK[state] <= _RANK[job.state]:
        return False
    job.state = state
    return True


def _apply(job: JobView, event: JobEvent) -> bool:
    """Fold a non-submitted event into its (non-terminal) job; True when the job changed."""
    match event:
        case JobPlanned():
            job.plan = event
            _advance(job, "planned")
            return True
        case TrainerJoined(worker_id=worker_id):
            joined = worker_id not in job.workers
            if joined:
                job.workers[worker_id] = WorkerProgress(worker_id=worker_id, at=event.at)
            return _advance(job, "running") or joined
        case TrainerProgress():
            job.workers[event.worker_id] = _trainer_report(job, event)
            _advance(job, "running")
            return True
        case CoordinatorProgress():
            job.coordinator = WorkerProgress(
                worker_id=event.worker_id,
                at=event.at,
                epoch=event.epoch,
                step=event.step,
                samples_trained=event.samples_trained,
                batches_consumed=event.consumed_batches,
                consumed_train_batches=event.consumed_train_batches,
                loss=event.loss,
            )
            if event.loss is not None:
                job.loss = event.loss
            _advance(job, "running")
            return True
        case EpochCompleted():
            job.epochs[event.epoch] = {
                "train_loss": event.train_loss,
                "eval_loss": event.eval_loss,
                "eval_accuracy": event.eval_accuracy,
            }
            return True
        case JobCompleted():
            job.summary = dict(event.summary)
            job.state = "completed"
            return True
        case JobFailed():
            job.reason = event.reason
            job.state = "failed"
            return True
        case SamplesSkipped():
            new = set(event.sample_ids) - job.skipped_ids
            if not new:  # a redelivered shard or a later epoch reports the same samples
                return False
            job.skipped_ids |= new
            room = MAX_SKIPPED_REASONS - len(job.skipped_reasons)
            job.skipped_reasons += [r for r in event.reasons if r not in job.skipped_reasons][:room]
            return True
        case CancelRequested():
            if job.cancel_requested:
                return False
            job.cancel_requested = True
            return True
        case JobCancelled():
            job.reason = event.reason
            job.state = "cancelled"
            return True
    logger.debug("ignoring %s for %s", type(event).__name__, event.job_id)
    return False


def _trainer_report(job: JobView, event: TrainerProgress) -> WorkerProgress:
    if event.loss is not None:
        job.loss = event.loss
    for stage, latency_s in event.stage_latency_s.items():
        if job.stage_window and math.isfinite(latency_s) and latency_s >= 0:
            window = job.stage_samples_s.setdefault(stage, deque(maxlen=job.stage_window))
            window.append(latency_s)
    return WorkerProgress(
        worker_id=event.worker_id,
        at=event.at,
        epoch=event.epoch,
        step=event.step,
        samples_trained=event.samples_trained,
        loss=event.loss,
        samples_per_second=event.samples_per_second,
        data_wait_ratio=event.data_wait_ratio,
        step_time_s=dict(event.step_time_s),
    )
