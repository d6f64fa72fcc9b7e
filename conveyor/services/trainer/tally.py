"""A job's running numbers: counters, train loss per epoch, eval tallies, epoch results.

Plain JSON-safe state: it goes into every trainer-state checkpoint and comes back on resume,
so counters (what the sharder's flow control reads, the summary) survive restarts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class EvalTally:
    """Summed loss and correct predictions over an epoch's eval batches."""

    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0

    def add(self, loss_sum: float, correct: int, samples: int) -> None:
        self.loss_sum += loss_sum
        self.correct += correct
        self.samples += samples

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.samples if self.samples else None

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.samples if self.samples else None


@dataclass(kw_only=True, slots=True)
class JobTally:
    """Everything countable about one job's training so far."""

    step: int = 0
    """Optimizer steps applied."""
    samples_trained: int = 0
    """Samples inside applied steps."""
    consumed_batches: int = 0
    """Unique train + eval batches finished, all epochs (the sharder's flow control)."""
    consumed_train_batches: int = 0
    """Unique train batches applied, all epochs."""
    duplicates: int = 0
    """Batches dropped as duplicates."""
    wait_s: float = 0.0
    """Exposed data wait (seconds), as of the checkpoint."""
    compute_s: float = 0.0
    """Forward/backward, eval and update time (seconds), as of the checkpoint."""
    update_s: float = 0.0
    """Of compute_s, the optimizer updates (seconds)."""
    epoch_loss_sum: float = 0.0
    """Summed train loss of the epoch being trained."""
    epoch_samples: int = 0
    """Samples of the epoch being trained (applied or in the current step)."""
    train_loss: dict[int, float | None] = field(default_factory=dict)
    """Mean train loss of epochs whose train part closed and whose eval is still open."""
    evals: dict[int, EvalTally] = field(default_factory=dict)
    """Open evals by epoch."""
    results: dict[int, dict[str, float | None]] = field(default_factory=dict)
    """Completed epochs: {train_loss, eval_loss, eval_accuracy}."""

    def close_train_epoch(self, epoch: int, *, with_eval: bool) -> float | None:
        """Close ``epoch``'s train loss; open its eval tally when it has eval batches.
        Returns the epoch's mean train loss."""
        train_loss = self.epoch_loss_sum / self.epoch_samples if self.epoch_samples else None
        self.epoch_loss_sum, self.epoch_samples = 0.0, 0
        if with_eval:
            self.train_loss[epoch] = train_loss
            self.evals[epoch] = EvalTally()
        else:
            self.results[epoch] = {
                "train_loss": train_loss, "eval_loss": None, "eval_accuracy": None,
            }  # fmt: skip
        return train_loss

    def close_eval(self, epoch: int) -> dict[str, float | None]:
        """Move ``epoch``'s open eval to the results and return them."""
        tally = self.evals.pop(epoch)
        self.results[epoch] = {
            "train_loss": self.train_loss.pop(epoch, None),
            "eval_loss": tally.loss,
            "eval_accuracy": tally.accuracy,
        }
        return self.results[epoch]

    def last_result(self) -> dict[str, float | None]:
        """The latest completed epoch's results (all None before any)."""
        if not self.results:
            return {"train_loss": None, "eval_loss": None, "eval_accuracy": None}
        return self.results[max(self.results)]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("train_loss", "evals", "results"):
            data[name] = {str(epoch): value for epoch, value in data[name].items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobTally:
        fields = dict(data)
        fields["train_loss"] = {int(e): v for e, v in data["train_loss"].items()}
        fields["evals"] = {int(e): EvalTally(**v) for e, v in data["evals"].items()}
        fields["results"] = {int(e): dict(v) for e, v in data["results"].items()}
        return cls(**fields)
