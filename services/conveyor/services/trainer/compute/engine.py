"""The trainer's torch side: device and resources, the model step, evaluation, parameters in
and gradients out.

Every function here blocks; the service calls them from one compute thread (a single-worker
executor), never on the event loop.

Gradient accumulation: each micro-batch adds the gradient of its *summed* loss, so a
contribution's gradient is the sum over its samples; the aggregator divides the sum of all
contributions by the step's sample count (a step equals one batch of all its samples, loss
averaged by sample count, whatever the split between trainers and micro-batches). Local mode
steps the model with its inner optimizer instead and sends the window's weighted parameter
delta (:mod:`conveyor.services.trainer.compute.inner`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.services.trainer.compute.inner import InnerOptimizer, weighted_delta
from conveyor.services.trainer.plane.gradients import EncodedGrad, SliceEncoder
from conveyor.services.trainer.plane.streaming import BackwardSlices, SliceReady
from conveyor.training.jobspec import NormalizeSpec, ResourcesSpec
from conveyor.training.slicing import ParamLayout

logger = logging.getLogger(__name__)


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


def apply_resources(
    resources: ResourcesSpec, device: torch.device, *, deterministic: bool = False
) -> None:
    """Thread count (process-wide), the GPU memory cap of this process, and torch's
    deterministic algorithms on or off (process-wide: a trainer hosts one job at a time). On
    CUDA the default kernels are not bit-reproducible (cuDNN's convolution backward and
    atomics-based reductions: measured on an H200, a small CNN's parameters differed by 3e-3
    after 30 Adam steps; identical with deterministic algorithms); an op with no deterministic
    kernel then fails the job with torch's message instead of breaking the promise."""
    if deterministic:
        # torch refuses cuBLAS under deterministic algorithms unless a fixed workspace is
        # configured (8 x 4 MiB per stream; an operator's own setting wins). torch sizes the
        # workspace once per process, so a process that already ran a CUDA job keeps its size:
        # still one size for every step, and the compute runs on one stream.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False  # the fastest algorithm can differ per run
    # torch.use_deterministic_algorithms also sets torch.compile's (inductor's) flag, and
    # importing inductor's config costs ~3 s of CPU in every trainer process that runs a job;
    # nothing here compiles, so the flag the kernels read is set alone (checked by the public
    # torch.are_deterministic_algorithms_enabled in the unit tests).
    torch._C._set_deterministic_algorithms(deterministic)
    if resources.threads is not None:
        torch.set_num_threads(resources.threads)
    if resources.memory_fraction is not None:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(resources.memory_fraction, device)
        else:  # device auto on a trainer without a GPU (the spec refuses it with device cpu)
            logger.info("resources.memory_fraction caps GPU memory: not applied on %s", device)


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
    """Forward/backward and evaluation of one model on one device, at the job's precision;
    loads parameter versions in and encodes the step's gradient out.

    ``simulated_delay_s`` (a simulation/benchmark knob, normally 0): extra seconds slept after
    every micro-batch's forward/backward or evaluation, inside the timed compute, to emulate
    a slower accelerator (one machine simulating a heterogeneous pool).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        bf16: bool,
        normalizer: Normalizer,
        layout: ParamLayout,
        encoder: SliceEncoder,
        inner: InnerOptimizer | None = None,
        simulated_delay_s: float = 0.0,
    ) -> None:
        """``inner``: local mode's inner optimizer over ``model`` (None: sync, ssp)."""
        if simulated_delay_s < 0:
            raise ValueError(f"simulated_delay_s must be >= 0, got {simulated_delay_s}")
        self.model = model
        self.device = device
        self.bf16 = bf16
        self.normalize = normalizer
        self.layout = layout
        self.encoder = encoder
        self.inner = inner
        self.simulated_delay_s = simulated_delay_s
        self._base: torch.Tensor | None = None
        """Local mode: fp32 [N] parameters of the loaded version, on the device."""
        self._sent: torch.Tensor | None = None
        """Local mode with overlap_steps: fp32 [N] parameters as the last window ended (what
        its delta was taken from), on the device; None once moved onto a version."""

    def _simulate_slower_device(self) -> None:
        if self.simulated_delay_s > 0:
            time.sleep(self.simulated_delay_s)

    def _forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Summed per-sample loss of ``model`` on a batch and its number of correct predictions,
        as a float32 tensor [2] (loss keeps its graph). Images ``x`` uint8 [B,C,H,W] with labels
        ``y`` [B]: cross-entropy. Token ids ``x`` int32 [B,T] with targets ``y`` [B,T]: a
        sequence's loss is its mean next-token cross-entropy (so the eval loss is per token
        and exp of it the perplexity), and nothing counts as correct."""
        if self.device.type == "cuda":
            # The batch was copied on a side stream; keep its memory until this stream is done.
            stream = torch.cuda.current_stream(self.device)
            x.record_stream(stream)
            y.record_stream(stream)
        inputs = self.normalize(x) if x.dtype is torch.uint8 else x
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = model(inputs).float()  # [B,num_classes] or [B,T,vocab_size]
        if y.dim() == 2:
            token_losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            return torch.stack([token_losses / y.shape[1], torch.zeros_like(token_losses)])
        loss = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.detach().argmax(dim=1) == y).sum()
        return torch.stack([loss, correct.to(loss.dtype)])

    def load(self, flat: torch.Tensor) -> float:
        """Set the parameters to fp32 [N] ``flat`` (any device) and clear the gradients;
        returns the seconds it took."""
        started = time.perf_counter()
        self.layout.load_flat(self.model, flat.to(self.device))
        self.model.zero_grad(set_to_none=True)
        if self.inner is not None:
            self._base = self.layout.flatten_params(self.model)  # [N], a copy
            self._sent = None
        self._synchronize()
        return time.perf_counter() - started

    def accumulate(self, x: torch.Tensor, y: torch.Tensor, seed: int | None = None) -> MicroResult:
        """Add the gradient of the summed loss of batch ``x``, ``y`` (see ``_forward``).
        ``seed``: torch's RNG is seeded with it first (deterministic mode: the model's
        randomness, dropout say, then depends on the batch alone)."""
        started = time.perf_counter()
        if seed is not None:
            torch.manual_seed(seed)
        self.model.train()
        loss_and_correct = self._forward(self.model, x, y)
        loss_and_correct[0].backward()  # type: ignore[no-untyped-call]
        loss_sum, correct = loss_and_correct.detach().tolist()  # one device synchronisation
        self._simulate_slower_device()
        return MicroResult(loss_sum, int(correct), int(y.shape[0]), time.perf_counter() - started)

    def accumulate_streamed(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        seed: int | None,
        num_samples: int,
        ready: SliceReady,
    ) -> tuple[MicroResult, EncodedGrad, float]:
        """A step's last micro-batch: :meth:`accumulate`, with each slice of the step's
        gradient (``num_samples`` samples, this batch's included) encoded and handed to
        ``ready`` as soon as the backward pass has completed it
        (:class:`~conveyor.services.trainer.plane.streaming.BackwardSlices`), the others when
        the pass has ended; then :meth:`gradient`'s result without its work. Returns the pass
        (its ``compute_s`` without the encoding), the encoded gradient, the seconds spent
        encoding."""
        started = time.perf_counter()
        slices = BackwardSlices(
            self.model, self.layout, self.encoder, num_samples=num_samples, ready=ready
        )
        with slices.armed():
            result = self.accumulate(x, y, seed)
        encoded = slices.finish()
        self.model.zero_grad(set_to_none=True)
        compute_s = time.perf_counter() - started - slices.encode_s
        return dataclasses.replace(result, compute_s=compute_s), encoded, slices.encode_s

    def gradient(self, num_samples: int) -> tuple[EncodedGrad, float]:
        """The gradient accumulated over ``num_samples`` samples, flattened, sliced and encoded
        (slices on the CPU), with the model's running statistics times ``num_samples`` (the
        aggregator averages them: departure 28); clears the gradients. Returns it and the
        seconds it took."""
        started = time.perf_counter()
        flat = self.layout.flatten_grads(self.model, num_samples)  # [N]
        encoded = self.encoder.encode(flat, num_samples)  # -> K slices
        self.model.zero_grad(set_to_none=True)
        return encoded, time.perf_counter() - started

    def inner_step(self, num_samples: int, lr: float) -> float:
        """Local mode: one inner optimizer step on the gradient accumulated over
        ``num_samples`` samples; returns the seconds it took."""
        assert self.inner is not None, "inner steps are local mode's"
        started = time.perf_counter()
        self.inner.step(num_samples, lr)
        self._synchronize()
        return time.perf_counter() - started

    def first_inner_step(self, num_samples: int, lr: float) -> dict[str, Any]:
        """Local mode: a window's first inner step (:meth:`inner_step`), returning the inner
        optimizer's state from before it, to put back if the window is rejected. One call on
        the compute thread instead of two: each hand-off costs ~1 ms on a loaded machine."""
        assert self.inner is not None, "inner steps are local mode's"
        state = self.inner.state()
        self.inner_step(num_samples, lr)
        return state

    def accumulate_and_step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        seed: int | None,
        num_samples: int,
        lr: float,
        first: bool,
    ) -> tuple[MicroResult, dict[str, Any] | None]:
        """Local mode: an inner step's last micro-batch (:meth:`accumulate`) and the step on
        the ``num_samples`` samples accumulated, its own included, in one call on the compute
        thread instead of two. ``first``: the window's first step (:meth:`first_inner_step`),
        whose state from before it is returned (else None). The pass's ``compute_s`` is the
        micro-batch's alone, as :meth:`accumulate`'s."""
        result = self.accumulate(x, y, seed)
        if first:
            return result, self.first_inner_step(num_samples, lr)
        self.inner_step(num_samples, lr)
        return result, None

    def delta(self, num_samples: int) -> tuple[EncodedGrad, float]:
        """Local mode: the window's parameter delta since the loaded version, times its
        ``num_samples`` samples, sliced and encoded like a gradient. Returns it and the
        seconds it took."""
        assert self._base is not None, "load a version before a window"
        started = time.perf_counter()
        local = self.layout.flatten_params(self.model)  # [N]
        encoded = self.encoder.encode(weighted_delta(self._base, local, num_samples), num_samples)
        assert self.inner is not None
        self._sent = local if self.inner.overlap_steps else None
        return encoded, time.perf_counter() - started

    def rebase(self, flat: torch.Tensor) -> float:
        """Local mode's overlap: move the parameters onto version ``flat`` (fp32 [N], any
        device) keeping what the inner steps since the last delta added
        (``flat + (current - sent)``, statistics alike), and make ``flat`` the window's base;
        the inner optimizer's state stays. Returns the seconds it took."""
        assert self._sent is not None, "rebase follows a window's delta"
        started = time.perf_counter()
        base = flat.to(self.device, dtype=torch.float32, copy=True)  # [N], not the caller's
        current = self.layout.flatten_params(self.model)  # [N]
        self.layout.load_flat(self.model, base + (current - self._sent))
        self.model.zero_grad(set_to_none=True)
        self._base = base
        self._sent = None
        self._synchronize()
        return time.perf_counter() - started

    @property
    def can_overlap(self) -> bool:
        """Local mode with overlap_steps, and a window's delta taken that no step rebased yet."""
        return self._sent is not None

    def discard_gradient(self) -> None:
        """Clear the accumulated gradient (a step abandoned before it was sent)."""
        self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> MicroResult:
        """Loss and accuracy of ``model`` (a snapshot) on one eval batch; no gradient."""
        started = time.perf_counter()
        loss_sum, correct = self._forward(model, x, y).tolist()
        self._simulate_slower_device()
        return MicroResult(loss_sum, int(correct), int(y.shape[0]), time.perf_counter() - started)

    def snapshot(self, flat: torch.Tensor) -> nn.Module:
        """A frozen copy of the model holding fp32 [N] ``flat``, in eval mode (evaluating an
        epoch on its end-of-epoch parameters)."""
        frozen = copy.deepcopy(self.model)
        frozen.zero_grad(set_to_none=True)
        self.layout.load_flat(frozen, flat.to(self.device))
        frozen.eval()
        frozen.requires_grad_(False)
        return frozen

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
