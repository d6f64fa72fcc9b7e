"""The sharder's view of its jobs: a pure fold of the events of ``Topics.jobs``.

A :class:`JobResumed` starts a new record for its job (the job's held record, when one is kept,
is released): the sharder plans it again from the checkpoint it names.

Acknowledgement policy (what makes a restart replay the right events): the ``submitted``
record of a job is held unacknowledged until the job is forgotten (terminal), so the
committed offset of its partition never passes it; every later record of the same job (same
key, same partition) is therefore replayed after a restart too and may be acknowledged as soon
as it is folded. Records of unknown jobs, duplicate submissions and other message types are
acknowledged at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from opentelemetry.trace import SpanContext

from conveyor.platform.bus import Received
from conveyor.platform.messages import (
    TERMINAL_EVENTS,
    CancelRequested,
    CoordinatorProgress,
    JobEvent,
    JobPlanned,
    JobResumed,
    JobSubmitted,
    ResumePoint,
    SamplesSkipped,
    Topics,
    TrainerPresence,
)
from conveyor.services.sharder.flow import FlowControl, RemainingSequence
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import JobPlan

logger = logging.getLogger(__name__)

_KEPT_REASONS = 5
"""Reasons of skipped samples a job's failure message quotes."""


@dataclass(slots=True, kw_only=True)
class JobRecord:
    """One non-forgotten job of this sharder: what the log says, and what was done about it."""

    job_id: str
    submitted: Received
    """The held (unacknowledged) ``submitted`` (or ``resumed``) record."""
    spec: JobSpec | None
    """The parsed spec; None when it is invalid (``spec_error`` says why)."""
    spec_error: str | None
    consumed: int = 0
    """Batches finished, from the coordinator's latest progress event."""
    routing: list[float] = field(default_factory=list)
    """Weights of the batches topic's partitions from the coordinator's latest progress event
    (empty: unweighted), stamped into every shard task released."""
    planned_seen: bool = False
    """A ``planned`` event for the job is in the log (do not publish another)."""
    cancel_requested: bool = False
    terminal: bool = False
    """A completed/failed/cancelled event for the job is in the log."""
    outcome_published: bool = False
    """This process published the job's failed/cancelled event (wait for it to come back)."""
    plan: JobPlan | None = None
    flow: FlowControl | None = None
    plan_span: SpanContext | None = field(default=None)
    """The ``plan job`` span, linked from every ``release shard`` span."""
    skipped: set[int] = field(default_factory=set)
    """Distinct sample ids the preprocessors skipped as bad (``SamplesSkipped`` events)."""
    skipped_reasons: list[str] = field(default_factory=list)
    """The first few of their reasons (``<file>: <reason>``)."""
    resume: JobResumed | None = None
    """The event that resumed the job (None: a submission)."""
    resume_point: ResumePoint | None = None
    """Where the resumed job starts, once read from its checkpoint."""
    consumed_base: int = 0
    """Batches counted as consumed at the resume (flow control counts those after it)."""

    @property
    def incarnation(self) -> int:
        """The job's resumes so far: names its topics (``Topics``)."""
        return 0 if self.resume is None else self.resume.incarnation

    @property
    def flow_consumed(self) -> int:
        """The consumed count flow control runs on (since the resume, if resumed)."""
        return max(0, self.consumed - self.consumed_base)

    def plan_task(self, index: int) -> int:
        """The plan's task index of flow control's task ``index``."""
        if self.flow is not None and isinstance(self.flow.sequence, RemainingSequence):
            return self.flow.sequence.tasks[index]
        return index

    def too_many_bad_samples(self) -> str | None:
        """Why the job must fail when more distinct samples were skipped than the spec's
        ``dataset.max_bad_samples`` allows; None otherwise."""
        if self.spec is None or len(self.skipped) <= self.spec.dataset.max_bad_samples:
            return None
        return (
            f"{len(self.skipped)} samples failed validation, more than "
            f"dataset.max_bad_samples={self.spec.dataset.max_bad_samples}: "
            + "; ".join(self.skipped_reasons)
        )

    @property
    def source(self) -> tuple[str, int]:
        """(topic, partition) the job's events come from."""
        return self.submitted.topic, self.submitted.partition

    @property
    def active(self) -> bool:
        """Planned and still releasing (not terminal, not cancelled, not failed by us)."""
        return (
            self.plan is not None
            and not self.terminal
            and not self.cancel_requested
            and not self.outcome_published
        )


class JobTable:
    """Jobs by id, folded from the jobs topic in log order (per job: partition order)."""

    def __init__(self, topics: Topics) -> None:
        self._topics = topics
        self._jobs: dict[str, JobRecord] = {}
        self._released: list[JobRecord] = []

    def take_released(self) -> list[JobRecord]:
        """Records a resume replaced: the caller acknowledges their held records and deletes
        their incarnation's topics."""
        released, self._released = self._released, []
        return released

    def __len__(self) -> int:
        return len(self._jobs)

    def records(self) -> list[JobRecord]:
        """A snapshot of the jobs, oldest submission first."""
        return list(self._jobs.values())

    def get(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def forget(self, job_id: str) -> JobRecord | None:
        """Drop the job (its held record is the caller's to acknowledge, or not)."""
        return self._jobs.pop(job_id, None)

    def apply(self, received: Received) -> bool:
        """Fold one record; True when it may be acknowledged now (see the module docstring)."""
        event = received.message
        if isinstance(event, TrainerPresence):
            return True  # the trainer pool is the trainers' and the gateway's concern
        if not isinstance(event, JobEvent):
            logger.warning("ignoring %s on %s", type(event).__name__, received.topic)
            return True
        job = self._jobs.get(event.job_id)
        if isinstance(event, JobSubmitted):
            return self._submitted(job, event, received)
        if isinstance(event, JobResumed):
            return self._resumed(job, event, received)
        if job is None:
            return True
        match event:
            case JobPlanned():
                job.planned_seen = True
            case CoordinatorProgress():
                # Latest wins: a new coordinator after a failover rebuilds the same count from
                # the log; a report without routing (no trainer known) clears the weights.
                job.consumed = event.consumed_batches
                job.routing = list(event.routing)
            case SamplesSkipped():
                job.skipped.update(event.sample_ids)
                room = _KEPT_REASONS - len(job.skipped_reasons)
                job.skipped_reasons.extend(event.reasons[: max(0, room)])
            case CancelRequested():
                job.cancel_requested = True
            case _ if isinstance(event, TERMINAL_EVENTS):
                job.terminal = True
        return True

    def _submitted(self, job: JobRecord | None, event: JobSubmitted, received: Received) -> bool:
        if job is not None:
            same = (job.submitted.partition, job.submitted.offset) == (
                received.partition,
                received.offset,
            )
            if same:
                # Redelivered (the partition came back after a rebalance): hold the new copy,
                # the old one's acknowledgement would be ignored by the consumer.
                job.submitted = received
                return False
            logger.info("job %s: ignoring a repeated submission", event.job_id)
            return True
        spec, error = _parse_spec(event, self._topics)
        self._jobs[event.job_id] = JobRecord(
            job_id=event.job_id,
            submitted=received,
            spec=spec,
            spec_error=error,
        )
        return False

    def _resumed(self, job: JobRecord | None, event: JobResumed, received: Received) -> bool:
        if job is not None:
            if (job.submitted.partition, job.submitted.offset) == (
                received.partition,
                received.offset,
            ):
                job.submitted = received  # redelivered: hold the new copy
                return False
            if not job.terminal:
                logger.info("job %s: ignoring a resume of a job that has not ended", job.job_id)
                return True
            self._released.append(job)
        spec, error = _parse_spec(event, self._topics)
        self._jobs[event.job_id] = JobRecord(
            job_id=event.job_id, submitted=received, spec=spec, spec_error=error, resume=event
        )
        return False


def _parse_spec(
    event: JobSubmitted | JobResumed, topics: Topics
) -> tuple[JobSpec | None, str | None]:
    try:
        topics.batches(event.job_id)
    except ValueError as exc:
        return None, str(exc)
    try:
        return JobSpec.from_dict(event.spec), None
    except ValueError as exc:
        return None, f"invalid job spec: {exc}"
