"""Per-epoch bookkeeping of a job's coordinator: train batches applied, epoch ends, train loss,
eval sums (each eval batch id counted once), epoch results. Pure logic, no I/O.

A batch id carries its epoch and split (``<job>:e<E>:<split>:...``). Epoch E ends at the
version whose StepClose applies the last of its ``train_batches_per_epoch`` train batches; its
result is complete once ``eval_batches_per_epoch`` eval batches of E are covered by EvalResults
(trainers evaluate on the parameters of that version).

A resumed job's book starts from a checkpoint's (:meth:`EpochBook.outcomes`,
:meth:`EpochBook.resume`): epochs evaluated before keep their results, the open epochs their
applied batches and train loss so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from conveyor.platform.messages import EvalResult
from conveyor.training.checkpoint import EpochOutcome
from conveyor.training.plan import parse_batch_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EpochResult:
    """An epoch whose train batches are all applied and whose eval batches are all covered."""

    epoch: int
    version: int
    """The version that completed the epoch's train batches."""
    eval_loss: float | None
    eval_accuracy: float | None
    train_loss: float | None


@dataclass(slots=True)
class _EvalTally:
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0
    covered: set[str] = field(default_factory=set)


class EpochBook:
    """See the module docstring. Not thread-safe."""

    def __init__(self, *, epochs: int, train_batches: int, eval_batches: int) -> None:
        self.epochs = epochs
        self.train_batches = train_batches
        """Train batches per epoch."""
        self.eval_batches = eval_batches
        """Eval batches per epoch."""
        self.end_version: dict[int, int] = {}
        """epoch -> the version that applied its last train batch."""
        self._applied: dict[int, int] = {}
        self._open_batches: dict[int, list[str]] = {}
        """Epochs not ended -> their train batches applied so far."""
        self._train_loss: dict[int, list[float]] = {}  # epoch -> [loss sum, samples]
        self._eval: dict[int, _EvalTally] = {}
        self._restored: dict[int, EpochResult] = {}
        """Epochs evaluated before a resume -> their results."""

    def applied(self, batch_ids: list[str], version: int) -> None:
        """Count the train batches of the StepClose of ``version``."""
        for batch_id in batch_ids:
            ref = parse_batch_id(batch_id)
            if ref.split != "train":
                continue
            count = self._applied[ref.epoch] = self._applied.get(ref.epoch, 0) + 1
            self._open_batches.setdefault(ref.epoch, []).append(batch_id)
            if count == self.train_batches:
                self.end_version[ref.epoch] = version
                del self._open_batches[ref.epoch]

    def would_end(self, batch_ids: list[str]) -> list[int]:
        """The epochs whose last train batches are among ``batch_ids`` (not applied yet)."""
        counts: dict[int, int] = {}
        for batch_id in batch_ids:
            ref = parse_batch_id(batch_id)
            if ref.split == "train":
                counts[ref.epoch] = counts.get(ref.epoch, 0) + 1
        return sorted(
            epoch
            for epoch, n in counts.items()
            if self._applied.get(epoch, 0) < self.train_batches <= self._applied.get(epoch, 0) + n
        )

    def train_loss(self, epoch: int, loss_sum: float, samples: int) -> None:
        tally = self._train_loss.setdefault(epoch, [0.0, 0])
        tally[0] += loss_sum
        tally[1] += samples

    def evaluated(self, result: EvalResult, job_id: str) -> None:
        """Add an EvalResult unless all its batch ids are covered already (module docstring)."""
        try:
            refs = [parse_batch_id(b) for b in result.batch_ids]
        except ValueError as exc:
            logger.warning("job %s: ignoring EvalResult: %s", job_id, exc)
            return
        if any(r.split != "eval" or r.epoch != result.epoch for r in refs):
            logger.warning("job %s: ignoring EvalResult of %s with batches of another epoch/split",
                           job_id, result.worker_id)  # fmt: skip
            return
        tally = self._eval.setdefault(result.epoch, _EvalTally())
        new = set(result.batch_ids) - tally.covered
        if not new:
            return
        if len(new) < len(set(result.batch_ids)):
            logger.warning("job %s: EvalResult of %s partly covers evaluated batches; counted",
                           job_id, result.worker_id)  # fmt: skip
        expected = self.end_version.get(result.epoch)
        if expected is not None and result.version != expected:
            logger.warning("job %s: epoch %d evaluated at version %d, not %d",
                           job_id, result.epoch, result.version, expected)  # fmt: skip
        tally.loss_sum += result.loss_sum
        tally.correct += result.correct
        tally.samples += result.num_samples
        tally.covered |= new

    @property
    def applied_train_batches(self) -> int:
        return sum(self._applied.values())

    @property
    def covered_eval_batches(self) -> int:
        restored = len(self._restored) * self.eval_batches
        return restored + sum(len(t.covered) for t in self._eval.values())

    @property
    def current_epoch(self) -> int:
        """Lowest epoch whose train batches are not all applied (``epochs`` when none is)."""
        return next((e for e in range(self.epochs) if e not in self.end_version), self.epochs)

    def eval_complete(self, epoch: int) -> bool:
        if epoch in self._restored:
            return True
        tally = self._eval.get(epoch)
        return (len(tally.covered) if tally is not None else 0) >= self.eval_batches

    def result(self, epoch: int) -> EpochResult | None:
        """The result of ``epoch`` once its train batches are applied and its eval covered."""
        version = self.end_version.get(epoch)
        if epoch in self._restored:
            return self._restored[epoch]
        if version is None or not self.eval_complete(epoch):
            return None
        tally = self._eval.get(epoch, _EvalTally())
        train = self._train_loss.get(epoch)
        return EpochResult(
            epoch=epoch,
            version=version,
            eval_loss=tally.loss_sum / tally.samples if tally.samples else None,
            eval_accuracy=tally.correct / tally.samples if tally.samples else None,
            train_loss=train[0] / train[1] if train and train[1] else None,
        )

    def results(self) -> list[EpochResult]:
        """Every complete epoch result, by epoch."""
        found = (self.result(e) for e in sorted(self.end_version))
        return [r for r in found if r is not None]

    # -- checkpoints -------------------------------------------------------------------------

    def outcomes(
        self,
    ) -> tuple[dict[int, EpochOutcome], dict[int, tuple[float, int]], list[str]]:
        """(ended epochs -> how they ended, epochs without a result -> (train loss sum,
        samples), the train batches of the epochs not ended applied so far): the book's part
        of a checkpoint's job progress."""
        ended: dict[int, EpochOutcome] = {}
        for epoch, version in self.end_version.items():
            result = self.result(epoch)
            ended[epoch] = EpochOutcome(
                version=version,
                evaluated=result is not None,
                eval_loss=result.eval_loss if result else None,
                eval_accuracy=result.eval_accuracy if result else None,
                train_loss=result.train_loss if result else None,
            )
        train_loss = {
            epoch: (tally[0], int(tally[1]))
            for epoch, tally in self._train_loss.items()
            if epoch not in ended or not ended[epoch].evaluated
        }
        applied = [b for epoch in sorted(self._open_batches) for b in self._open_batches[epoch]]
        return ended, train_loss, applied

    def resume(
        self,
        ended: dict[int, EpochOutcome],
        train_loss: dict[int, tuple[float, int]],
        applied_batches: list[str],
    ) -> None:
        """Start from a checkpoint's progress (on a fresh book)."""
        for epoch, outcome in ended.items():
            self.end_version[epoch] = outcome.version
            self._applied[epoch] = self.train_batches
            if outcome.evaluated:
                self._restored[epoch] = EpochResult(
                    epoch=epoch,
                    version=outcome.version,
                    eval_loss=outcome.eval_loss,
                    eval_accuracy=outcome.eval_accuracy,
                    train_loss=outcome.train_loss,
                )
        for epoch, (loss_sum, samples) in train_loss.items():
            self._train_loss[epoch] = [loss_sum, samples]
        for batch_id in applied_batches:
            ref = parse_batch_id(batch_id)
            self._applied[ref.epoch] = self._applied.get(ref.epoch, 0) + 1
            self._open_batches.setdefault(ref.epoch, []).append(batch_id)
