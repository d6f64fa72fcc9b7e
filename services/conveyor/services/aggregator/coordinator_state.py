"""The coordinator's state for one job: the fold of its control log, pure logic, no I/O.

Every aggregator process folds the job's control topic, in log order, into a
:class:`~conveyor.services.aggregator.coordinator.Coordinator` (:meth:`CoordinatorState.fold`);
the process that owns partition 0 of the grads topic also calls its ``decide``
(:mod:`conveyor.services.aggregator.coordinator`) and publishes what it returns. Its own
decisions change the state only when they come back through the log, so the state is always
the fold of the log, and a new coordinator after a failover continues from exactly the same
state. Folding rules (shared with the trainers):

- a StepClose applies when its version is the current one + 1 (the first of each version
  wins; a duplicate from a failover race is ignored);
- a Contribution id seen before is ignored; a Rejection of an applied contribution is ignored;
- an EvalResult counts once per eval batch id (a result whose ids are all covered is ignored).

The sample ledger (:attr:`CoordinatorState.ledger`): folding a StepClose counts the
``sample_ids`` of each contribution it applies under that contribution's ``epoch``: what the
trainers say they computed on, never the plan's idea of the batches, so the ledger can prove (or
disprove) that every train sample went into exactly one update per epoch. A contribution
rejected and then applied anyway (a close decided by another coordinator during a handover,
before it read the rejection) still counts: rejected contributions are kept while a close may
apply them.

Checkpoints: a checkpointed StepClose snapshots the job's progress (ledger included) for slice
0's file (:attr:`CoordinatorState.progress_at`); a resumed job's fold starts from it
(:meth:`CoordinatorState.resume`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from conveyor.platform.messages import (
    CheckpointRequest,
    Contribution,
    EvalResult,
    Heartbeat,
    Message,
    Rejection,
    ResumePoint,
    SliceSaved,
    StepClose,
)
from conveyor.services.aggregator.epochs import EpochBook
from conveyor.services.aggregator.membership import Membership
from conveyor.training.checkpoint import JobProgress
from conveyor.training.jobspec import JobSpec
from conveyor.training.ledger import Ledger

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """What the coordinator needs to know about a job."""

    job_id: str
    spec: JobSpec
    """The job spec (mode, staleness, optimizer lr and schedule, epochs, max_steps)."""
    train_batches_per_epoch: int
    """From the sharder's plan."""
    eval_batches_per_epoch: int
    """From the sharder's plan."""
    dataset_samples: int
    """Samples of the job's dataset, train and eval (from the sharder's plan): sample ids are
    in ``[0, dataset_samples)``."""
    member_timeout_s: float = 10.0
    """A trainer not heard from for this long is no longer waited for."""
    batches_partitions: int | None = None
    """Partitions of the job's batches topic (from the sharder's plan); None: no routing."""

    @property
    def micro_batches_per_step(self) -> int:
        return self.spec.micro_batches_per_step

    @property
    def total_steps(self) -> int:
        """Steps the schedule spans: every epoch's steps, capped by ``max_steps``."""
        steps = self.spec.training.epochs * math.ceil(
            self.train_batches_per_epoch / self.micro_batches_per_step
        )
        max_steps = self.spec.training.max_steps
        return steps if max_steps is None else min(steps, max_steps)


class CoordinatorState:
    """The fold of one job's control log (module docstring). Not thread-safe."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        distribution = config.spec.distribution
        # Local mode closes its outer steps as sync closes its steps: every live member's
        # window, computed on the current version.
        self.sync = distribution.mode in ("sync", "local")
        self.staleness_bound = 0 if self.sync else distribution.staleness
        self.members = Membership(config.member_timeout_s)
        self.version = 0
        """Latest applied version."""
        self.steps = 0
        """Applied steps with samples."""
        self.samples_trained = 0
        self.closes: dict[int, StepClose] = {}
        """Applied StepCloses by version."""
        self.max_staleness = 0
        self.grad_bytes_total = 0
        """Gradient bytes of every contribution received (applied, rejected or pending)."""
        self.rejected = 0
        self.last_loss: float | None = None
        self.step_losses: list[float] = []
        """Mean training loss of every step with samples, in step order: what the applied
        contributions say their trainers computed (``loss_sum / num_samples``)."""
        self.first_started_at: float | None = None
        """When the job's first step began (Unix seconds): the earliest ``started_at`` of its
        contributions, ``sent_at`` for one without stamps. The summary's samples/s counts from
        it, so a local-mode window's time counts with its samples."""
        self.last_closed_at: float | None = None
        self.epochs = EpochBook(
            epochs=config.spec.training.epochs,
            train_batches=config.train_batches_per_epoch,
            eval_batches=config.eval_batches_per_epoch,
            counts_correct=not config.spec.language_model,
        )
        self.ledger = Ledger(config.dataset_samples)
        """Per-epoch counts of the sample ids of every applied contribution (module
        docstring): the job's ledger.json, and part of the state a checkpoint snapshots
        (:meth:`Ledger.to_arrays`) and a restore puts back."""
        self._pending: dict[str, Contribution] = {}  # arrival order
        self._rejected: dict[str, Contribution] = {}  # that a close may still apply
        self._seen: set[str] = set()
        self._applied_in: dict[str, int] = {}  # contribution id -> version that applied it
        self._applied_batches: set[str] = set()
        # What Coordinator.decide published and the fold has not read back yet.
        self._awaiting_version: int | None = None
        self._awaiting_rejections: set[str] = set()
        self._requested_checkpoint: str | None = None
        """Reason of a CheckpointRequest folded since the last checkpointed StepClose."""
        self.saved: dict[int, dict[int, SliceSaved]] = {}
        """Checkpointed version -> slice -> its SliceSaved (the first one of each slice)."""
        self.progress_at: dict[int, JobProgress] = {}
        """Checkpointed versions whose slice 0 is not announced yet -> the progress then."""
        self.resumed_from: int | None = None
        """The checkpoint version a resumed job started from (None: not resumed)."""
        self.samples_before_resume = 0
        """Samples trained before the resume (left out of this run's throughput)."""

    # -- folding the log -------------------------------------------------------------------

    def fold(self, message: Message) -> None:
        """Apply one control-topic message (other types and other jobs are ignored)."""
        if getattr(message, "job_id", self.config.job_id) != self.config.job_id:
            return
        if isinstance(message, Heartbeat):
            self.members.heartbeat(message)
        elif isinstance(message, Contribution):
            self._fold_contribution(message)
        elif isinstance(message, StepClose):
            self._fold_close(message)
        elif isinstance(message, Rejection):
            self._awaiting_rejections.discard(message.contribution_id)
            rejected = self._pending.pop(message.contribution_id, None)
            if rejected is not None:
                self.rejected += 1
                self._rejected[message.contribution_id] = rejected
        elif isinstance(message, EvalResult):
            self.epochs.evaluated(message, self.config.job_id)
        elif isinstance(message, CheckpointRequest):
            self._requested_checkpoint = message.reason
        elif isinstance(message, SliceSaved):
            self.saved.setdefault(message.version, {}).setdefault(message.slice_index, message)
            if message.slice_index == 0:
                self.progress_at.pop(message.version, None)

    def _fold_contribution(self, contribution: Contribution) -> None:
        self.members.seen(contribution.worker_id, contribution.sent_at)
        if contribution.contribution_id in self._seen:
            return
        self._seen.add(contribution.contribution_id)
        if not self._superseded(contribution):
            self._pending[contribution.contribution_id] = contribution
        self.grad_bytes_total += contribution.grad_bytes
        begun = contribution.sent_at if contribution.started_at is None else contribution.started_at
        if self.first_started_at is None or begun < self.first_started_at:
            self.first_started_at = begun

    def _superseded(self, contribution: Contribution) -> bool:
        """Sync: an empty contribution to a step that closed without it (the others' batches
        ended the epoch). Nothing to answer: its trainer sees the close and moves on."""
        return self.sync and not contribution.batch_ids and contribution.base_version < self.version

    def _fold_close(self, close: StepClose) -> None:
        if self.closes.get(close.version) == close:
            return  # read back after the coordinator folded it as it published it (Leader.act)
        if close.version != self.version + 1:
            logger.warning("job %s: ignoring StepClose %d at version %d",
                           self.config.job_id, close.version, self.version)  # fmt: skip
            return
        self.version = close.version
        self.closes[close.version] = close
        if self._awaiting_version is not None and self.version >= self._awaiting_version:
            self._awaiting_version = None
        loss_sum = 0.0
        for entry in close.contributions:
            contribution_id = entry.contribution_id
            self._seen.add(contribution_id)
            self._applied_in[contribution_id] = close.version
            contribution = self._pending.pop(contribution_id, None)
            if contribution is None:
                contribution = self._rejected.pop(contribution_id, None)
            if contribution is not None:
                loss_sum += contribution.loss_sum
                self.ledger.add(contribution.epoch, contribution.sample_ids.numpy())
            elif entry.num_samples > 0:
                logger.error(
                    "job %s: StepClose %d applies contribution %s, which was not folded "
                    "before it: its samples are missing from the ledger",
                    self.config.job_id, close.version, contribution_id,
                )  # fmt: skip
            self.max_staleness = max(self.max_staleness, entry.staleness)
        for contribution_id, contribution in list(self._pending.items()):
            if self._superseded(contribution):
                del self._pending[contribution_id]
        self._applied_batches.update(close.batch_ids)
        self.epochs.applied(close.batch_ids, close.version)
        if close.num_samples > 0:
            self.steps += 1
            self.samples_trained += close.num_samples
            self.last_loss = loss_sum / close.num_samples
            self.step_losses.append(self.last_loss)
            self.epochs.train_loss(close.epoch, loss_sum, close.num_samples)
        self.last_closed_at = close.closed_at
        if close.checkpoint is not None:
            self._requested_checkpoint = None
            self.progress_at[close.version] = self.progress()
        # A later close only takes contributions within the staleness bound of its base.
        oldest = self.version - self.staleness_bound
        self._rejected = {cid: c for cid, c in self._rejected.items() if c.base_version >= oldest}

    def resume(self, point: ResumePoint, progress: JobProgress) -> None:
        """Start a resumed job's fold from its ``ResumePoint`` (its control log's first record)
        and the named checkpoint's progress. ValueError when the fold has begun or they
        disagree."""
        if self.version != 0 or self.closes or progress.version != point.version:
            raise ValueError(
                f"job {self.config.job_id}: cannot resume at v{point.version} (fold at "
                f"v{self.version}, checkpoint progress at v{progress.version})"
            )
        self.version = self.resumed_from = point.version
        self.steps = progress.steps
        self.samples_trained = self.samples_before_resume = progress.samples_trained
        self.epochs.resume(progress.ended, progress.train_loss, progress.applied_batches)
        self._applied_batches.update(progress.applied_batches)
        self.ledger = progress.ledger
        self.step_losses = list(progress.step_losses)

    def progress(self) -> JobProgress:
        """The job's progress at the current version (a copy)."""
        ended, train_loss, applied = self.epochs.outcomes()
        return JobProgress(version=self.version, steps=self.steps,
                           samples_trained=self.samples_trained, ended=ended,
                           train_loss=train_loss, applied_batches=applied,
                           ledger=Ledger.from_arrays(self.ledger.to_arrays()),
                           step_losses=list(self.step_losses))  # fmt: skip

    # -- derived state ---------------------------------------------------------------------

    def undecided(self) -> list[Contribution]:
        """Folded contributions neither applied nor rejected yet, in arrival order."""
        return list(self._pending.values())

    def applied_version(self, contribution_id: str) -> int | None:
        """The version whose StepClose applied ``contribution_id`` (None: not applied)."""
        return self._applied_in.get(contribution_id)

    @property
    def applied_train_batches(self) -> int:
        return self.epochs.applied_train_batches

    def checkpoint_answered(self, version: int) -> bool:
        """Whether every slice announced its state of checkpointed ``version`` (saved or
        failed)."""
        return len(self.saved.get(version, {})) >= self.config.spec.distribution.aggregator_shards

    def last_checkpointed_version(self) -> int | None:
        """The newest version whose StepClose asks for a checkpoint."""
        return max((v for v, c in self.closes.items() if c.checkpoint is not None), default=None)

    @property
    def consumed_batches(self) -> int:
        """Applied train batches + covered eval batches (the sharder's flow control)."""
        return self.epochs.applied_train_batches + self.epochs.covered_eval_batches

    @property
    def current_epoch(self) -> int:
        """Lowest epoch whose train batches are not all applied (``epochs`` when none is)."""
        return self.epochs.current_epoch

    @property
    def training_finished(self) -> bool:
        max_steps = self.config.spec.training.max_steps
        if max_steps is not None and self.version >= max_steps:
            return True
        return self.current_epoch >= self.config.spec.training.epochs

    @property
    def finished(self) -> bool:
        """Training finished and every ended epoch's evaluation is complete."""
        ended = self.epochs.end_version
        return self.training_finished and all(map(self.epochs.eval_complete, ended))
