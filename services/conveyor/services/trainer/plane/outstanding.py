"""A trainer's contributions between sending and their decision (pure: no I/O, no torch ops).

A contribution is sent (its GradSlices acknowledged, then the Contribution itself) and stays
*outstanding* until the control log decides it:

- applied: a StepClose lists it; its batches are done;
- rejected: a Rejection names it (too stale, or a batch already applied by someone else); its
  batches that are not applied go back to be recomputed on newer parameters;
- sync mode only: StepClose(base + 1) closed without it. In sync mode a version only takes
  contributions computed on the version before it, so this one can never apply: it counts as
  rejected (the coordinator answers it with a Rejection too; whichever comes first wins).

When a new step may start: sync mode once nothing is outstanding (the trainer waits for the
next version); bounded staleness (ssp, bound s) while at most s contributions are outstanding,
so this trainer's own contributions alone never push one beyond the bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from conveyor.services.trainer.plane.control import ControlState, Outcome, Rejected
from conveyor.services.trainer.plane.gradients import EncodedGrad

T = TypeVar("T")

Mode = Literal["sync", "ssp"]


@dataclass(kw_only=True, slots=True, eq=False)
class Pending(Generic[T]):
    """One outstanding contribution."""

    contribution_id: str
    base_version: int
    batches: list[T]
    """Its batches (the runner's ReadyBatch), kept until the decision."""
    num_samples: int
    loss_sum: float
    grad_bytes: int
    sent_at: float
    """Unix seconds."""
    feedback: EncodedGrad | None = field(default=None, repr=False)
    """Top-k error feedback: the encoded step, taken back out of the residuals if it is
    rejected (nothing it sent was applied); None without error feedback."""
    inner_state: dict[str, Any] | None = field(default=None, repr=False)
    """Local mode: the inner optimizer's state before the window, put back if it is rejected
    (:meth:`InnerOptimizer.state`); None in the other modes."""


class Outstanding(Generic[T]):
    """Contributions waiting for their decision, in sending order."""

    def __init__(self, *, mode: Mode, staleness: int) -> None:
        if mode not in ("sync", "ssp"):
            raise ValueError(f"mode must be sync or ssp, got {mode!r}")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.mode: Mode = mode
        self.staleness = staleness
        self._pending: dict[str, Pending[T]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[Pending[T]]:
        return iter(list(self._pending.values()))

    def add(self, pending: Pending[T]) -> None:
        if pending.contribution_id in self._pending:
            raise ValueError(f"contribution {pending.contribution_id} is already outstanding")
        self._pending[pending.contribution_id] = pending

    @property
    def can_start(self) -> bool:
        """A new step may be computed now (see the module docstring)."""
        if self.mode == "sync":
            return not self._pending
        return len(self._pending) <= self.staleness

    def resolve(self, control: ControlState) -> list[tuple[Pending[T], Outcome]]:
        """The outstanding contributions the log has decided, removed from here, in sending
        order (their outcomes are forgotten by ``control``)."""
        decided: list[tuple[Pending[T], Outcome]] = []
        for pending in list(self._pending.values()):
            outcome = control.outcome(pending.contribution_id)
            if outcome is None and self.mode == "sync" and control.version > pending.base_version:
                outcome = Rejected(f"version {pending.base_version + 1} closed without it")
            if outcome is None:
                continue
            control.forget(pending.contribution_id)
            del self._pending[pending.contribution_id]
            decided.append((pending, outcome))
        return decided
