"""Kafka topic names and the deterministic ids that key records on them."""

from __future__ import annotations

import re
from dataclasses import dataclass

SPLITS = ("train", "eval")
"""Values of the ``split`` fields."""


_TOPIC_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]*")
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True, slots=True)
class Topics:
    """Kafka topic names under one prefix (``KafkaSettings.topic_prefix``, e.g. ``"conveyor."``).

    Per-job names are ``<prefix>job.<job_id>.<kind>``. Raises ValueError for a prefix or job id
    with characters Kafka does not allow in topic names (job ids may not contain dots).
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
        """Shard tasks (:class:`ShardTask`) for the preprocessor pool, key = job id."""
        return f"{self.prefix}shards"

    @property
    def dlq(self) -> str:
        """Records that failed to decode or validate (:class:`DeadLetter`)."""
        return f"{self.prefix}dlq"

    def batches(self, job_id: str) -> str:
        """Ready batches (:class:`Batch`) of one job, key = batch id."""
        return self._job(job_id, "batches")

    def grads(self, job_id: str) -> str:
        """Gradient slices of one job; partition = slice."""
        return self._job(job_id, "grads")

    def params(self, job_id: str) -> str:
        """Parameter slices per version of one job; partition = slice."""
        return self._job(job_id, "params")

    def control(self, job_id: str) -> str:
        """Membership, heartbeats, step plans, checkpoint protocol, eval results of one job."""
        return self._job(job_id, "control")

    def job_topics(self, job_id: str) -> tuple[str, ...]:
        """Every per-job topic, created when the job is accepted and deleted when it ends."""
        return (
            self.batches(job_id),
            self.grads(job_id),
            self.params(job_id),
            self.control(job_id),
        )

    def _job(self, job_id: str, kind: str) -> str:
        if not _JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"invalid job id {job_id!r} for a topic name: use [A-Za-z0-9_-]")
        return f"{self.prefix}job.{job_id}.{kind}"


def shard_id_for(job_id: str, epoch: int, split: str, index: int) -> str:
    """Deterministic shard id: ``<job_id>:e<epoch>:<split>:<index:05d>`` (index within the
    split of that epoch, from 0)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return f"{job_id}:e{epoch}:{split}:{index:05d}"


def batch_id_for(shard_id: str, position: int) -> str:
    """Deterministic batch id: ``<shard_id>:b<position:03d>`` (position within the shard)."""
    return f"{shard_id}:b{position:03d}"
