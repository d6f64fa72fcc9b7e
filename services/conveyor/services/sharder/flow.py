"""Pure flow-control state of one job: which shard tasks may be released now.

The rule (brief, "Data-plane service design"): task ``k`` of the release sequence is released
when ``batches_before(k) - consumed < max_lead_batches``, where ``batches_before(k)`` counts the
batches of tasks ``0..k-1`` and ``consumed`` is the number of unique batches finished (train
batches applied to the model + eval batches evaluated) that the job's coordinator (the
aggregator owning the job's grads partition 0) reports in its ``progress`` events. Releases
happen in sequence order, so the released tasks are always a prefix of the sequence.
"""

from __future__ import annotations

from typing import Protocol


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
