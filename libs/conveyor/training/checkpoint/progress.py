"""A job's progress at a checkpointed version, as its coordinator folded it: what a resume
needs beside the slices' parameters and optimizer state.

The coordinator snapshots it when it folds a StepClose that asks for a checkpoint; the owner of
slice 0 writes it into its slice file (``progress`` metadata as JSON, the ledger as two int32
tensors), so the manifest's checksum covers it. A resume reads it back
(:func:`~.resume.resume_point`): the sharder turns it into the :class:`~conveyor.platform.messages.
ResumePoint` that starts the resumed job's control log, and every aggregator puts the ledger
and the epoch results back into its coordinator (:mod:`.resume` reads it).

A checkpoint is *usable* for a resume when every epoch that ended before its version has its
evaluation complete in the snapshot: the parameters an earlier epoch was evaluated on are gone
after a resume, while an epoch that ended at the checkpoint's version itself is evaluated
again on the checkpoint's parameters. An ``epoch_end`` checkpoint taken after every earlier
epoch's evaluation came in is therefore always usable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from conveyor.platform.messages import EndedEpoch, ResumePoint
from conveyor.training.ledger import Ledger

if TYPE_CHECKING:
    import torch

PROGRESS_METADATA_KEY = "progress"
LEDGER_EPOCHS_TENSOR = "progress.ledger_epochs"
LEDGER_COUNTS_TENSOR = "progress.ledger_counts"
STEP_LOSSES_TENSOR = "progress.step_losses"
PROGRESS_TENSORS = (LEDGER_EPOCHS_TENSOR, LEDGER_COUNTS_TENSOR, STEP_LOSSES_TENSOR)
"""The tensors of a slice file that are the progress's (older files lack the step losses)."""


@dataclass(frozen=True, slots=True)
class EpochOutcome:
    """An ended epoch: when it ended, and its result once its evaluation is complete."""

    version: int
    """The version that applied its last train batch."""
    evaluated: bool
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    train_loss: float | None = None


@dataclass(kw_only=True, slots=True)
class JobProgress:
    """The coordinator's state at ``version`` that outlives the job's topics."""

    version: int
    steps: int
    """Optimizer steps with samples up to ``version``."""
    samples_trained: int
    ended: dict[int, EpochOutcome] = field(default_factory=dict)
    """Ended epochs -> how they ended."""
    train_loss: dict[int, tuple[float, int]] = field(default_factory=dict)
    """Epochs without a result yet -> (train loss sum, samples) so far."""
    applied_batches: list[str] = field(default_factory=list)
    """Train batches of the epochs not ended that ``version`` includes."""
    ledger: Ledger
    """The sample ledger at ``version``."""
    step_losses: list[float] = field(default_factory=list)
    """Mean training loss of every step up to ``version``, in step order (a checkpoint
    written before they were kept has none)."""

    @property
    def usable(self) -> bool:
        """Whether a job can resume from it (module docstring)."""
        return all(o.evaluated or o.version == self.version for o in self.ended.values())

    def resume_point(self, job_id: str) -> ResumePoint:
        """The control-log record that starts a job resumed from here. ValueError when the
        progress is not :attr:`usable`."""
        if not self.usable:
            raise ValueError(f"version {self.version}: an earlier epoch's evaluation is missing")
        return ResumePoint(
            job_id=job_id,
            version=self.version,
            steps=self.steps,
            samples_trained=self.samples_trained,
            ended_epochs=[
                EndedEpoch(epoch=e, version=o.version, evaluated=o.evaluated)
                for e, o in sorted(self.ended.items())
            ],
            applied_batches=list(self.applied_batches),
        )

    # -- in a slice file -------------------------------------------------------------------

    def to_file_parts(self) -> tuple[str, dict[str, torch.Tensor]]:
        """(JSON metadata, tensors) for a safetensors file."""
        import torch  # here, as in .slicefile, its one caller: the rest of the module is torch-free

        document = {
            "version": self.version,
            "steps": self.steps,
            "samples_trained": self.samples_trained,
            "ended": {str(e): _outcome_json(o) for e, o in self.ended.items()},
            "train_loss": {str(e): list(t) for e, t in self.train_loss.items()},
            "applied_batches": self.applied_batches,
            "num_samples": self.ledger.num_samples,
        }
        arrays = self.ledger.to_arrays()
        tensors = {
            LEDGER_EPOCHS_TENSOR: torch.from_numpy(arrays["epochs"]),  # int32 [E]
            LEDGER_COUNTS_TENSOR: torch.from_numpy(arrays["counts"]),  # int32 [E, num_samples]
            STEP_LOSSES_TENSOR: torch.tensor(self.step_losses, dtype=torch.float64),  # [steps]
        }
        return json.dumps(document, separators=(",", ":")), tensors

    @classmethod
    def from_file_parts(cls, metadata: str, tensors: Mapping[str, Any]) -> JobProgress:
        """What :meth:`to_file_parts` wrote, its tensors as CPU torch tensors or numpy arrays
        (:mod:`.slicehead` reads them without torch); ValueError for anything malformed."""
        try:
            raw = json.loads(metadata)
            counts = np.asarray(tensors[LEDGER_COUNTS_TENSOR])
            ledger = Ledger.from_arrays({
                "epochs": np.asarray(tensors[LEDGER_EPOCHS_TENSOR]),
                "counts": counts if counts.size else np.zeros((0, raw["num_samples"]), np.int32),
            })  # fmt: skip
            return cls(
                version=int(raw["version"]),
                steps=int(raw["steps"]),
                samples_trained=int(raw["samples_trained"]),
                ended={int(e): EpochOutcome(**o) for e, o in raw["ended"].items()},
                train_loss={int(e): (float(s), int(n)) for e, (s, n) in raw["train_loss"].items()},
                applied_batches=[str(b) for b in raw["applied_batches"]],
                ledger=ledger,
                step_losses=_step_losses(tensors.get(STEP_LOSSES_TENSOR)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed job progress: {exc}") from exc


def _step_losses(tensor: Any) -> list[float]:
    if tensor is None:  # a checkpoint from before step losses were kept
        return []
    losses = np.asarray(tensor)
    if losses.dtype != np.float64 or losses.ndim != 1:
        raise ValueError(f"step losses must be float64 [steps], got {losses.dtype} {losses.shape}")
    return [float(loss) for loss in losses.tolist()]


def _outcome_json(outcome: EpochOutcome) -> dict[str, Any]:
    return {
        "version": outcome.version,
        "evaluated": outcome.evaluated,
        "eval_loss": outcome.eval_loss,
        "eval_accuracy": outcome.eval_accuracy,
        "train_loss": outcome.train_loss,
    }
