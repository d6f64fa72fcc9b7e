"""The events of ``Topics.jobs``: a job's life, one registered message per kind of event.

The job state is the fold of these events in log order (per job the order is the partition's:
every event is keyed by the job id). Consumers dispatch on the type. ``EVENT`` is the event's
stable name in the gateway's progress stream (server-sent events) and in logs; ``details()``
is its data there.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from conveyor.platform.messages.registry import Message, message

COORDINATOR_WORKER_ID = "coordinator"
"""``worker_id`` of the events a job's coordinator publishes (the aggregator process that owns
slice 0 of the job)."""


@dataclass(kw_only=True, slots=True)
class JobEvent(Message):
    """Base of every event on ``Topics.jobs`` (not itself a wire message)."""

    EVENT: ClassVar[str]
    """Name of the event in the progress stream (``submitted``, ``planned``, ...)."""

    job_id: str
    """Id of the job (also the record key)."""
    at: float = dataclasses.field(default_factory=time.time)
    """When it happened, unix time in seconds."""

    def details(self) -> dict[str, Any]:
        """The event's own fields (not ``job_id`` and ``at``) as plain values."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("job_id", "at")
        }


_PLAN_MINIMUMS = {
    "num_train": 1,
    "num_eval": 0,
    "num_classes": 1,
    "train_batches_per_epoch": 1,
    "eval_batches_per_epoch": 0,
    "steps_per_epoch": 1,
    "shards_per_epoch": 1,
    "batches_partitions": 1,
}


@message("JobSubmitted", version=1)
@dataclass(kw_only=True, slots=True)
class JobSubmitted(JobEvent):
    """The gateway accepted a job. The first one of a job id wins; a repeat is ignored."""

    EVENT: ClassVar[str] = "submitted"

    spec: dict[str, Any]
    """The job spec as validated by the gateway (JSON-compatible)."""
    idempotency_key: str | None = None
    """The ``Idempotency-Key`` it was submitted with, if any."""


@message("JobPlanned", version=1)
@dataclass(kw_only=True, slots=True)
class JobPlanned(JobEvent):
    """The sharder read the dataset, planned the job and created its topics: the one answer
    to "what is this job's plan" that trainers and aggregators build from."""

    EVENT: ClassVar[str] = "planned"

    num_train: int
    """Training samples per epoch."""
    num_eval: int
    """Evaluation samples per epoch."""
    num_classes: int
    """Classes of the dataset (the model's output size)."""
    sample_shape: list[int]
    """[C, H, W] of every sample."""
    train_batches_per_epoch: int
    """Training micro-batches of one epoch."""
    eval_batches_per_epoch: int
    """Evaluation micro-batches of one epoch."""
    steps_per_epoch: int
    """Optimizer steps of one epoch (local mode: outer steps, one per window)."""
    shards_per_epoch: int
    """Shard tasks of one epoch (train and eval)."""
    batches_topic: str
    """The job's batches topic."""
    control_topic: str
    """The job's control topic."""
    batches_partitions: int
    """Partitions of the batches topic."""

    def __post_init__(self) -> None:
        for name, minimum in _PLAN_MINIMUMS.items():
            if getattr(self, name) < minimum:
                raise ValueError(f"JobPlanned.{name} must be >= {minimum}: {getattr(self, name)}")
        if len(self.sample_shape) != 3 or min(self.sample_shape) < 1:
            raise ValueError(f"JobPlanned.sample_shape must be [C, H, W] > 0: {self.sample_shape}")
        if not (self.batches_topic and self.control_topic):
            raise ValueError("JobPlanned needs the batches and control topic names")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every sample."""
        channels, height, width = self.sample_shape
        return channels, height, width


@message("CancelRequested", version=1)
@dataclass(kw_only=True, slots=True)
class CancelRequested(JobEvent):
    """Someone asked to stop the job; it turns cancelled once its services have stopped."""

    EVENT: ClassVar[str] = "cancel_requested"

    reason: str
    """Why, for people."""


@message("TrainerJoined", version=1)
@dataclass(kw_only=True, slots=True)
class TrainerJoined(JobEvent):
    """A trainer joined the job (the first one makes it running)."""

    EVENT: ClassVar[str] = "running"

    worker_id: str
    """The trainer."""


@message("TrainerProgress", version=2)
@dataclass(kw_only=True, slots=True)
class TrainerProgress(JobEvent):
    """One trainer's own figures, rate-limited (the job's totals come from the coordinator)."""

    EVENT: ClassVar[str] = "progress"

    worker_id: str
    """The trainer."""
    epoch: int
    """Epoch it works on."""
    step: int
    """Parameter version it last loaded."""
    samples_trained: int
    """Training samples it computed gradients on."""
    batches_trained: int
    """Training micro-batches it computed."""
    eval_batches: int
    """Evaluation micro-batches it evaluated."""
    duplicates: int
    """Redelivered batches it dropped."""
    contributions: int
    """Contributions it sent."""
    empty_contributions: int
    """Contributions without samples (a step it had no batch for)."""
    rejected_contributions: int
    """Contributions rejected as too stale."""
    grad_bytes: int
    """Gradient payload bytes it sent."""
    loss: float | None
    """Mean training loss of its last contribution."""
    samples_per_second: float
    """Its recent wall-clock throughput."""
    data_wait_ratio: float | None
    """Recent exposed data wait / step time (None before a step)."""
    data_wait_ratio_job: float | None
    """The same over its whole time in the job."""
    stage_latency_s: dict[str, float]
    """Median seconds per pipeline stage of its recent batches."""
    stage_latency_p95_s: dict[str, float]
    """95th percentile seconds per stage."""
    step_time_s: dict[str, float]
    """Mean seconds per part of its recent steps (``data_wait``, ``h2d``, ``compute``,
    ``grad_send``, ``param_wait``; schema v2): where a step's time goes, for the job page."""


@message("CoordinatorProgress", version=1)
@dataclass(kw_only=True, slots=True)
class CoordinatorProgress(JobEvent):
    """The job's totals from its coordinator: what the flow control and the routing of
    batches follow (the sharder) and what the gateway shows as the job's counts."""

    EVENT: ClassVar[str] = "progress"

    worker_id: str = COORDINATOR_WORKER_ID
    """Always :data:`COORDINATOR_WORKER_ID`."""
    consumed_batches: int
    """Train batches applied plus eval batches evaluated, all epochs."""
    consumed_train_batches: int
    """Train batches applied."""
    version: int
    """Current parameter version."""
    step: int
    """Steps closed."""
    epoch: int
    """Current epoch."""
    samples_trained: int
    """Training samples applied."""
    loss: float | None
    """Mean training loss of the last step."""
    routing: list[float] = dataclasses.field(default_factory=list)
    """One weight per partition of the batches topic, stamped into the shard tasks released
    from now on; empty: unweighted."""

    def __post_init__(self) -> None:
        if self.consumed_batches < 0 or self.consumed_train_batches < 0:
            raise ValueError("CoordinatorProgress counts must be >= 0")
        if self.routing and not (
            all(math.isfinite(w) and w >= 0 for w in self.routing) and sum(self.routing) > 0
        ):
            raise ValueError(f"routing weights must be finite, >= 0 with a positive sum, "
                             f"got {self.routing!r}")  # fmt: skip


@message("EpochCompleted", version=1)
@dataclass(kw_only=True, slots=True)
class EpochCompleted(JobEvent):
    """The coordinator closed an epoch and evaluated its end-of-epoch parameters."""

    EVENT: ClassVar[str] = "epoch_completed"

    epoch: int
    """The epoch, from 0."""
    version: int
    """Parameter version at its end."""
    train_loss: float | None
    """Mean training loss over the epoch."""
    eval_loss: float | None
    """Mean evaluation loss (None: no eval split)."""
    eval_accuracy: float | None
    """Evaluation accuracy in [0, 1] (None: no eval split)."""


@message("JobCompleted", version=1)
@dataclass(kw_only=True, slots=True)
class JobCompleted(JobEvent):
    """The job trained to its end; the model and ledger are written."""

    EVENT: ClassVar[str] = "completed"

    worker_id: str
    """The coordinator's process."""
    summary: dict[str, Any]
    """Epochs, steps, samples, final evaluation, throughput, data wait, output uris."""


@message("JobFailed", version=1)
@dataclass(kw_only=True, slots=True)
class JobFailed(JobEvent):
    """The job cannot go on (bad spec or dataset, a model that cannot be built, ...)."""

    EVENT: ClassVar[str] = "failed"

    reason: str
    """Why, for people."""
    worker_id: str | None = None
    """The process that failed it, when it has a worker id."""


MAX_SKIPPED_REASONS = 10
"""Reasons one ``SamplesSkipped`` event carries at most (its ids are all there)."""


@message("SamplesSkipped", version=1)
@dataclass(kw_only=True, slots=True)
class SamplesSkipped(JobEvent):
    """A preprocessor left samples of one shard out of its batches: they failed validation
    (corrupt image, bad tar member, null label...). The sharder counts the distinct ids of a
    job against ``dataset.max_bad_samples``; a redelivered shard reports the same ids again."""

    EVENT: ClassVar[str] = "samples_skipped"

    shard_id: str
    """The shard whose batches lack them."""
    sample_ids: list[int]
    """Every skipped sample id of the shard."""
    reasons: list[str]
    """``<file>: <reason>`` of the first few (at most MAX_SKIPPED_REASONS), for people."""

    def __post_init__(self) -> None:
        if not self.sample_ids or len(self.reasons) > MAX_SKIPPED_REASONS:
            raise ValueError(
                f"a SamplesSkipped names at least one sample and at most "
                f"{MAX_SKIPPED_REASONS} reasons, got {len(self.sample_ids)} and {len(self.reasons)}"
            )


@message("JobCancelled", version=1)
@dataclass(kw_only=True, slots=True)
class JobCancelled(JobEvent):
    """The job stopped after a cancel request."""

    EVENT: ClassVar[str] = "cancelled"

    reason: str
    """Why, for people."""
    worker_id: str | None = None
    """The process that stopped it, when it has a worker id."""


@message("JobResumed", version=1)
@dataclass(kw_only=True, slots=True)
class JobResumed(JobEvent):
    """The job starts again from checkpoint ``checkpoint_version`` under the same id: a failed
    or cancelled job resumed through the API, or a job the jobs topic lost brought back by the
    checkpointer. The job view revives an ended job (``pending`` again, planned anew); the
    sharder creates the topics of the new incarnation and writes a :class:`ResumePoint` first
    on its control topic. A resume of a job that has not ended is ignored."""

    EVENT: ClassVar[str] = "resumed"

    spec: dict[str, Any]
    """The job spec (JSON form), so that a sharder that forgot the ended job can plan it."""
    checkpoint_version: int
    """The checkpoint it starts from (a committed, good, usable one when it was chosen)."""
    incarnation: int
    """Resumes of the job including this one (>= 1): the job's topics and consumer groups of
    this run are named apart from earlier runs' (``Topics``, ``incarnation``)."""
    reason: str
    """Why, for people (``resumed through the API``)."""

    def __post_init__(self) -> None:
        if self.checkpoint_version < 1 or self.incarnation < 1:
            raise ValueError(f"checkpoint_version and incarnation must be >= 1, got "
                             f"{self.checkpoint_version}, {self.incarnation}")  # fmt: skip


@message("CheckpointCommitted", version=1)
@dataclass(kw_only=True, slots=True)
class CheckpointCommitted(JobEvent):
    """The checkpointer committed a checkpoint of the job (its manifest is written)."""

    EVENT: ClassVar[str] = "checkpoint"

    version: int
    """Parameter version it holds."""
    step: int
    """Optimizer steps with samples up to that version."""
    trigger: str
    """Why it was taken (``every_steps``, ``every_s``, ``epoch_end``, ``request``,
    ``job_end``)."""
    uri: str
    """URI of its manifest."""
    size_bytes: int
    """Bytes of its files."""
    seconds: float
    """From the StepClose that asked for it to the commit (a final checkpoint committed after
    its job ended with no checkpointer following it: from the job's completion)."""


@message("CheckpointFailed", version=1)
@dataclass(kw_only=True, slots=True)
class CheckpointFailed(JobEvent):
    """A checkpoint could not be committed (a slice write or the commit failed); the job goes
    on and its previous checkpoint stays the latest."""

    EVENT: ClassVar[str] = "checkpoint_failed"

    version: int
    """The version that was to be checkpointed."""
    reason: str
    """Why, for people."""


@message("CheckpointUnusable", version=1)
@dataclass(kw_only=True, slots=True)
class CheckpointUnusable(JobEvent):
    """A checkpoint was found torn or corrupt when loading it; an older one (or none) was
    used instead."""

    EVENT: ClassVar[str] = "checkpoint_unusable"

    version: int
    """The checkpoint that could not be used."""
    reason: str
    """What is wrong with it (the file and the check that failed)."""
    used_version: int | None
    """The checkpoint used instead (None: none was good; the job started over)."""
    worker_id: str
    """The process that found it."""


@message("TrainerPresence", version=1)
@dataclass(kw_only=True, slots=True)
class TrainerPresence(Message):
    """A trainer says it is in the pool, and which job it trains (the scheduler's input).

    Not a job event: keyed by the worker id. Every trainer publishes one when it starts, when
    the job it hosts changes, every ``ttl_s / 3`` seconds, and with ``leaving`` when it stops.
    A trainer whose last presence is older than its ``ttl_s`` on the log's clock (the newest
    ``at`` of the jobs topic) counts as gone (it died without saying so).
    """

    worker_id: str
    """The trainer."""
    job_id: str | None
    """The job it hosts now (also while it lets the job go); None when idle."""
    ttl_s: float
    """Seconds after ``at`` (on the log's clock) when the trainer counts as gone."""
    leaving: bool = False
    """The trainer stops: take it out of the pool now."""
    at: float = dataclasses.field(default_factory=time.time)
    """When it was sent, unix time in seconds."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("TrainerPresence.worker_id must not be empty")
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"TrainerPresence.ttl_s must be > 0: {self.ttl_s}")


TERMINAL_EVENTS: tuple[type[JobEvent], ...] = (JobCompleted, JobFailed, JobCancelled)
"""Events after which nothing more happens to a job."""
