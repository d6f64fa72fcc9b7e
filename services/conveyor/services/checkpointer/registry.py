"""The registry of live jobs: what survives a restart of the whole stack, broker included.

The jobs topic is the job registry while the broker keeps it; the embedded broker keeps it in
memory only. So the checkpointer also keeps one object per job that is not finished (pending,
planned or running, resumes included) in the stack's object store, under
``registry/jobs/<job id>.json``: the job's spec and incarnation. :func:`registry_changes` (pure)
compares the entries with the job view: entries to write (a live job without one, or of an older
incarnation), entries to delete (the job ended), and *lost* jobs (an entry, and no job in a view
that read the whole jobs topic: the topic was lost with the broker).

When the checkpointer starts on such a topic it brings each lost job back
(:func:`recovery_event`): a ``JobResumed`` from its newest usable checkpoint as a new
incarnation, or, with none, its ``JobSubmitted`` again (it starts over). Several checkpointers
may do it at once: a second resume of a job that is not ended is ignored by everyone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from conveyor.platform.messages import JobEvent, JobResumed, JobSubmitted
from conveyor.platform.storage import ObjectNotFound, ObjectStore
from conveyor.training.checkpoint import CheckpointStore, resume_point
from conveyor.training.jobview import JobsView

logger = logging.getLogger(__name__)

REGISTRY_PREFIX = "registry/jobs/"


@dataclass(frozen=True, kw_only=True, slots=True)
class RegistryEntry:
    """One live job."""

    job_id: str
    spec: dict[str, Any]
    """The job spec (JSON form)."""
    incarnation: int
    """Its resumes so far when the entry was written."""

    def to_json(self) -> bytes:
        return json.dumps(
            {"job_id": self.job_id, "spec": self.spec, "incarnation": self.incarnation}
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RegistryEntry:
        """ValueError for anything but what :meth:`to_json` writes."""
        try:
            raw = json.loads(data)
            entry = cls(job_id=raw["job_id"], spec=raw["spec"], incarnation=raw["incarnation"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed registry entry: {exc}") from exc
        if not isinstance(entry.spec, dict) or type(entry.incarnation) is not int:
            raise ValueError("malformed registry entry: spec or incarnation")
        return entry


@dataclass(slots=True)
class Changes:
    """What :func:`registry_changes` found."""

    write: list[RegistryEntry] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    lost: list[RegistryEntry] = field(default_factory=list)


def registry_changes(view: JobsView, entries: dict[str, RegistryEntry]) -> Changes:
    """Compare the entries (by job id) with a view that read the whole jobs topic."""
    changes = Changes()
    for job in view.list(limit=len(view) or 1):
        entry = entries.get(job.job_id)
        if job.terminal:
            if entry is not None:
                changes.delete.append(job.job_id)
        elif entry is None or entry.incarnation != job.incarnation:
            changes.write.append(
                RegistryEntry(job_id=job.job_id, spec=job.spec, incarnation=job.incarnation)
            )
    changes.lost = [e for job_id, e in sorted(entries.items()) if view.get(job_id) is None]
    return changes


class JobRegistry:
    """The entries in ``store`` (blocking I/O: call from a thread)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def entries(self) -> dict[str, RegistryEntry]:
        """Every readable entry by job id (a malformed one is logged and left out)."""
        found: dict[str, RegistryEntry] = {}
        for key in self.store.list(REGISTRY_PREFIX):
            try:
                entry = RegistryEntry.from_json(self.store.get_bytes(key))
            except ObjectNotFound:
                continue  # deleted meanwhile
            except ValueError as exc:
                logger.warning("registry: %s: %s", key, exc)
                continue
            found[entry.job_id] = entry
        return found

    def write(self, entry: RegistryEntry) -> None:
        self.store.put_bytes(f"{REGISTRY_PREFIX}{entry.job_id}.json", entry.to_json())

    def delete(self, job_id: str) -> None:
        self.store.delete(f"{REGISTRY_PREFIX}{job_id}.json")


def recovery_event(entry: RegistryEntry, checkpoints: CheckpointStore) -> JobEvent:
    """What brings a lost job back (module docstring; blocking: reads its checkpoints)."""
    progress, refused = resume_point(checkpoints)
    if progress is None:
        logger.warning("job %s: no checkpoint to resume from (%s); it starts over",
                       entry.job_id, "; ".join(refused) or "none committed")  # fmt: skip
        return JobSubmitted(job_id=entry.job_id, spec=entry.spec)
    return JobResumed(
        job_id=entry.job_id,
        spec=entry.spec,
        checkpoint_version=progress.version,
        incarnation=entry.incarnation + 1,
        reason="recovered after the jobs topic was lost",
    )
