"""Local mode's inner optimizer: the job's optimizer, run by each trainer on its own batches
for ``sync_every_steps`` (H) steps between two outer steps (DiLoCo, Douillard et al. 2023).

A window starts from the version the trainer loaded (``base``); each inner step divides the
gradient accumulated over its micro-batches (of the SUM of per-sample losses) by their sample
count and takes one optimizer step at the job's schedule; after the window the trainer sends
``(base - local) * num_samples``, so that the slice owners' ``sum / StepClose.num_samples`` is
the sample-weighted mean parameter delta, the outer optimizer's gradient.

The optimizer state (momentum, Adam moments) stays with the trainer across windows, as in
DiLoCo; a trainer that restarts starts it afresh (the trainers keep no state that a replacement
needs, departure 5). A rejected window leaves none of it: the trainer takes a copy before each
window (:meth:`InnerOptimizer.state`) and restores it when the window is rejected, so the window
recomputed on the new version steps as if the rejected one had never run.

Inner step ``i`` of the window on version ``v`` is schedule step ``v * H + i``: with H steps of
the global batch per version, the schedule counts steps as sync mode does. Blocking tensor
work: call from the compute thread.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from conveyor.training.jobspec import JobSpec
from conveyor.training.optim import build_optimizer, lr_at, set_lr


class InnerOptimizer:
    """The job's optimizer over the trainer's working model; see the module docstring."""

    def __init__(self, spec: JobSpec, model: nn.Module, *, train_batches_per_epoch: int) -> None:
        window = spec.distribution.sync_every_steps
        if window is None:
            raise ValueError("an inner optimizer needs distribution.sync_every_steps (local mode)")
        self.window = window
        self.overlap_steps = spec.distribution.overlap_steps
        """Inner steps of the next window that may run while a window's delta travels."""
        self._micro_batches_per_step = spec.micro_batches_per_step
        self._model = model
        self._training = spec.training
        self._optimizer = build_optimizer(spec.training.optimizer, model.parameters())
        steps = spec.training.epochs * math.ceil(
            train_batches_per_epoch / spec.micro_batches_per_step
        )
        max_versions = spec.training.max_steps
        self.total_steps = steps if max_versions is None else min(steps, max_versions * window)
        """Inner steps the schedule spans (``max_steps`` counts outer versions here)."""

    def lr(self, version: int, index: int) -> float:
        """Learning rate of inner step ``index`` (0-based) of the window on ``version``."""
        training = self._training
        step = version * self.window + index
        return lr_at(training.lr_schedule, training.optimizer.lr, step, self.total_steps)

    def waiting_steps(self, train_left: int) -> int:
        """:func:`waiting_steps` of a window at this job's micro-batches per step."""
        return waiting_steps(train_left, self._micro_batches_per_step)

    def state(self) -> dict[str, Any]:
        """A copy of the optimizer's state (momentum buffers, Adam moments; empty before the
        first step), to :meth:`restore` if the window about to run is rejected."""
        return copy.deepcopy(self._optimizer.state_dict())

    def restore(self, state: dict[str, Any]) -> None:
        """Put back a :meth:`state` copy (the learning rate is set again at every step)."""
        self._optimizer.load_state_dict(state)

    def step(self, num_samples: int, lr: float) -> None:
        """One optimizer step on the gradient accumulated over ``num_samples`` samples (>= 1),
        at ``lr``; clears the gradients."""
        if num_samples < 1:
            raise ValueError(f"an inner step needs samples, got {num_samples}")
        grads = [param.grad for param in self._model.parameters() if param.grad is not None]
        if grads:  # one fused division (one kernel on a GPU) instead of one per tensor
            torch._foreach_div_(grads, num_samples)  # summed loss -> mean over the samples
        set_lr(self._optimizer, lr)
        self._optimizer.step()
        self._model.zero_grad(set_to_none=True)


def weighted_delta(base: torch.Tensor, local: torch.Tensor, num_samples: int) -> torch.Tensor:
    """fp32 [N]: ``(base - local) * num_samples``, a window's parameter delta weighted by its
    samples (what a contribution sends in place of a summed gradient)."""
    return (base - local) * float(num_samples)


def waiting_steps(train_left: int, micro_batches_per_step: int) -> int:
    """How many inner steps of a window may wait for a batch to arrive: as many as the
    epoch's train batches not applied yet (``train_left``, counted at the window's start, when
    every earlier window is decided) fill whole for the pool, at least 1. A later step takes
    the batches that have arrived and waits for none: the epoch's remainder is some trainers'
    and not others', which a trainer cannot tell inside a window, so each waited
    ``empty_contribution_wait_s`` at every epoch's end for a batch that did not exist. A batch
    such a step leaves goes into the next window. At least 1: a window whose data is late
    waits for it rather than turn into a run of empty versions."""
    if micro_batches_per_step < 1:
        raise ValueError(f"micro_batches_per_step must be >= 1, got {micro_batches_per_step}")
    return max(1, train_left // micro_batches_per_step)
