"""What the checkpointer knows about one job's checkpoints: a pure fold of its control log.

Folded: every StepClose (which versions ask for a checkpoint, and the data cursor at each
version: the epoch, the train batches of that epoch already applied, steps and samples) and
every SliceSaved. A checkpointed version is *ready* once each of its K slices is announced as
saved; *failed* once one slice announces an error. The time trigger (``checkpoint.every_s``)
is *due* when that long passed since the last checkpointed StepClose (or since the job was
first seen) and no request is pending. A resumed job's ``ResumePoint`` (its log's first record)
starts the fold at the checkpoint's version and data cursor.
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
from conveyor.training.checkpoint import DataCursor, SliceFile
from conveyor.training.plan import parse_batch_id


@dataclass(slots=True)
class _Cursor:
    epoch: int = 0
    """Lowest epoch whose train batches are not all applied."""
    applied: dict[int, list[str]] = field(default_factory=dict)
    """Epoch (>= ``epoch``) -> its train batches applied so far."""
    steps: int = 0
    samples: int = 0

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
            self._cursor = _Cursor(
                epoch=len(message.ended_epochs),
                steps=message.steps,
                samples=message.samples_trained,
            )
            for batch_id in message.applied_batches:
                self._cursor.applied.setdefault(parse_batch_id(batch_id).epoch, []).append(batch_id)

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
