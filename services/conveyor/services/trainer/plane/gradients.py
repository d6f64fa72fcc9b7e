"""A step's gradient on its way out: flat vector -> K slices -> wire encoding.

The flat fp32 [N] gradient (of the SUM of the per-sample losses) is cut at the layout's slice
bounds; each slice is encoded as the job asks (:mod:`conveyor.training.compression`): dense fp32,
fp16/bf16 casts, or top-k of the largest magnitudes. Top-k with error feedback keeps what a
step did not send in a residual per slice (here, in the trainer) and adds it to the next
step's gradient before selecting; with momentum correction (:func:`momentum_correction`) the
trainer also keeps the SGD momentum, in units of the per-sample MEAN gradient so that steps
of any size add up consistently: it encodes ``grad / num_samples`` and sends the values times
``num_samples``, which keeps the aggregator's weighting by sample counts unchanged. If a
contribution is rejected, nothing it sent was applied and its batches are recomputed:
:meth:`SliceEncoder.undo` takes its share back out of the residuals and velocities.

Blocking (tensor work): call from the compute thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.training.compression import EncodedSlice, TopKFeedback, encode_slice, encoding_for
from conveyor.training.jobspec import CompressionSpec, JobSpec
from conveyor.training.optim import momentum_correction


@dataclass(frozen=True, slots=True)
class EncodedGrad:
    """One step's encoded slices and what a rejection needs to undo them."""

    slices: list[EncodedSlice]
    """Slice p at index p."""
    feedback_inputs: list[torch.Tensor] | None = None
    """Top-k with error feedback: per slice, the step's input to the error feedback (the
    gradient, divided by ``scale``); None otherwise."""
    scale: float = 1.0
    """The sent values are the selected ones times ``scale``."""

    @property
    def nbytes(self) -> int:
        """Payload bytes of all slices."""
        return sum(s.nbytes for s in self.slices)


class SliceEncoder:
    """Encodes the flat gradients of one trainer's steps; holds the top-k residuals (and the
    momentum-correction velocities)."""

    def __init__(
        self,
        compression: CompressionSpec,
        bounds: Sequence[tuple[int, int]],
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        """``momentum``/``nesterov``: the SGD momentum the trainer keeps (top-k momentum
        correction); 0 = none."""
        self.encoding = encoding_for(compression.kind)
        self.bounds = list(bounds)
        self._feedback: TopKFeedback | None = None
        if self.encoding == "topk":
            assert compression.ratio is not None  # the spec requires it for topk
            self._feedback = TopKFeedback(
                compression.ratio,
                error_feedback=compression.error_feedback,
                momentum=momentum,
                nesterov=nesterov,
            )
        elif momentum:
            raise ValueError("momentum correction applies to topk only")

    @classmethod
    def for_job(cls, spec: JobSpec, bounds: Sequence[tuple[int, int]]) -> SliceEncoder:
        """The encoder of ``spec``'s trainers, with momentum correction when the job has it
        (:func:`conveyor.training.optim.momentum_correction`)."""
        optimizer = spec.training.optimizer
        if not momentum_correction(spec):
            return cls(spec.distribution.compression, bounds)
        return cls(
            spec.distribution.compression,
            bounds,
            momentum=optimizer.momentum,
            nesterov=optimizer.nesterov,
        )

    @property
    def error_feedback(self) -> bool:
        return self._feedback is not None and self._feedback.error_feedback

    def encode(self, flat_grad: torch.Tensor, num_samples: int) -> EncodedGrad:
        """Encode fp32 [N] ``flat_grad`` (any device), the summed-loss gradient of
        ``num_samples`` samples; the slices are on the CPU."""
        if flat_grad.dim() != 1 or flat_grad.numel() != (self.bounds[-1][1] if self.bounds else 0):
            raise ValueError(f"gradient of shape {list(flat_grad.shape)} does not fit the layout")
        parts = [
            self.encode_part(p, flat_grad[start:stop], num_samples)
            for p, (start, stop) in enumerate(self.bounds)
        ]
        return self.join(parts, num_samples)

    def encode_part(
        self, index: int, grad_slice: torch.Tensor, num_samples: int
    ) -> tuple[EncodedSlice, torch.Tensor | None]:
        """Encode slice ``index`` alone: fp32 [stop - start] ``grad_slice`` (any device) of the
        gradient of ``num_samples`` samples. Returns the slice (on the CPU) and, with error
        feedback, its input to the feedback (what :meth:`join` keeps for :meth:`undo`). The
        same bytes as the slice of :meth:`encode`, whatever order the slices are encoded in
        (each slice's residual and velocity are its own)."""
        start, stop = self.bounds[index]
        if grad_slice.dim() != 1 or grad_slice.numel() != stop - start:
            raise ValueError(
                f"slice {index} of shape {list(grad_slice.shape)} does not fit [{start}, {stop})"
            )
        feedback = self._feedback
        if feedback is None:
            return encode_slice(grad_slice, self.encoding), None
        grad = grad_slice.detach() / self._scale(num_samples)
        part = feedback.encode(index, grad, scale=self._scale(num_samples))
        return part, grad if feedback.error_feedback else None

    def join(
        self, parts: Sequence[tuple[EncodedSlice, torch.Tensor | None]], num_samples: int
    ) -> EncodedGrad:
        """One step's gradient from its K slices encoded by :meth:`encode_part`, slice p at
        index p."""
        if len(parts) != len(self.bounds):
            raise ValueError(f"{len(parts)} slices for a layout of {len(self.bounds)}")
        slices = [part for part, _ in parts]
        if self._feedback is None:
            return EncodedGrad(slices)
        inputs = [grad for _, grad in parts if grad is not None]
        assert len(inputs) == (len(parts) if self._feedback.error_feedback else 0)
        feedback_inputs = inputs if self._feedback.error_feedback else None
        return EncodedGrad(slices, feedback_inputs, self._scale(num_samples))

    def _scale(self, num_samples: int) -> float:
        """Momentum correction keeps its state in per-sample-mean units: a step's input is its
        summed gradient divided by this, and what it sends is multiplied back."""
        feedback = self._feedback
        return float(max(1, num_samples)) if feedback is not None and feedback.momentum else 1.0

    def undo(self, encoded: EncodedGrad) -> None:
        """A contribution encoded with error feedback was rejected: nothing it sent was
        applied and its batches are recomputed, so take its share back out of the residuals
        (and velocities), leaving them as if it had never been encoded."""
        feedback = self._feedback
        assert feedback is not None and encoded.feedback_inputs is not None
        for p, (grad, sent) in enumerate(zip(encoded.feedback_inputs, encoded.slices, strict=True)):
            feedback.undo(p, grad, sent, encoded.scale)
