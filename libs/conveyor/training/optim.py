"""Optimizers over parameter slices and the learning-rate schedule of a job.

SGD (momentum, Nesterov, weight decay), Adam and AdamW update every element from that
element's own gradient and state only, so running one optimizer per slice of the flattened
parameters (ZeRO-style partitioned optimizer state) gives exactly the update of one optimizer
over the whole model. :class:`SliceOptimizer` holds one slice as a single flat fp32
``nn.Parameter`` with its optimizer; :func:`lr_at` is the schedule the coordinator evaluates
for every step (the slice owners apply the ``lr`` its StepClose carries).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from conveyor.training.jobspec import JobSpec, LrScheduleSpec, OptimizerSpec


def build_optimizer(spec: OptimizerSpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer the job spec names, over ``params`` (learning rate ``spec.lr``)."""
    params = list(params)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
            nesterov=spec.nesterov,
        )
    if spec.name == "adam":
        return torch.optim.Adam(
            params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
    )


def momentum_correction(spec: JobSpec) -> bool:
    """Whether the job's trainers keep the SGD momentum (DGC momentum correction): top-k with
    error feedback and ``momentum_correction``, optimizer sgd with momentum > 0.

    Top-k sends an element once every ~1/ratio steps; momentum applied after sparsification
    (at the aggregator) would see a gradient that is zero most steps and a large delayed
    burst, and accuracy drops (4 points on the digits demo at 1%). Accumulating the momentum
    where the dense gradient is, before selecting, recovers most of it.
    """
    compression = spec.distribution.compression
    optimizer = spec.training.optimizer
    return (
        spec.distribution.mode != "local"  # the inner optimizer keeps its own momentum
        and compression.kind == "topk"
        and compression.error_feedback
        and compression.momentum_correction
        and optimizer.name == "sgd"
        and optimizer.momentum > 0
    )


def aggregator_optimizer(spec: JobSpec) -> OptimizerSpec:
    """The optimizer the slice owners run: local mode's outer optimizer; else the job's,
    without momentum when the trainers keep it (:func:`momentum_correction`); weight decay
    stays on the aggregator."""
    if spec.distribution.mode == "local":
        return spec.distribution.outer
    optimizer = spec.training.optimizer
    if momentum_correction(spec):
        return optimizer.model_copy(update={"momentum": 0.0, "nesterov": False})
    return optimizer


def staleness_momentum(momentum: float, staleness: int) -> float:
    """SGD momentum for a step whose gradient was computed ``staleness`` versions ago:
    ``momentum / (1 + staleness)``. ValueError for a negative staleness.

    Applying stale gradients acts as momentum of its own ("asynchrony begets momentum",
    Mitliagkas et al., 2016): a gradient computed ``d`` versions back repeats the direction of
    the last ``d`` steps. On top of an explicit 0.9 the sum overshoots: bounded-staleness
    training of the digits demo (SGD lr 0.1, momentum 0.9, staleness 1-2) stays at chance
    accuracy. Damping the explicit momentum by the staleness restores learning (0.94 after 5
    epochs in the in-process simulation, sync 0.97); scaling the learning rate down instead
    does not (0.2-0.5). A fresh gradient (staleness 0) keeps the full momentum.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return momentum / (1 + staleness)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Use learning rate ``lr`` for every parameter group from the next step on."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class SliceOptimizer:
    """One slice of the flat parameters (fp32 [n], a copy of ``values``) and its optimizer.

    Not thread-safe; one owner applies steps in version order.
    """

    __slots__ = ("job_momentum", "optimizer", "param")

    def __init__(self, spec: OptimizerSpec, values: torch.Tensor) -> None:
        if values.dim() != 1:
            raise ValueError(f"a slice is a 1-d vector, got shape {list(values.shape)}")
        self.param = nn.Parameter(values.detach().to(torch.float32).clone())
        self.optimizer = build_optimizer(spec, [self.param])
        self.job_momentum = spec.momentum

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def values(self) -> torch.Tensor:
        """The current parameters (a view; copy before handing them to another thread)."""
        return self.param.detach()

    def step(self, grad: torch.Tensor, lr: float, momentum: float | None = None) -> None:
        """One optimizer step with gradient ``grad`` (fp32 [n], already divided by the
        step's sample count) at learning rate ``lr``; ``momentum``: SGD momentum of this
        step (None: the optimizer's own). The momentum buffer carries over either way."""
        if grad.shape != self.param.shape:
            raise ValueError(f"gradient shape {list(grad.shape)} != slice {list(self.param.shape)}")
        self.param.grad = grad.to(dtype=torch.float32, device=self.param.device)
        set_lr(self.optimizer, lr)
        if "momentum" in self.optimizer.defaults:  # SGD; the job's unless this step says
            for group in self.optimizer.param_groups:
                group["momentum"] = self.job_momentum if momentum is None else momentum
        self.optimizer.step()
        self.param.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the optimizer's state of this slice by name (``momentum_buffer``;
        ``exp_avg``, ``exp_avg_sq`` and the scalar ``step`` of Adam/AdamW); empty before the
        first step or for stateless SGD. The hyper-parameters are not state: they come from
        the job spec and every step's StepClose."""
        state = self.optimizer.state.get(self.param, {})
        return {
            name: value.detach().clone()
            for name, value in state.items()
            if isinstance(value, torch.Tensor)
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_tensors` returned, so the next step is bit-identical to
        the one the saved optimizer would have taken. ValueError for a tensor whose size
        does not match the slice (the scalar ``step`` aside)."""
        for name, value in tensors.items():
            if value.dim() > 0 and value.shape != self.param.shape:
                raise ValueError(
                    f"optimizer state {name!r} has shape {list(value.shape)}, "
                    f"not the slice's {list(self.param.shape)}"
                )
        saved = self.optimizer.state_dict()
        state = {name: value.clone() for name, value in tensors.items()}
        saved["state"] = {0: state} if state else {}
        self.optimizer.load_state_dict(saved)


def lr_at(spec: LrScheduleSpec, base_lr: float, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total_steps``.

    Warmup (``step < warmup_steps``): ``base_lr * (step + 1) / warmup_steps``. Then, with
    ``t = step - warmup_steps`` and ``T = max(1, total_steps - warmup_steps)``:
    constant ``base_lr``; cosine
    ``min_lr + (base_lr - min_lr) * (1 + cos(pi * min(t, T) / T)) / 2``; step
    ``max(min_lr, base_lr * gamma ** (t // step_size))``. ValueError for a negative step.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < spec.warmup_steps:
        return base_lr * (step + 1) / spec.warmup_steps
    t = step - spec.warmup_steps
    if spec.name == "constant":
        return base_lr
    if spec.name == "cosine":
        span = max(1, total_steps - spec.warmup_steps)
        progress = min(t, span) / span
        return spec.min_lr + (base_lr - spec.min_lr) * (1.0 + math.cos(math.pi * progress)) / 2
    assert spec.step_size is not None  # the spec requires it for "step"
    return max(spec.min_lr, base_lr * spec.gamma ** (t // spec.step_size))
