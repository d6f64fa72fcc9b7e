"""Kafka topic names, the topic layout, consumer group ids and the deterministic ids that key
records on them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

SPLITS = ("train", "eval")
"""Values of the ``split`` fields."""


_TOPIC_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]*")
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")

DLQ_PARTITIONS = 1
"""Partitions of the dead-letter topic: people read it, no consumer group shares it."""
AUTOSCALER_PARTITIONS = 1
"""Partitions of the autoscaler's topic: its decisions are read as one log, in order."""
CONTROL_PARTITIONS = 1
"""Partitions of a job's control topic: every reader folds the whole log in one order."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic to create: its name, partition count and extra configs."""

    name: str
    """Full topic name, prefix included."""
    partitions: int = 1
    """Number of partitions (>= 1); the upper bound of a consumer group's parallelism."""
    config: Mapping[str, str] = field(default_factory=dict)
    """Extra topic configs; they override the bus defaults (``max.message.bytes``)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("topic name must not be empty")
        if self.partitions < 1:
            raise ValueError(f"topic {self.name!r}: partitions must be >= 1, got {self.partitions}")


@dataclass(frozen=True, slots=True)
class Topics:
    """Kafka topic names under one prefix (``KafkaSettings.topic_prefix``, e.g. ``"conveyor."``).

    Per-job names are ``<prefix>job.<job_id>.<kind>``; a resumed job's incarnation ``n >= 1``
    gets fresh ones, ``<prefix>job.<job_id>.r<n>.<kind>`` (and groups), so that nothing an
    earlier incarnation left (a late writer, committed offsets) can reach it. Raises
    ValueError for a prefix or job id with characters Kafka does not allow in topic names (job
    ids may not contain dots).

    Also the topic layout (:meth:`global_topics`, :meth:`job_topic_specs`: what the sharder,
    the one owner of the topics, creates; every other service waits for them) and the consumer
    group ids, ``<prefix without its trailing dot>-<role>`` (``conveyor-sharder`` under the
    default prefix), so that stacks sharing a cluster under different prefixes never share a
    group.
    """

    prefix: str
    """Prepended verbatim, so it carries its own separator: ``"conveyor."``."""

    def __post_init__(self) -> None:
        if not _TOPIC_PREFIX_RE.fullmatch(self.prefix) or len(self.prefix) > 100:
            raise ValueError(f"invalid topic prefix {self.prefix!r}: use [A-Za-z0-9._-], <= 100")

    @property
    def jobs(self) -> str:
        """Job lifecycle events (:class:`JobEvent`), key = job id."""
        return f"{self.prefix}jobs"

    @property
    def shards(self) -> str:
        """Shard tasks (:class:`ShardTask`) for the preprocessor pool, key = shard id."""
        return f"{self.prefix}shards"

    @property
    def autoscaler(self) -> str:
        """The autoscaler's decisions and its supervisor's restarts (:class:`ScalingDecision`,
        :class:`ServiceRestarted`), read by the gateway, and the preprocessors' busy reports
        (:class:`PreprocessorLoad`), read by the autoscaler."""
        return f"{self.prefix}autoscaler"

    @property
    def dlq(self) -> str:
        """Records that failed to decode or validate (:class:`DeadLetter`)."""
        return f"{self.prefix}dlq"

    def batches(self, job_id: str, *, incarnation: int = 0) -> str:
        """Ready batches (:class:`Batch`) of one job, key = batch id."""
        return self._job(job_id, "batches", incarnation)

    def grads(self, job_id: str, *, incarnation: int = 0) -> str:
        """Gradient slices of one job; partition = slice."""
        return self._job(job_id, "grads", incarnation)

    def params(self, job_id: str, *, incarnation: int = 0) -> str:
        """Parameter slices per version of one job; partition = slice."""
        return self._job(job_id, "params", incarnation)

    def control(self, job_id: str, *, incarnation: int = 0) -> str:
        """Membership, heartbeats, step plans, checkpoint protocol, eval results of one job."""
        return self._job(job_id, "control", incarnation)

    def job_topics(self, job_id: str, *, incarnation: int = 0) -> tuple[str, ...]:
        """Every per-job topic, created when the job is accepted and deleted when it ends."""
        return (
            self.batches(job_id, incarnation=incarnation),
            self.grads(job_id, incarnation=incarnation),
            self.params(job_id, incarnation=incarnation),
            self.control(job_id, incarnation=incarnation),
        )

    def global_topics(
        self, *, jobs_partitions: int, shards_partitions: int
    ) -> tuple[TopicSpec, ...]:
        """The topics every job shares, created once by the sharder: jobs, shards (its
        partitions bound the preprocessors that work at once), the autoscaler's log (one
        partition: one log in decision order) and the dead-letter topic."""
        return (
            TopicSpec(self.jobs, partitions=jobs_partitions),
            TopicSpec(self.shards, partitions=shards_partitions),
            TopicSpec(self.autoscaler, partitions=AUTOSCALER_PARTITIONS),
            TopicSpec(self.dlq, partitions=DLQ_PARTITIONS),
        )

    def job_topic_specs(
        self, job_id: str, *, batches_partitions: int, slices: int, incarnation: int = 0
    ) -> tuple[TopicSpec, ...]:
        """The topics of one job (:meth:`job_topics`), created by the sharder when it plans the
        job: ``batches_partitions`` for its batches, one partition per parameter slice for its
        grads and params (partition p = slice p), one for its control log."""
        n = incarnation
        return (
            TopicSpec(self.batches(job_id, incarnation=n), partitions=batches_partitions),
            TopicSpec(self.control(job_id, incarnation=n), partitions=CONTROL_PARTITIONS),
            TopicSpec(self.grads(job_id, incarnation=n), partitions=slices),
            TopicSpec(self.params(job_id, incarnation=n), partitions=slices),
        )

    @property
    def sharder_group(self) -> str:
        """Consumer group of the sharders on the jobs topic (a job's partition picks its
        sharder; a rebalance is failover)."""
        return self._group("sharder")

    @property
    def preprocessor_group(self) -> str:
        """Consumer group of the preprocessor pool on the shards topic."""
        return self._group("preprocessors")

    def trainer_group(self, job_id: str, *, incarnation: int = 0) -> str:
        """Consumer group of a job's trainers on its batches topic."""
        return self._group(f"trainer.{job_id}{_suffix(incarnation)}")

    def aggregator_group(self, job_id: str, *, incarnation: int = 0) -> str:
        """Consumer group of a job's aggregators on its grads topic: the assignment of the grads
        partitions is the ownership of the parameter slices."""
        return self._group(f"aggregator.{job_id}{_suffix(incarnation)}")

    def _group(self, role: str) -> str:
        return f"{self.prefix.rstrip('.') or 'conveyor'}-{role}"

    def _job(self, job_id: str, kind: str, incarnation: int) -> str:
        if not _JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"invalid job id {job_id!r} for a topic name: use [A-Za-z0-9_-]")
        return f"{self.prefix}job.{job_id}{_suffix(incarnation)}.{kind}"


def _suffix(incarnation: int) -> str:
    """What names a resumed job's topics and groups apart from its earlier incarnations'
    (none for the first: ``job.<id>.control``, then ``job.<id>.r1.control``, ...)."""
    if incarnation < 0:
        raise ValueError(f"incarnation must be >= 0, got {incarnation}")
    return f".r{incarnation}" if incarnation else ""


def shard_id_for(job_id: str, epoch: int, split: str, index: int) -> str:
    """Deterministic shard id: ``<job_id>:e<epoch>:<split>:<index:05d>`` (index within the
    split of that epoch, from 0)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return f"{job_id}:e{epoch}:{split}:{index:05d}"


def batch_id_for(shard_id: str, position: int) -> str:
    """Deterministic batch id: ``<shard_id>:b<position:03d>`` (position within the shard)."""
    return f"{shard_id}:b{position:03d}"
