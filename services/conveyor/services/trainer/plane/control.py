"""A job's control log as one trainer needs it (pure fold: no I/O, no torch).

The control topic is read by everyone from the beginning, in order. Folding it tells a trainer:

- the current parameter version (the latest StepClose) and its next micro-batch allocation;
- which batches are applied (train: listed in a StepClose) or covered (eval: in an EvalResult),
  so it acknowledges them and skips redeliveries;
- when each epoch ended globally: epoch E ends at the version whose StepClose brings the count
  of applied train batches of E to ``train_batches_per_epoch``; later-epoch batches wait for it,
  and E's eval batches are evaluated on the parameters of that version;
- the outcome of its own contributions (applied in version v, or rejected) and the highest
  contribution sequence its worker id used (a restarted trainer continues after it);
- which trainers are alive (a heartbeat within ``member_timeout_s``, by the sender's clock).

A resumed job's log starts with a ``ResumePoint``: the fold starts from its version, ended
epochs (evaluated or not) and the open epochs' applied batches, as if it had read the log up
to there.

Per-epoch id sets are dropped once the epoch's part is complete (every id of an ended epoch is
applied), so the state stays proportional to the open epochs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass

from conveyor.platform.messages import (
    Contribution,
    EvalResult,
    Heartbeat,
    Message,
    Rejection,
    ResumePoint,
    StepClose,
)
from conveyor.training.plan import parse_batch_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Applied:
    """A contribution went into version ``version``."""

    version: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """A contribution was not applied (and never will be)."""

    reason: str


Outcome = Applied | Rejected


class ControlState:
    """The fold; feed every control message in log order to :meth:`apply`."""

    def __init__(
        self,
        *,
        worker_id: str,
        epochs: int,
        train_batches_per_epoch: int,
        eval_batches_per_epoch: int,
        member_timeout_s: float,
    ) -> None:
        if epochs < 1 or train_batches_per_epoch < 1 or eval_batches_per_epoch < 0:
            raise ValueError("epochs and train batches per epoch must be >= 1, eval >= 0")
        self.worker_id = worker_id
        self.epochs = epochs
        self.train_batches_per_epoch = train_batches_per_epoch
        self.eval_batches_per_epoch = eval_batches_per_epoch
        self.member_timeout_s = member_timeout_s
        self.version = 0
        """The latest closed version (0: the seeded initialisation)."""
        self.allocation: dict[str, int] = {}
        """The latest StepClose's allocation (empty before the first)."""
        self.epoch_end: dict[int, int] = {}
        """Ended epochs -> the version at which they ended."""
        self.last_sequence = -1
        """Highest contribution sequence this worker id used (-1: none)."""
        self.steps = 0
        """StepCloses with samples."""
        self.applied_train_batches = 0
        """Train batches in StepCloses, all epochs."""
        self._train: dict[int, set[str]] = {}
        """Open epochs -> ids of their train batches applied so far."""
        self._eval: dict[int, set[str]] = {}
        """Epochs whose eval is not fully covered -> eval batch ids covered so far."""
        self._eval_done: set[int] = set()
        self._outcomes: dict[str, Outcome] = {}
        self._heartbeats: dict[str, float] = {}
        self._lowest_partition: dict[str, float] = {}
        """Worker -> the lowest batches partition of its latest heartbeat (inf: none)."""
        self._undecided: dict[str, float] = {}
        """Non-empty contributions (any trainer) on the log, not decided yet -> sent_at."""

    # -- folding ------------------------------------------------------------------------------

    def apply(self, message: Message) -> None:
        """Fold one message (other types are ignored)."""
        if isinstance(message, StepClose):
            self._close(message)
        elif isinstance(message, Rejection):
            self._undecided.pop(message.contribution_id, None)
            # A Rejection of a contribution a StepClose applied is void (a failover race).
            if message.worker_id == self.worker_id and not isinstance(
                self._outcomes.get(message.contribution_id), Applied
            ):
                self._outcomes[message.contribution_id] = Rejected(message.reason)
        elif isinstance(message, EvalResult):
            self._cover(message.epoch, message.batch_ids)
        elif isinstance(message, Contribution):
            if message.num_samples > 0:
                self._undecided[message.contribution_id] = message.sent_at
            if message.worker_id == self.worker_id:
                self.last_sequence = max(self.last_sequence, _sequence(message.contribution_id))
        elif isinstance(message, Heartbeat):
            if message.leaving:
                self._heartbeats.pop(message.worker_id, None)
            else:
                self._heartbeats[message.worker_id] = message.at
                owned = message.state.batches_partitions
                self._lowest_partition[message.worker_id] = min(owned, default=math.inf)
        elif isinstance(message, ResumePoint):
            self._resume(message)

    def _resume(self, point: ResumePoint) -> None:
        if self.version != 0:  # it is the log's first record: a second one is a bug
            logger.warning("ignoring a ResumePoint at version %d", self.version)
            return
        self.version, self.steps = point.version, point.steps
        for ended in point.ended_epochs:
            self.epoch_end[ended.epoch] = ended.version
            self.applied_train_batches += self.train_batches_per_epoch
            if ended.evaluated or self.eval_batches_per_epoch == 0:
                self._eval_done.add(ended.epoch)
        for batch_id in point.applied_batches:
            epoch = _epoch_of(batch_id, "train")
            if epoch is not None and epoch not in self.epoch_end:
                self._train.setdefault(epoch, set()).add(batch_id)
                self.applied_train_batches += 1

    def _close(self, close: StepClose) -> None:
        if close.version != self.version + 1:  # the first close of each version wins
            logger.warning("ignoring StepClose of version %d at %d", close.version, self.version)
            return
        self.version = close.version
        self.allocation = dict(close.allocation)
        if close.num_samples > 0:
            self.steps += 1
        for entry in close.contributions:
            self._undecided.pop(entry.contribution_id, None)
            if entry.worker_id == self.worker_id:
                self._outcomes[entry.contribution_id] = Applied(close.version)
        for batch_id in close.batch_ids:
            epoch = _epoch_of(batch_id, "train")
            if epoch is None or epoch in self.epoch_end:
                continue
            applied = self._train.setdefault(epoch, set())
            if batch_id in applied:
                continue
            applied.add(batch_id)
            self.applied_train_batches += 1
            if len(applied) >= self.train_batches_per_epoch:
                del self._train[epoch]
                self.epoch_end[epoch] = close.version
                if self.eval_batches_per_epoch == 0:
                    self._eval_done.add(epoch)

    def _cover(self, epoch: int, batch_ids: list[str]) -> None:
        if epoch in self._eval_done:
            return
        covered = self._eval.setdefault(epoch, set())
        covered.update(batch_ids)
        if len(covered) >= self.eval_batches_per_epoch:
            del self._eval[epoch]
            self._eval_done.add(epoch)

    # -- questions ----------------------------------------------------------------------------

    @property
    def current_epoch(self) -> int:
        """The lowest epoch that has not ended (``epochs`` once every one has)."""
        epoch = 0
        while epoch in self.epoch_end:
            epoch += 1
        return min(epoch, self.epochs)

    @property
    def train_done(self) -> bool:
        """Every epoch's train batches are applied."""
        return self.current_epoch >= self.epochs

    def epoch_ended(self, epoch: int) -> bool:
        return epoch in self.epoch_end

    def train_left(self, epoch: int) -> int:
        """Train batches of ``epoch`` that no StepClose applied yet (0 once it ended)."""
        if epoch in self.epoch_end:
            return 0
        return self.train_batches_per_epoch - len(self._train.get(epoch, ()))

    def eval_done(self, epoch: int) -> bool:
        """Every eval batch of ``epoch`` is covered by some EvalResult."""
        return epoch in self._eval_done

    def is_applied(self, batch_id: str, epoch: int) -> bool:
        """Train batch ``batch_id`` of ``epoch`` is in some StepClose."""
        if epoch in self.epoch_end:
            return True
        return batch_id in self._train.get(epoch, ())

    def is_covered(self, batch_id: str, epoch: int) -> bool:
        """Eval batch ``batch_id`` of ``epoch`` is in some EvalResult."""
        if epoch in self._eval_done:
            return True
        return batch_id in self._eval.get(epoch, ())

    def is_done(self, batch_id: str, epoch: int, split: str) -> bool:
        """The batch's effect is on the log: it can be acknowledged and never redone."""
        if split == "train":
            return self.is_applied(batch_id, epoch)
        return self.is_covered(batch_id, epoch)

    def outcome(self, contribution_id: str) -> Outcome | None:
        """What became of this worker's contribution, None while undecided."""
        return self._outcomes.get(contribution_id)

    def forget(self, contribution_id: str) -> None:
        """Drop a decided outcome (the caller acted on it)."""
        self._outcomes.pop(contribution_id, None)

    def undecided(self, now: float) -> int:
        """Non-empty contributions on the log that no StepClose or Rejection decided yet, sent
        in the last ``member_timeout_s`` (older ones are left out: their decision may never
        come, e.g. a duplicate id the coordinator ignores)."""
        return sum(1 for at in self._undecided.values() if now - at <= self.member_timeout_s)

    def live_trainers(self, now: float) -> set[str]:
        """Trainers with a heartbeat in the last ``member_timeout_s`` (unix ``now``), and
        this one."""
        live = {w for w, at in self._heartbeats.items() if now - at <= self.member_timeout_s}
        live.add(self.worker_id)
        return live

    def micro_batches_for(
        self, micro_batches_per_step: int, now: float, *, placed: Collection[str] = ()
    ) -> int:
        """This trainer's micro-batches for the next step: the latest allocation's, which may
        be 0 (more trainers than micro-batches per step take turns; the coordinator's
        allocation sums to the step, so the global batch holds). Before the first allocation,
        an equal split over the live trainers and the ``placed`` ones (those the schedule puts
        on the job, known from the jobs topic before their first heartbeat here) in the
        coordinator's turn order (lowest batches partition, then id: the first
        ``micro_batches_per_step % n`` take one more; 0 for the rest when there are more
        trainers than micro-batches); a trainer that joined later is missing from it and
        takes 0 until the next close names it (its empty contribution makes it a member)."""
        allocated = self.allocation.get(self.worker_id)
        if allocated is not None:
            return allocated
        if self.allocation:
            return 0
        lowest = self._lowest_partition
        pool = self.live_trainers(now).union(placed)
        members = sorted(pool, key=lambda w: (lowest.get(w, math.inf), w))
        base, extra = divmod(micro_batches_per_step, len(members))
        return base + (1 if members.index(self.worker_id) < extra else 0)


def _sequence(contribution_id: str) -> int:
    tail = contribution_id.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _epoch_of(batch_id: str, split: str) -> int | None:
    try:
        ref = parse_batch_id(batch_id)
    except ValueError:
        logger.warning("ignoring malformed batch id %r on the control topic", batch_id)
        return None
    return ref.epoch if ref.split == split else None
