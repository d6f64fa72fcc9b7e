"""The coordinator's decisions for one job: when a step closes, what is rejected, how the
micro-batches of a step are allocated. Pure logic, no I/O.

:class:`Coordinator` is the fold of the job's control log
(:class:`~conveyor.services.aggregator.coordinator_state.CoordinatorState`, which every
aggregator process keeps) plus :meth:`Coordinator.decide`, which only the process that owns
partition 0 of the grads topic calls; it publishes what ``decide`` returns. The decisions
change the state only when they come back through the log.

Decisions (``decide``): sync mode closes version v+1 once every live member has a pending
contribution computed on v, or sooner when the pending ones hold the last train batches of the
epoch (no other member can have anything for that step: an epoch whose batch count is not a
multiple of the step's used to wait out ``empty_contribution_wait_s`` for the others' empty
contributions, which the trainers then skip); ssp closes one contribution per version while
``current - base <= staleness``. Either mode rejects contributions that are too stale or carry
an already-applied batch ("duplicate batches"), except an empty sync contribution whose step
closed without it, which is dropped unanswered; once training is finished every contribution
is rejected ("training finished"), so each one gets an answer. Nothing is decided while an
earlier decision has not come back through the log. Decisions also reject a contribution
whose sample ids are outside the dataset or whose batch ids are not all of its epoch ("invalid
sample ids", "invalid batch ids"), and, in sync mode, what would take a step past the global
batch, or a local window past ``sync_every_steps`` global batches ("over the global batch":
trainers that split the first step before any allocation count the live and placed trainers
each sees, which may differ when a trainer is placed after another started).

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

The learning-rate schedule's step: sync counts non-empty steps; ssp counts applied train
batches / micro_batches_per_step (an ssp step holds one trainer's share). ``max_steps`` caps
the version (what every trainer sees in the StepCloses, so all stop at the same point).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.platform.messages import AppliedContribution, Contribution, Rejection, StepClose
from conveyor.services.aggregator.coordinator_state import CoordinatorConfig, CoordinatorState
from conveyor.services.aggregator.membership import allocate
from conveyor.training.optim import aggregator_optimizer, lr_at, staleness_momentum
from conveyor.training.plan import parse_batch_id
from conveyor.training.routing import claims_complete, partition_weights

__all__ = ["Coordinator", "CoordinatorConfig", "Decisions"]


@dataclass(frozen=True, slots=True)
class Decisions:
    """What to publish on the control topic, in this order (rejections, then the close)."""

    rejections: list[Rejection] = field(default_factory=list)
    close: StepClose | None = None


class Coordinator(CoordinatorState):
    """See the module docstring. Not thread-safe."""

    def __init__(self, config: CoordinatorConfig) -> None:
        super().__init__(config)
        distribution = config.spec.distribution
        self.local = distribution.mode == "local"
        self.adaptive = distribution.allocation == "adaptive"
        self._routing: list[float] | None = None
        """The weights of the last consistent view of the batches group (see :meth:`routing`)."""

    # -- allocation ------------------------------------------------------------------------

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
        equal allocation, an unknown partition count, or no member reporting partitions.

        Only a consistent view of the group's assignment is weighted (every partition claimed
        by one live member, :func:`claims_complete`); otherwise the last consistent view's
        weights stand (None before any). The sharder stamps the weights into the tasks it
        releases an epoch ahead: weights taken while one trainer's heartbeat predated its
        first assignment (its partitions unclaimed, at the digits demo's first step) routed
        16 batches of the next epoch to the other trainer only, and the first trainer waited
        for its share of them: 5-7 extra, partial steps, the demo's 120-122 steps for 115."""
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
        if claims_complete((claim for _, claim in owners), partitions):
            self._routing = partition_weights(owners, partitions)
        return self._routing

    @property
    def schedule_step(self) -> int:
        """The step the learning-rate schedule counts (module docstring)."""
        if self.sync:
            return self.steps
        return self.applied_train_batches // self.config.micro_batches_per_step

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
        if self.sync:
            included, over = self._fit_global_batch(included)
            rejections.extend(self._reject(c, "over the global batch") for c in over)
        close = self._close(included, now)
        self._awaiting_version = close.version
        return Decisions(rejections=rejections, close=close)

    def _fit_global_batch(
        self, ready: list[Contribution]
    ) -> tuple[list[Contribution], list[Contribution]]:
        """Sync: the contributions a step takes, at most ``micro_batches_per_step`` micro-batches
        in all (local mode: a window's, ``sync_every_steps`` times that), and those left over
        (rejected, so recomputed on the new version). Before the first allocation each trainer
        splits the step over the trainers it has heard from, and two that have not heard from
        the same ones bring more than a step between them (one alone takes the whole step, the
        other its share). The largest fit first; the kept ones stay in arrival order."""
        limit = self.config.micro_batches_per_step
        if self.local:
            limit *= self.config.spec.distribution.sync_every_steps or 1
        if sum(len(c.batch_ids) for c in ready) <= limit:
            return ready, []
        kept: set[str] = set()
        taken = 0
        for contribution in sorted(ready, key=lambda c: -len(c.batch_ids)):
            if taken + len(contribution.batch_ids) <= limit:
                kept.add(contribution.contribution_id)
                taken += len(contribution.batch_ids)
        return (
            [c for c in ready if c.contribution_id in kept],
            [c for c in ready if c.contribution_id not in kept],
        )

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
