"""What the checkpointer knows about one job's checkpoints: a pure fold of its control log.

Folded: every StepClose (which versions ask for a checkpoint, and the data cursor at each
version: the epoch, the train batches of that epoch already applied, steps and samples) and
every SliceSaved. A checkpointed version is *ready* once each of its K slices is announced as
saved; *failed* once one slice announces an error. The time trigger (``checkpoint.every_s``)
is *due* when that long passed since the last checkpointed StepClose (or since the job was
first seen) and no request is pending. A resumed job's ``ResumePoint`` (its log's first record)
starts the fold at the checkpoint's version and data cursor.

What a manifest records of a version beside its files is a :class:`Checkpointed`: from the book
(:meth:`CheckpointBook.checkpointed`), or, for a job that completed while no checkpointer read
its log, from its final slice files (:func:`final_checkpointed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from conveyor.platform.messages import (
    CheckpointRequest,
    Message,
    ResumePoint,
    SliceSaved,
    StepClose,
)
from conveyor.training.checkpoint import DataCursor, JobProgress, SliceFile
from conveyor.training.plan import parse_batch_id


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpointed:
    """What the manifest of a checkpointed version says beside its files."""

    version: int
    step: int
    """Optimizer steps with samples up to ``version``."""
    trigger: str
    """Why it was taken (``StepClose.checkpoint``)."""
    data_cursor: DataCursor
    asked_at: float
    """Unix s from which its commit latency counts: the close of the StepClose that asked for
    it (for :func:`final_checkpointed`: the job's completion, that StepClose being gone)."""


@dataclass(slots=True)
class _Cursor:
    epoch: int = 0
    """Lowest epoch whose train batches are not all applied."""
    applied: dict[int, list[str]] = field(default_factory=dict)
    """Epoch (>= ``epoch``) -> its train batches applied so far."""
    steps: int = 0
    samples: int = 0

    @classmethod
    def resumed(
        cls, *, ended_epochs: int, steps: int, samples: int, applied_batches: list[str]
    ) -> _Cursor:
        """The cursor at a version whose progress is known (a resume point, a slice file):
        ``ended_epochs`` epochs ended (0..n-1), ``applied_batches`` of the later ones in."""
        cursor = cls(epoch=ended_epochs, steps=steps, samples=samples)
        for batch_id in applied_batches:
            cursor.applied.setdefault(parse_batch_id(batch_id).epoch, []).append(batch_id)
        return cursor

    def data_cursor(self) -> DataCursor:
        return DataCursor(
            epoch=self.epoch,
            applied_batches=[b for e in sorted(self.applied) for b in self.applied[e]],
            samples_trained=self.samples,
        )


class CheckpointBook:
    """See the module docstring. Not thread-safe."""

    def __init__(
        self, *, job_id: str, num_slices: int, train_batches_per_epoch: int, started_at: float
    ) -> None:
        self.job_id = job_id
        self.num_slices = num_slices
        self.train_batches_per_epoch = train_batches_per_epoch
        self.requested: dict[int, StepClose] = {}
        """Checkpointed version -> its StepClose."""
        self.cursors: dict[int, tuple[DataCursor, int]] = {}
        """Checkpointed version -> (data cursor, steps) at that version."""
        self.saved: dict[int, dict[int, SliceSaved]] = {}
        self.done: set[int] = set()
        """Versions committed or reported failed by this process."""
        self.floor = 0
        """Versions up to this one are settled already (committed before this process
        started, or older than such a commit: retention may have removed their files)."""
        self._cursor = _Cursor()
        self._version = 0
        self._last_trigger_at = started_at
        self._timer_pending = False

    FOLDED: ClassVar[tuple[type[Message], ...]] = (
        StepClose,
        SliceSaved,
        CheckpointRequest,
        ResumePoint,
    )
    """The control records :meth:`fold` applies; the service reads only these (the others,
    the trainers' Contributions among them, are not decoded, so it never loads torch)."""

    def fold(self, message: Message) -> None:
        """Apply one control record (other types and jobs are ignored)."""
        if getattr(message, "job_id", None) != self.job_id:
            return
        if isinstance(message, StepClose):
            self._fold_close(message)
        elif isinstance(message, SliceSaved):
            self.saved.setdefault(message.version, {}).setdefault(message.slice_index, message)
        elif isinstance(message, CheckpointRequest):
            self._timer_pending = True
        elif isinstance(message, ResumePoint) and self._version == 0:
            self._version = message.version
            self._cursor = _Cursor.resumed(
                ended_epochs=len(message.ended_epochs),
                steps=message.steps,
                samples=message.samples_trained,
                applied_batches=message.applied_batches,
            )

    def _fold_close(self, close: StepClose) -> None:
        if close.version != self._version + 1:
            return  # a duplicate from a coordinator failover race: the first one counts
        self._version = close.version
        cursor = self._cursor
        for batch_id in close.batch_ids:
            ref = parse_batch_id(batch_id)
            if ref.split == "train" and ref.epoch >= cursor.epoch:
                cursor.applied.setdefault(ref.epoch, []).append(batch_id)
        if close.num_samples > 0:
            cursor.steps += 1
            cursor.samples += close.num_samples
        while len(cursor.applied.get(cursor.epoch, ())) >= self.train_batches_per_epoch:
            del cursor.applied[cursor.epoch]
            cursor.epoch += 1
        if close.checkpoint is not None:
            self.requested[close.version] = close
            self.cursors[close.version] = (cursor.data_cursor(), cursor.steps)
            self._last_trigger_at = close.closed_at
            self._timer_pending = False

    def ready(self) -> list[int]:
        """Checkpointed versions whose slices are all saved, not done yet, oldest first."""
        return [
            v
            for v in sorted(self.requested)
            if v > self.floor
            and v not in self.done
            and len(self.saved.get(v, {})) >= self.num_slices
            and not self.errors(v)
        ]

    def failed(self) -> list[int]:
        """Checkpointed versions a slice failed to save, not done yet."""
        return [
            v
            for v in sorted(self.requested)
            if v > self.floor and v not in self.done and self.errors(v)
        ]

    def errors(self, version: int) -> list[str]:
        return [
            f"slice {p}: {s.error}"
            for p, s in sorted(self.saved.get(version, {}).items())
            if s.error
        ]

    def checkpointed(self, version: int) -> Checkpointed:
        """What the manifest of requested ``version`` says beside its files."""
        close = self.requested[version]
        cursor, steps = self.cursors[version]
        return Checkpointed(
            version=version,
            step=steps,
            trigger=close.checkpoint or "request",
            data_cursor=cursor,
            asked_at=close.closed_at,
        )

    def files(self, version: int) -> list[SliceFile]:
        """The files a ready version's manifest lists."""
        files = [self.file(version, p) for p in range(self.num_slices)]
        return [f for f in files if f is not None]

    def file(self, version: int, index: int) -> SliceFile | None:
        """The file slice ``index`` announced as saved for ``version`` (None: not announced,
        or failed)."""
        saved = self.saved.get(version, {}).get(index)
        if saved is None or saved.error:
            return None
        return SliceFile(
            slice_index=index,
            key=saved.key,
            size_bytes=saved.size_bytes,
            sha256=saved.sha256,
            grads_offset=saved.grads_offset,
        )

    def timer_due(self, every_s: float | None, now: float) -> bool:
        """Whether to ask for an ``every_s`` checkpoint now (then call :meth:`timer_sent`)."""
        return (
            every_s is not None
            and not self._timer_pending
            and now - self._last_trigger_at >= every_s
        )

    def timer_sent(self) -> None:
        self._timer_pending = True

    def last_unfinished(self) -> int | None:
        """The newest checkpointed version not done (at the job's end: the final one)."""
        pending = [v for v in self.requested if v > self.floor and v not in self.done]
        return max(pending, default=None)


def final_checkpointed(progress: JobProgress, *, completed_at: float) -> Checkpointed:
    """The final checkpoint of a completed job, from the job progress in its slice 0 file,
    for when its control log was never read (no checkpointer hosted the job at its end).

    Known exactly: the version, step and data cursor (the coordinator's own snapshot at that
    version, under the file's checksum; the same as the fold of the log gives) and the
    trigger, ``job_end`` (the coordinator checkpoints the close that ends training as such,
    and closes nothing after it). Not known: when that StepClose closed; ``asked_at`` is the
    job's completion (``completed_at``, unix s), which comes after it.
    """
    cursor = _Cursor.resumed(
        ended_epochs=len(progress.ended),
        steps=progress.steps,
        samples=progress.samples_trained,
        applied_batches=progress.applied_batches,
    )
    return Checkpointed(
        version=progress.version,
        step=cursor.steps,
        trigger="job_end",
        data_cursor=cursor.data_cursor(),
        asked_at=completed_at,
    )
