"""Encoding of one gradient slice on the wire (GradSlice ``encoding``), both directions.

- ``dense``: float32 values, all ``numel`` of them (job compression ``none``);
- ``fp16`` / ``bf16``: the values cast to that dtype (half the bytes; ``decode`` casts back);
- ``topk``: the ``k`` elements of largest magnitude as bfloat16 ``values`` at int32
  ``indices`` (6 bytes an element: at ratio 1% that is 66x fewer bytes than dense fp32);
  every other element is zero.

Top-k with error feedback (the trainer's side): what a step does not send is kept in a local
residual per slice and added to the next step's gradient before selecting, so over many steps
``sum(sent) + residual == sum(true gradients)`` and nothing is lost, only delayed; the
residual also carries the bf16 rounding of what was sent (:class:`TopKFeedback`, which also
does DGC momentum correction). :func:`select_topk` is the one selection both sides rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from conveyor.platform.errors import ConveyorError

Encoding = Literal["dense", "fp16", "bf16", "topk"]
ENCODINGS: tuple[Encoding, ...] = ("dense", "fp16", "bf16", "topk")
_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_NO_INDICES = torch.zeros(0, dtype=torch.int32)
TOPK_VALUE_DTYPE = torch.bfloat16
"""Dtype of top-k values on the wire: fp32's range (a sum of per-sample gradients cannot
overflow it), 8 bits of mantissa; error feedback carries the rounding to the next step."""


class CompressionError(ConveyorError):
    """A received slice is inconsistent (wrong dtype, sizes or indices); not retriable."""


@dataclass(frozen=True, slots=True)
class EncodedSlice:
    """One slice as it travels: the GradSlice fields ``encoding``, ``values``, ``indices``."""

    encoding: Encoding
    values: torch.Tensor
    """[numel] (dense fp32, fp16, bf16) or bf16 [k] (topk)."""
    indices: torch.Tensor
    """int32 [k] for topk, empty otherwise."""
    numel: int
    """Elements of the dense slice."""

    @property
    def nbytes(self) -> int:
        """Payload bytes (values + indices)."""
        return _nbytes(self.values) + _nbytes(self.indices)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def encoding_for(kind: str) -> Encoding:
    """The wire encoding of a job's ``compression.kind`` (``none`` -> ``dense``)."""
    if kind == "none":
        return "dense"
    if kind in ("fp16", "bf16", "topk"):
        return kind  # type: ignore[return-value]
    raise ValueError(f"unknown compression kind {kind!r}")


def topk_count(numel: int, ratio: float) -> int:
    """Elements kept by top-k at ``ratio``: ``ceil(numel * ratio)``, at least 1, at most
    ``numel`` (0 for an empty slice)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(numel * ratio)))


def select_topk(dense: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 values [k], int32 indices [k]) of the ``k`` largest ``|dense|`` elements, indices
    ascending (ties broken by torch.topk). ``dense`` is fp32 [n], 0 <= k <= n."""
    if dense.dim() != 1 or not 0 <= k <= dense.numel():
        raise ValueError(f"cannot select {k} of a tensor of shape {list(dense.shape)}")
    _, indices = torch.topk(dense.abs(), k, sorted=False)  # [k]
    indices, _ = torch.sort(indices)
    return dense[indices].to(torch.float32), indices.to(torch.int32)


def encode_slice(dense: torch.Tensor, encoding: Encoding, *, k: int = 0) -> EncodedSlice:
    """Encode fp32 [n] ``dense`` (any device; the result is on the CPU). ``k``: elements kept
    by ``topk`` (see :func:`topk_count`); ignored otherwise. No error feedback here."""
    if dense.dim() != 1:
        raise ValueError(f"a slice is a 1-d vector, got shape {list(dense.shape)}")
    dense = dense.detach().to("cpu", torch.float32)
    numel = dense.numel()
    if encoding == "dense":
        return EncodedSlice(encoding, dense.contiguous(), _NO_INDICES, numel)
    if encoding in _CAST_DTYPES:
        return EncodedSlice(encoding, dense.to(_CAST_DTYPES[encoding]), _NO_INDICES, numel)
    if encoding == "topk":
        values, indices = select_topk(dense, k)
        return EncodedSlice(encoding, values.to(TOPK_VALUE_DTYPE), indices, numel)
    raise ValueError(f"unknown encoding {encoding!r}")


def decode_slice(
    encoding: str, values: torch.Tensor, indices: torch.Tensor, numel: int
) -> torch.Tensor:
    """The dense fp32 [numel] slice (a new CPU tensor). Raises :class:`CompressionError` when
    the parts do not fit together (unknown encoding, dtype, sizes, indices out of range)."""
    if numel < 0:
        raise CompressionError(f"numel must be >= 0, got {numel}")
    if values.dim() != 1:
        raise CompressionError(f"values must be 1-d, got shape {list(values.shape)}")
    if encoding == "dense" or encoding in _CAST_DTYPES:
        expected = torch.float32 if encoding == "dense" else _CAST_DTYPES[encoding]
        if values.dtype != expected or values.numel() != numel or indices.numel() != 0:
            raise CompressionError(
                f"{encoding} slice: values {values.dtype}[{values.numel()}], "
                f"indices [{indices.numel()}], expected {expected}[{numel}] and no indices"
            )
        return values.to(torch.float32, copy=True)
    if encoding == "topk":
        if values.dtype != TOPK_VALUE_DTYPE or indices.dtype != torch.int32:
            raise CompressionError(
                f"topk slice: values {values.dtype}, indices {indices.dtype}; "
                f"expected {TOPK_VALUE_DTYPE} and int32"
            )
        if indices.shape != values.shape:
            raise CompressionError(
                f"topk slice: {indices.numel()} indices, {values.numel()} values"
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise CompressionError(f"topk slice: an index lies outside [0, {numel})")
        dense = torch.zeros(numel, dtype=torch.float32)
        # index_add_: a repeated index adds up instead of keeping an arbitrary one.
        dense.index_add_(0, indices.to(torch.int64), values.to(torch.float32))
        return dense
    raise CompressionError(f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")


class TopKFeedback:
    """Top-k with error feedback for the slices of one trainer (residuals stay local), with
    optional DGC momentum correction (Lin et al., "Deep Gradient Compression", 2018).

    Per slice ``p`` and step, with the step's input ``g`` (fp32 [n]):

    - momentum correction (``momentum`` m > 0): the velocity ``u[p] = m * u[p] + g`` is kept
      here and the step adds ``u[p]`` (Nesterov: ``g + m * u[p]``): the momentum an optimizer
      would apply is accumulated where the gradient is, before sparsification, so the
      aggregator's SGD runs without momentum. Without it the step adds ``g``;
    - ``accumulated = added + residual[p]`` (error feedback); the ``k`` largest
      ``|accumulated|`` are sent as bf16 values times ``scale``;
    - the residual keeps ``accumulated`` minus what was sent, the bf16 rounding included, so
      with error feedback ``sum(sent) / scale + residual == sum(added)`` after every step;
      the velocity is zeroed where sent (momentum factor masking: a sent element's momentum
      has been applied, keeping it would apply it twice).

    State is fp32 on the gradient's device; not thread-safe.
    """

    __slots__ = ("_residuals", "_velocities", "error_feedback", "momentum", "nesterov", "ratio")

    def __init__(
        self,
        ratio: float,
        *,
        error_feedback: bool = True,
        momentum: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        topk_count(1, ratio)  # validates the ratio
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if momentum and not error_feedback:
            raise ValueError("momentum correction needs error feedback (it uses the residual)")
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.momentum = momentum
        self.nesterov = nesterov
        self._residuals: dict[int, torch.Tensor] = {}
        self._velocities: dict[int, torch.Tensor] = {}

    def residual(self, slice_index: int) -> torch.Tensor | None:
        """The residual kept for ``slice_index`` (None before its first step)."""
        return self._residuals.get(slice_index)

    def velocity(self, slice_index: int) -> torch.Tensor | None:
        """The momentum-correction velocity of ``slice_index`` (None without momentum or
        before its first step)."""
        return self._velocities.get(slice_index)

    def encode(self, slice_index: int, grad: torch.Tensor, *, scale: float = 1.0) -> EncodedSlice:
        """Encode one step's fp32 [n] input ``grad`` of ``slice_index`` (see the class
        docstring); the sent values are multiplied by ``scale`` (> 0)."""
        if grad.dim() != 1:
            raise ValueError(f"a slice is a 1-d vector, got shape {list(grad.shape)}")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        added = grad.detach().to(torch.float32, copy=True)
        if self.momentum:
            velocity = self._velocities.get(slice_index)
            if velocity is None:
                velocity = self._velocities[slice_index] = added.clone()
            else:
                _check_size(slice_index, velocity, added)
                velocity.mul_(self.momentum).add_(added)
            added = added + self.momentum * velocity if self.nesterov else velocity.clone()
        residual = self._residuals.get(slice_index)
        if self.error_feedback and residual is not None:
            _check_size(slice_index, residual, added)
            added = added + residual
        k = topk_count(added.numel(), self.ratio)
        values, indices = select_topk(added, k)
        wire = (values * scale).to(TOPK_VALUE_DTYPE)  # [k]
        positions = indices.to(device=added.device, dtype=torch.int64)
        if self.error_feedback:
            added[positions] -= wire.to(added.device, torch.float32) / scale
            self._residuals[slice_index] = added
        if self.momentum:
            self._velocities[slice_index][positions] = 0.0
        return EncodedSlice("topk", wire.cpu(), indices.cpu(), added.numel())

    def undo(self, slice_index: int, grad: torch.Tensor, sent: EncodedSlice, scale: float) -> None:
        """Take back a step whose ``sent`` slice was never applied (its batches are computed
        again): ``residual += sent / scale - grad`` and, where nothing was sent,
        ``velocity -= grad``. Without momentum that is exactly the state as if ``grad`` had
        never been encoded; with it, the velocity keeps the step's decay, and where the step
        sent, the masked velocity stays zero (its value is back in the residual). No-op
        without error feedback."""
        if not self.error_feedback:
            return
        delta = -grad.detach().to(torch.float32)
        delta.index_add_(
            0,
            sent.indices.to(delta.device, torch.int64),
            sent.values.to(delta.device, torch.float32) / scale,
        )
        residual = self._residuals.get(slice_index)
        if residual is None:
            self._residuals[slice_index] = delta
        else:
            _check_size(slice_index, residual, delta)
            residual.add_(delta)
        velocity = self._velocities.get(slice_index)
        if velocity is not None:
            _check_size(slice_index, velocity, delta)
            unsent = grad.detach().to(velocity.device, torch.float32, copy=True)
            unsent[sent.indices.to(velocity.device, torch.int64)] = 0.0
            velocity.sub_(unsent)


def _check_size(slice_index: int, state: torch.Tensor, step: torch.Tensor) -> None:
    if state.shape != step.shape:
        raise ValueError(
            f"slice {slice_index} changed size: {list(step.shape)} != {list(state.shape)}"
        )
