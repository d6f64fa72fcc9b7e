"""One trainer's own running numbers in a job (what its progress events report).

The job's authoritative figures (applied batches, steps, epoch results) come from the
coordinator; these are this process's share, from the moment it joined.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TrainerTally:
    """Counters of one trainer in one job."""

    samples_trained: int = 0
    """Samples of this trainer's applied contributions."""
    batches_trained: int = 0
    """Train batches of this trainer's applied contributions."""
    eval_batches: int = 0
    """Eval batches this trainer evaluated and reported."""
    duplicates: int = 0
    """Deliveries dropped because the batch was done already or is in memory here."""
    contributions: int = 0
    """Non-empty contributions sent."""
    empty_contributions: int = 0
    """Empty contributions sent (sync mode, no batch ready in time)."""
    rejected: int = 0
    """Contributions rejected (their batches were recomputed)."""
    grad_bytes: int = 0
    """Gradient payload bytes sent (all slices of all contributions)."""
    loss: float | None = None
    """Mean per-sample loss of the latest applied contribution."""

    def applied(self, *, samples: int, batches: int, loss_sum: float) -> None:
        """Account one applied non-empty contribution."""
        self.samples_trained += samples
        self.batches_trained += batches
        if samples:
            self.loss = loss_sum / samples
