"""A step's gradient on its way out: flat vector -> K slices -> wire encoding.

The flat fp32 [N] gradient (of the SUM of the per-sample losses) is cut at the layout's slice
bounds; each slice is encoded as the job asks (:mod:`conveyor.libs.compression`): dense fp32,
fp16/bf16 casts, or top-k of the largest magnitudes. Top-k with error feedback keeps what a
step did not send in a residual per slice (here, in the trainer) and adds it to the next
step's gradient before selecting. If a contribution is rejected, nothing it sent was applied
and its batches are recomputed: :meth:`SliceEncoder.undo` restores the residuals it changed.

Blocking (tensor work): call from the compute thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.libs.compression import (
    EncodedSlice,
    TopKFeedback,
    decode_slice,
    encode_slice,
    encoding_for,
)
from conveyor.libs.jobspec import CompressionSpec


@dataclass(frozen=True, slots=True)
class EncodedGrad:
    """One step's encoded slices and what a rejection needs to undo them."""

    slices: list[EncodedSlice]
    """Slice p at index p."""
    feedback_delta: list[torch.Tensor] | None
    """Top-k with error feedback: per slice, ``sent - grad`` (adding it to the residual undoes
    this step's change of it); None otherwise."""

    @property
    def nbytes(self) -> int:
        """Payload bytes of all slices."""
        return sum(s.nbytes for s in self.slices)


class SliceEncoder:
    """Encodes the flat gradients of one trainer's steps; holds the top-k residuals."""

    def __init__(self, spec: CompressionSpec, bounds: Sequence[tuple[int, int]]) -> None:
        self.encoding = encoding_for(spec.kind)
        self.bounds = list(bounds)
        self._feedback: TopKFeedback | None = None
        if self.encoding == "topk":
            assert spec.ratio is not None  # the spec requires it for topk
            self._feedback = TopKFeedback(spec.ratio, error_feedback=spec.error_feedback)

    @property
    def error_feedback(self) -> bool:
        return self._feedback is not None and self._feedback.error_feedback

    def encode(self, flat_grad: torch.Tensor) -> EncodedGrad:
        """Encode fp32 [N] ``flat_grad`` (any device); the slices are on the CPU."""
        if flat_grad.dim() != 1 or flat_grad.numel() != (self.bounds[-1][1] if self.bounds else 0):
            raise ValueError(f"gradient of shape {list(flat_grad.shape)} does not fit the layout")
        feedback = self._feedback
        if feedback is None:
            cpu = flat_grad.detach().to("cpu", torch.float32)
            return EncodedGrad(
                [encode_slice(cpu[start:stop], self.encoding) for start, stop in self.bounds],
                None,
            )
        slices: list[EncodedSlice] = []
        deltas: list[torch.Tensor] = []
        for p, (start, stop) in enumerate(self.bounds):
            grad = flat_grad[start:stop]
            encoded = feedback.encode(p, grad)
            slices.append(encoded)
            if feedback.error_feedback:
                sent = decode_slice("topk", encoded.values, encoded.indices, encoded.numel)
                deltas.append(sent.to(grad.device) - grad.detach().to(torch.float32))
        return EncodedGrad(slices, deltas if feedback.error_feedback else None)

    def undo(self, feedback_delta: Sequence[torch.Tensor]) -> None:
        """A contribution encoded with error feedback was rejected: nothing it sent was
        applied and its batches are recomputed, so take its share back out of the residuals
        (``residual += sent - grad``), leaving them as if it had never been encoded."""
        feedback = self._feedback
        assert feedback is not None and feedback.error_feedback
        for p, delta in enumerate(feedback_delta):
            feedback.correct(p, delta)
