"""Pure flow-control state of one job: which shard tasks may be released now.

The rule (brief, "Data-plane service design"): task ``k`` of the release sequence is released
when ``batches_before(k) - consumed < max_lead_batches``, where ``batches_before(k)`` counts the
batches of tasks ``0..k-1`` and ``consumed`` is the number of unique batches finished (train
batches applied to the model + eval batches evaluated) that the job's coordinator (the
aggregator owning the job's grads partition 0) reports in its ``progress`` events. Releases
happen in sequence order, so the released tasks are always a prefix of the sequence.

A resumed job runs the same rule over the tasks it still needs (:class:`RemainingSequence`)
with the batches consumed since its resume.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from conveyor.platform.messages import ResumePoint, batch_id_for
from conveyor.training.plan import JobPlan


class ReleaseSequence(Protocol):
    """What flow control needs from a plan (:class:`~.plan.JobPlan` provides it)."""

    @property
    def num_tasks(self) -> int: ...

    def batches_before(self, task_index: int) -> int: ...

    def first_unconsumed_task(self, consumed_batches: int) -> int: ...


class FlowControl:
    """The release cursor of one job.

    Backlog bound: while ``consumed`` does not decrease, after every :meth:`mark_released`
    the batches of released tasks that are not consumed satisfy::

        batches_before(next_task) - consumed <= max_lead_batches - 1 + max_shard_batches

    because the last task released started below the lead (``batches_before(k) - consumed <=
    max_lead_batches - 1``) and adds at most ``max_shard_batches``. Before any release the
    backlog is 0. The cursor never moves back; it jumps forward to
    ``first_unconsumed_task(consumed)`` (tasks whose batches were all consumed were released,
    e.g. by the sharder before a restart), so a restart re-releases at most the lead.
    """

    __slots__ = ("_next_task", "max_lead_batches", "sequence")

    def __init__(self, sequence: ReleaseSequence, *, max_lead_batches: int) -> None:
        if max_lead_batches < 1:
            raise ValueError(f"max_lead_batches must be >= 1, got {max_lead_batches}")
        self.sequence = sequence
        self.max_lead_batches = max_lead_batches
        self._next_task = 0

    @property
    def next_task(self) -> int:
        """Index of the next task to release (``num_tasks`` when all are released)."""
        return self._next_task

    @property
    def finished(self) -> bool:
        """Every task of the sequence was released."""
        return self._next_task >= self.sequence.num_tasks

    @property
    def released_batches(self) -> int:
        """Batches in the released tasks."""
        return self.sequence.batches_before(self._next_task)

    def lead_batches(self, consumed: int) -> int:
        """Released batches not consumed yet (>= 0)."""
        return max(0, self.released_batches - consumed)

    def releasable(self, consumed: int) -> range:
        """Task indices that may be released now, in order (empty when none may)."""
        start = max(self._next_task, self.sequence.first_unconsumed_task(consumed))
        end = start
        num_tasks, batches_before = self.sequence.num_tasks, self.sequence.batches_before
        while end < num_tasks and batches_before(end) - consumed < self.max_lead_batches:
            end += 1
        return range(start, end)

    def mark_released(self, tasks: range) -> None:
        """Advance the cursor past ``tasks`` (a result of :meth:`releasable`) once they were
        published; tasks skipped before ``tasks.start`` count as released."""
        if tasks.stop > self.sequence.num_tasks:
            raise ValueError(f"task {tasks.stop - 1} is past the end of the sequence")
        self._next_task = max(self._next_task, tasks.stop)


class RemainingSequence:
    """The release sequence of a resumed job: the plan's tasks that still have batches to do,
    each counting only those (:func:`remaining_tasks`), in the plan's order. Flow control runs
    on it with the batches consumed *since the resume*, so batches done before the resume
    neither hold releases back nor let the backlog grow."""

    __slots__ = ("_prefix", "tasks")

    def __init__(self, tasks: list[tuple[int, int]]) -> None:
        """``tasks``: (plan task index, batches left to do > 0), in release order."""
        self.tasks = [index for index, _ in tasks]
        self._prefix = [0]
        for _, batches in tasks:
            self._prefix.append(self._prefix[-1] + batches)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def batches_before(self, task_index: int) -> int:
        return self._prefix[task_index]

    def first_unconsumed_task(self, consumed_batches: int) -> int:
        """The first task ``k`` with ``batches_before(k + 1) > consumed_batches``."""
        return bisect.bisect_right(self._prefix, max(0, consumed_batches)) - 1


def remaining_tasks(plan: JobPlan, point: ResumePoint) -> list[tuple[int, int]]:
    """(plan task index, batches left) of every task a job resumed at ``point`` still needs,
    in release order: train tasks of the epochs not ended, less their applied batches, and
    the eval tasks of every epoch not evaluated."""
    ended = {e.epoch: e for e in point.ended_epochs}
    applied = set(point.applied_batches)
    tasks: list[tuple[int, int]] = []
    for index in range(plan.tasks_per_epoch * len(ended), plan.num_tasks):
        shard = plan.task(index)
        if shard.split == "train":
            batch_ids = (batch_id_for(shard.shard_id, b) for b in range(shard.num_batches))
            left = sum(1 for batch_id in batch_ids if batch_id not in applied)
        else:
            left = shard.num_batches
        if left:
            tasks.append((index, left))
    for epoch, outcome in sorted(ended.items()):
        if not outcome.evaluated:  # it ended at the resume version: evaluate it there
            first = epoch * plan.tasks_per_epoch + plan.train_shards_per_epoch
            eval_tasks = range(first, (epoch + 1) * plan.tasks_per_epoch)
            tasks.extend((k, plan.task(k).num_batches) for k in eval_tasks)
    return sorted(tasks)


def batches_done(plan: JobPlan, point: ResumePoint) -> int:
    """Batches a job resumed at ``point`` counts as consumed at once (its coordinator's
    ``consumed_batches`` then): train batches applied, eval batches of evaluated epochs."""
    evaluated = sum(1 for e in point.ended_epochs if e.evaluated)
    return (
        len(point.ended_epochs) * plan.train_batches_per_epoch
        + len(point.applied_batches)
        + evaluated * plan.eval_batches_per_epoch
    )
