"""The coordinator's state and decisions for one job: pure logic, no I/O.

Every aggregator process folds the job's control topic, in log order, into a
:class:`Coordinator` (:meth:`Coordinator.fold`); the process that owns partition 0 of the
grads topic also calls :meth:`Coordinator.decide` and publishes what it returns. Its own
decisions change the state only when they come back through the log, so the state is always
the fold of the log, and a new coordinator after a failover continues from exactly the same
state. Folding rules (shared with the trainers):

- a StepClose applies when its version is the current one + 1 (the first of each version
  wins; a duplicate from a failover race is ignored);
- a Contribution id seen before is ignored; a Rejection of an applied contribution is ignored;
- an EvalResult counts once per eval batch id (a result whose ids are all covered is ignored).

Decisions (``decide``): sync mode closes version v+1 once every live member has a pending
contribution computed on v, or sooner when the pending ones hold the last train batches of the
epoch (no other member can have anything for that step: an epoch whose batch count is not a
multiple of the step's used to wait out ``empty_contribution_wait_s`` for the others' empty
contributions, which the trainers then skip); ssp closes one contribution per version while
``current - base <= staleness``. Either mode rejects contributions that are too stale or carry
an already-applied batch ("duplicate batches"), except an empty sync contribution whose step
closed without it, which is dropped unanswered; once training is finished every contribution
is rejected ("training finished"), so each one gets an answer. Nothing is decided while an
earlier decision has not come back through the log.

Allocation (``distribution.allocation``): adaptive gives each live trainer micro-batches per
step in proportion to its measured throughput and publishes a ``routing`` of the batches
topic's partitions (:meth:`Coordinator.routing`) so that each trainer also *receives* that
share of the batches; equal splits each step equally and routes nothing.

Local mode (DiLoCo-style) closes outer steps exactly as sync closes steps; its contributions
carry parameter deltas instead of gradients, which the slice owners feed to the outer optimizer
(:func:`conveyor.training.optim.aggregator_optimizer`) at the outer lr the close carries.

SGD momentum under bounded staleness: a close whose gradient is ``d > 0`` versions old carries
``momentum / (1 + d)`` (:func:`conveyor.training.optim.staleness_momentum`); the slice owners apply
it.

The sample ledger (:attr:`Coordinator.ledger`): folding a StepClose counts the ``sample_ids``
of each contribution it applies under that contribution's ``epoch``: what the trainers say
they computed on, never the plan's idea of the batches, so the ledger can prove (or disprove)
that every train sample went into exactly one update per epoch. A contribution rejected and
then applied anyway (a close decided by another coordinator during a handover, before it read
the rejection) still counts: rejected contributions are kept while a close may apply them.
Decisions reject a contribution whose sample ids are outside the dataset or whose batch ids
are not all of its epoch ("invalid sample ids", "invalid batch ids").

Checkpoints: a checkpointed StepClose snapshots the job's progress (ledger included) for slice
0's file (:attr:`Coordinator.progress_at`); a resumed job's fold starts from it
(:meth:`Coordinator.resume`).

The learning-rate schedule's step: sync counts non-empty steps; ssp counts applied train
batches / micro_batches_per_step (an ssp step holds one trainer's share). ``max_steps`` caps
the version (what every trainer sees in the StepCloses, so all stop at the same point).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from conveyor.platform.messages import (
    AppliedContribution,
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
from conveyor.services.aggregator.membership import Membership, allocate
from conveyor.training.checkpoint import JobProgress
from conveyor.training.jobspec import JobSpec
from conveyor.training.ledger import Ledger
from conveyor.training.optim import aggregator_optimizer, lr_at, staleness_momentum
from conveyor.training.plan import parse_batch_id
from conveyor.training.routing import partition_weights

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


@dataclass(frozen=True, slots=True)
class Decisions:
    """What to publish on the control topic, in this order (rejections, then the close)."""

    rejections: list[Rejection] = field(default_factory=list)
    close: StepClose | None = None


class Coordinator:
    """See the module docstring. Not thread-safe."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        distribution = config.spec.distribution
        # Local mode closes its outer steps as sync closes its steps: every live member's
        # window, computed on the current version.
        self.sync = distribution.mode in ("sync", "local")
        self.local = distribution.mode == "local"
        self.staleness_bound = 0 if self.sync else distribution.staleness
        self.adaptive = distribution.allocation == "adaptive"
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

    def allocation(self, now: float, *, turn: int | None = None) -> dict[str, int]:
        """Micro-batches per live member for a step (empty without live members): adaptive:
        proportional to each one's throughput; equal: an equal split. With more members than
        micro-batches per step, members take turns, so a step never holds more than the
        global batch: ``turn`` is the step's place in its epoch (default: the step on the
        current version), and the members' order is their lowest batches partition (then
        their id), the order in which the routing spreads an epoch's batches over them
        (:mod:`conveyor.training.routing`), so each turn falls to the holders of its
        batches."""
        live = self.members.live(now)
        if not live:
            return {}
        live.sort(key=lambda m: (min(m.batches_partitions, default=math.inf), m.worker_id))
        throughputs = {m.worker_id: m.samples_per_second if self.adaptive else None
                       for m in live}  # fmt: skip
        if turn is None:
            turn = self.version - self.epoch_started_at
        return allocate(throughputs, self.config.micro_batches_per_step, turn=turn)

    @property
    def epoch_started_at(self) -> int:
        """The version the current epoch's first step was computed on: the end of the last
        ended epoch (the resume point or 0 before any)."""
        return max(self.epochs.end_version.values(), default=self.resumed_from or 0)

    def routing(self, now: float) -> list[float] | None:
        """Weights of the batches topic's partitions (sum 1) that give each live member the
        share of the batches it consumes: sync, its allocation per step (at least 1, what a
        trainer takes); ssp, its throughput (each trainer steps at its own pace). None with
        equal allocation, an unknown partition count, or no member reporting partitions."""
        partitions = self.config.batches_partitions
        if not self.adaptive or partitions is None:
            return None
        live = self.members.live(now)
        if self.sync:
            counts = self.allocation(now)
            rates: dict[str, float | None] = {w: float(max(1, n)) for w, n in counts.items()}
        else:
            rates = {m.worker_id: m.samples_per_second for m in live}
        owners = [(rates[m.worker_id], m.batches_partitions) for m in live]
        return partition_weights(owners, partitions)

    @property
    def schedule_step(self) -> int:
        """The step the learning-rate schedule counts (module docstring)."""
        if self.sync:
            return self.steps
        return self.applied_train_batches // self.config.micro_batches_per_step

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

    # -- decisions -------------------------------------------------------------------------

    def decide(self, now: float) -> Decisions:
        """What to publish now (wall clock ``now``, unix s); see the module docstring."""
        if self._awaiting_version is not None:
            return Decisions()
        if self.training_finished:
            # Every contribution gets an answer, so no trainer waits for one that never comes.
            return Decisions(rejections=[
                self._reject(c, "training finished")
                for c in self._pending.values()
                if c.contribution_id not in self._awaiting_rejections
            ])  # fmt: skip
        rejections: list[Rejection] = []
        ready: list[Contribution] = []
        for contribution in self._pending.values():
            if contribution.contribution_id in self._awaiting_rejections:
                continue
            reason = self._rejection_reason(contribution)
            if reason is not None:
                rejections.append(self._reject(contribution, reason))
            elif not self.sync:
                ready = [contribution]  # ssp: one contribution per version, in arrival order
                break
            else:
                ready.append(contribution)
        if not ready or (self.sync and not self._step_complete(ready, now)):
            return Decisions(rejections=rejections)
        included: list[Contribution] = []
        batches: set[str] = set()
        for contribution in ready:
            if batches.intersection(contribution.batch_ids):
                rejections.append(self._reject(contribution, "duplicate batches"))
            else:
                included.append(contribution)
                batches.update(contribution.batch_ids)
        close = self._close(included, now)
        self._awaiting_version = close.version
        return Decisions(rejections=rejections, close=close)

    def _rejection_reason(self, contribution: Contribution) -> str | None:
        staleness = self.version - contribution.base_version
        if staleness < 0 or staleness > self.staleness_bound:
            return f"stale: base {contribution.base_version}, current {self.version}"
        job_id = self.config.job_id
        try:
            refs = [parse_batch_id(b) for b in contribution.batch_ids]
        except ValueError:
            return "invalid batch ids"
        if any(
            r.job_id != job_id or r.split != "train" or r.epoch != contribution.epoch for r in refs
        ):
            return "invalid batch ids"
        ids = contribution.sample_ids
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.config.dataset_samples:
            return "invalid sample ids"
        if len(set(contribution.batch_ids)) != len(contribution.batch_ids) or any(
            b in self._applied_batches for b in contribution.batch_ids
        ):
            return "duplicate batches"
        return None

    def _reject(self, contribution: Contribution, reason: str) -> Rejection:
        self._awaiting_rejections.add(contribution.contribution_id)
        return Rejection(
            job_id=self.config.job_id,
            contribution_id=contribution.contribution_id,
            worker_id=contribution.worker_id,
            current_version=self.version,
            reason=reason,
        )

    def _step_complete(self, ready: list[Contribution], now: float) -> bool:
        """Sync: every live member contributed, or ``ready`` ends the epoch."""
        contributors = {c.worker_id for c in ready}
        if all(m.worker_id in contributors for m in self.members.live(now)):
            return True
        return bool(self.epochs.would_end(sorted({b for c in ready for b in c.batch_ids})))

    def _close(self, included: list[Contribution], now: float) -> StepClose:
        batch_ids = [b for c in included for b in c.batch_ids]
        staleness = max((self.version - c.base_version for c in included), default=0)
        epochs = [parse_batch_id(b).epoch for b in batch_ids]
        num_samples = sum(c.num_samples for c in included)
        return StepClose(
            job_id=self.config.job_id,
            version=self.version + 1,
            contributions=[_entry(c, self.version - c.base_version) for c in included],
            batch_ids=batch_ids,
            num_samples=num_samples,
            epoch=min(epochs, default=self.current_epoch),
            lr=self._lr(),
            allocation=self.allocation(now, turn=self._next_turn(batch_ids)),
            closed_at=now,
            momentum=self._momentum(staleness),
            checkpoint=self._checkpoint_reason(batch_ids, num_samples),
        )

    def _next_turn(self, batch_ids: list[str]) -> int:
        """The place in its epoch of the step after the close of ``batch_ids``: 0 when the
        close ends the epoch."""
        if self.epochs.would_end(batch_ids):
            return 0
        return self.version + 1 - self.epoch_started_at

    def _checkpoint_reason(self, batch_ids: list[str], num_samples: int) -> str | None:
        """Why the version being closed is checkpointed (None: it is not): the job's end, an
        epoch's end, every ``checkpoint.every_steps`` steps, or a request folded since the
        last checkpoint, in that order of precedence."""
        training = self.config.spec.training
        ended = self.epochs.would_end(batch_ids)
        max_steps = training.max_steps
        if (max_steps is not None and self.version + 1 >= max_steps) or (
            training.epochs - 1 in ended
        ):
            return "job_end"
        if ended:
            return "epoch_end"
        every = self.config.spec.checkpoint.every_steps
        if every is not None and num_samples > 0 and (self.steps + 1) % every == 0:
            return "every_steps"
        return self._requested_checkpoint

    def _momentum(self, staleness: int) -> float | None:
        """The step's SGD momentum when the aggregator runs one and the gradient is stale."""
        optimizer = aggregator_optimizer(self.config.spec)
        if optimizer.name != "sgd" or optimizer.momentum == 0 or staleness == 0:
            return None
        return staleness_momentum(optimizer.momentum, staleness)

    def _lr(self) -> float:
        if self.local:  # the schedule is the inner optimizer's, on the trainers
            return self.config.spec.distribution.outer.lr
        training = self.config.spec.training
        return lr_at(
            training.lr_schedule,
            training.optimizer.lr,
            self.schedule_step,
            self.config.total_steps,
        )


def _entry(contribution: Contribution, staleness: int) -> AppliedContribution:
    return AppliedContribution(
        contribution_id=contribution.contribution_id,
        worker_id=contribution.worker_id,
        base_version=contribution.base_version,
        num_samples=contribution.num_samples,
        staleness=staleness,
    )
