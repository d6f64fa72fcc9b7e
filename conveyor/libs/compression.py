"""Encoding of one gradient slice on the wire (GradSlice ``encoding``), both directions.

- ``dense``: float32 values, all ``numel`` of them (job compression ``none``);
- ``fp16`` / ``bf16``: the values cast to that dtype (half the bytes; ``decode`` casts back);
- ``topk``: the ``k`` elements of largest magnitude as float32 ``values`` at int32 ``indices``;
  every other element is zero.

Top-k with error feedback (the trainer's side): what a step does not send is kept in a local
residual per slice and added to the next step's gradient before selecting, so over many steps
``sum(sent) + residual == sum(true gradients)`` and nothing is lost, only delayed
(:class:`TopKFeedback`). :func:`select_topk` is the one selection both sides rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from conveyor.libs.errors import ConveyorError

Encoding = Literal["dense", "fp16", "bf16", "topk"]
ENCODINGS: tuple[Encoding, ...] = ("dense", "fp16", "bf16", "topk")
_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_NO_INDICES = torch.zeros(0, dtype=torch.int32)


class CompressionError(ConveyorError):
    """A received slice is inconsistent (wrong dtype, sizes or indices); not retriable."""


@dataclass(frozen=True, slots=True)
class EncodedSlice:
    """One slice as it travels: the GradSlice fields ``encoding``, ``values``, ``indices``."""

    encoding: Encoding
    values: torch.Tensor
    """[numel] (dense fp32, fp16, bf16) or fp32 [k] (topk)."""
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
        return EncodedSlice(encoding, values, indices, numel)
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
        if values.dtype != torch.float32 or indices.dtype != torch.int32:
            raise CompressionError(
                f"topk slice: values {values.dtype}, indices {indices.dtype}; "
                "expected float32 and int32"
            )
        if indices.shape != values.shape:
            raise CompressionError(
                f"topk slice: {indices.numel()} indices, {values.numel()} values"
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise CompressionError(f"topk slice: an index lies outside [0, {numel})")
        dense = torch.zeros(numel, dtype=torch.float32)
        # index_add_: a repeated index adds up instead of keeping an arbitrary one.
        dense.index_add_(0, indices.to(torch.int64), values)
        return dense
    raise CompressionError(f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")


class TopKFeedback:
    """Top-k with error feedback for the slices of one trainer (the residuals stay local).

    ``encode(p, grad)`` selects from ``grad + residual[p]`` and keeps what was not sent as the
    new residual. Residuals are fp32 on the gradient's device; not thread-safe.
    """

    __slots__ = ("_residuals", "error_feedback", "ratio")

    def __init__(self, ratio: float, *, error_feedback: bool = True) -> None:
        topk_count(1, ratio)  # validates the ratio
        self.ratio = ratio
        self.error_feedback = error_feedback
        self._residuals: dict[int, torch.Tensor] = {}

    def residual(self, slice_index: int) -> torch.Tensor | None:
        """The residual kept for ``slice_index`` (None before its first step)."""
        return self._residuals.get(slice_index)

    def correct(self, slice_index: int, delta: torch.Tensor) -> None:
        """Add ``delta`` to the residual of ``slice_index`` (e.g. ``sent - grad`` when a
        contribution was rejected: its sent values were never applied). No-op without error
        feedback; ValueError for a size that does not match the residual."""
        if not self.error_feedback:
            return
        residual = self._residuals.get(slice_index)
        if residual is None:
            self._residuals[slice_index] = delta.detach().to(torch.float32).clone()
        elif residual.shape != delta.shape:
            raise ValueError(f"slice {slice_index}: delta {list(delta.shape)} != residual")
        else:
            residual.add_(delta.to(residual.device, torch.float32))

    def encode(self, slice_index: int, grad: torch.Tensor) -> EncodedSlice:
        """Encode one step's fp32 [n] gradient of ``slice_index`` (see the class docstring)."""
        if grad.dim() != 1:
            raise ValueError(f"a slice is a 1-d vector, got shape {list(grad.shape)}")
        accumulated = grad.detach().to(torch.float32)
        residual = self._residuals.get(slice_index)
        if self.error_feedback and residual is not None:
            if residual.shape != accumulated.shape:
                raise ValueError(f"slice {slice_index} changed size since the last step")
            accumulated = accumulated + residual
        k = topk_count(accumulated.numel(), self.ratio)
        values, indices = select_topk(accumulated, k)
        if self.error_feedback:
            left = accumulated.clone()
            left[indices.to(torch.int64)] = 0.0
            self._residuals[slice_index] = left
        return EncodedSlice("topk", values.cpu(), indices.cpu(), accumulated.numel())
