"""The trainer's torch side: device and resources, the model step, evaluation, the update.

Every function here blocks; the service calls them from one compute thread
(``asyncio.to_thread`` on a single-worker executor), never on the event loop.

Gradient accumulation: each micro-batch adds the gradient of its *summed* loss; the update
divides the accumulated gradient by the step's sample count, so a step of several micro-batches
equals one batch of all their samples (loss averaged by sample count), whatever their sizes.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.libs.jobspec import NormalizeSpec, OptimizerSpec, ResourcesSpec


def resolve_device(requested: str) -> torch.device:
    """``auto`` -> cuda when present, else cpu. ValueError when CUDA is asked for but absent."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} requested but CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {requested!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
    return device


def apply_resources(resources: ResourcesSpec, device: torch.device) -> None:
    """Thread count (process-wide) and the GPU memory cap of this process."""
    if resources.threads is not None:
        torch.set_num_threads(resources.threads)
    if resources.memory_fraction is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(resources.memory_fraction, device)


def build_optimizer(spec: OptimizerSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The job's optimizer over ``params``."""
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


class Normalizer:
    """uint8 images -> float on the device: ``(x / 255 - mean) / std`` per channel."""

    def __init__(self, spec: NormalizeSpec | None, channels: int, device: torch.device) -> None:
        mean = spec.mean if spec is not None else [0.0]
        std = spec.std if spec is not None else [1.0]
        if len(mean) not in (1, channels):
            raise ValueError(f"normalize has {len(mean)} values for {channels} channel(s)")
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: uint8 [B,C,H,W] -> float32 [B,C,H,W]
        return (x.to(torch.float32) / 255.0 - self.mean) / self.std


@dataclass(frozen=True, slots=True)
class MicroResult:
    """One micro-batch's forward/backward or evaluation."""

    loss_sum: float
    """Summed cross-entropy over the batch's samples."""
    correct: int
    """Samples whose arg-max prediction was the label."""
    samples: int
    compute_s: float
    """Wall time of the work, device synchronised (seconds)."""


class Engine:
    """Forward/backward and evaluation of one model on one device, at the job's precision.

    ``simulated_delay_s`` (a simulation/benchmark knob, normally 0): extra seconds slept after
    every micro-batch's forward/backward or evaluation, inside the timed compute, to emulate
    a slower accelerator (flow-control and autoscaling tests, one-GPU simulation of a
    heterogeneous pool).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        bf16: bool,
        normalizer: Normalizer,
        simulated_delay_s: float = 0.0,
    ) -> None:
        if simulated_delay_s < 0:
            raise ValueError(f"simulated_delay_s must be >= 0, got {simulated_delay_s}")
        self.model = model
        self.device = device
        self.bf16 = bf16
        self.normalize = normalizer
        self.simulated_delay_s = simulated_delay_s

    def _simulate_slower_device(self) -> None:
        if self.simulated_delay_s > 0:
            time.sleep(self.simulated_delay_s)

    def _forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of ``model`` on ``x`` uint8 [B,C,H,W], ``y`` [B] and the
        number of correct predictions, as a float32 tensor [2] (loss keeps its graph)."""
        if self.device.type == "cuda":
            # The batch was copied on a side stream; keep its memory until this stream is done.
            stream = torch.cuda.current_stream(self.device)
            x.record_stream(stream)
            y.record_stream(stream)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = model(self.normalize(x)).float()  # [B,num_classes]
        loss = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.detach().argmax(dim=1) == y).sum()
        return torch.stack([loss, correct.to(loss.dtype)])

    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> MicroResult:
        """Add the gradient of the summed loss of batch ``x`` uint8 [B,C,H,W], ``y`` [B]."""
        started = time.perf_counter()
        self.model.train()
        loss_and_correct = self._forward(self.model, x, y)
        loss_and_correct[0].backward()  # type: ignore[no-untyped-call]
        loss_sum, correct = loss_and_correct.detach().tolist()  # one device synchronisation
        self._simulate_slower_device()
        return MicroResult(loss_sum, int(correct), int(y.shape[0]), time.perf_counter() - started)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> MicroResult:
        """Loss and accuracy of ``model`` (a snapshot) on one eval batch; no gradient."""
        started = time.perf_counter()
        loss_sum, correct = self._forward(model, x, y).tolist()
        self._simulate_slower_device()
        return MicroResult(loss_sum, int(correct), int(y.shape[0]), time.perf_counter() - started)

    def snapshot(self) -> nn.Module:
        """A frozen copy of the model in eval mode (for evaluating an epoch later)."""
        frozen = copy.deepcopy(self.model)
        frozen.eval()
        frozen.requires_grad_(False)
        return frozen


class Updater(Protocol):
    """Turns a step's accumulated gradient into new parameters.

    Issue 3: :class:`LocalUpdater` steps a local optimizer. Issue 4 swaps in one that sends the
    gradient slices to the aggregator shards and waits for the next parameter version.
    """

    def apply(self, num_samples: int) -> float:
        """Apply the gradient summed over ``num_samples`` samples; return the seconds it took.
        Leaves the gradients cleared for the next step."""
        ...


class LocalUpdater:
    """Runs the job's optimizer in this process on the mean gradient of the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def apply(self, num_samples: int) -> float:
        if num_samples < 1:
            raise ValueError(f"a step needs at least one sample, got {num_samples}")
        started = time.perf_counter()
        scale = 1.0 / num_samples
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if param_device(self.model).type == "cuda":
            torch.cuda.synchronize(param_device(self.model))
        return time.perf_counter() - started


def param_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (cpu for a model without any)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")
