"""The flat parameter vector of a model and its K slices: what the gradient plane moves.

Every parameter of ``model.named_parameters()`` (in that order) is flattened into one fp32
vector of N elements; slice p of K is ``[p * N // K, (p + 1) * N // K)``, partition p of the
job's grads and params topics. Trainers and aggregators compute the layout from the same
model independently, so it is never sent.

Buffers (BatchNorm running statistics) are not parameters and would not be aggregated:
:func:`check_no_buffers` rejects such models, :func:`build_job_model` builds a job's model at
version 0 (the seeded initialisation every process computes the same way).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.training.jobspec import JobSpec
from conveyor.training.models import build_model

_SEEDED_BUILD = threading.Lock()


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """Where one parameter lives in the flat vector."""

    name: str
    """Its name in ``named_parameters()``."""
    shape: tuple[int, ...]
    """Its shape."""
    offset: int
    """Index of its first element in the flat vector."""
    numel: int
    """Its number of elements."""


def slice_bounds(numel: int, num_slices: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the ``num_slices`` slices of a vector of ``numel``
    elements: slice p is ``[p * numel // K, (p + 1) * numel // K)`` (sizes differ by at most
    one; a slice may be empty when K > numel). ValueError for K < 1 or numel < 0."""
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return [(p * numel // num_slices, (p + 1) * numel // num_slices) for p in range(num_slices)]


class ParamLayout:
    """The flat fp32 layout of a model's parameters (see the module docstring)."""

    __slots__ = ("entries", "numel")

    def __init__(self, entries: Sequence[ParamEntry]) -> None:
        offset = 0
        for entry in entries:
            if entry.offset != offset or entry.numel != _numel(entry.shape):
                raise ValueError(f"layout entry {entry.name!r} is not contiguous with the previous")
            offset += entry.numel
        self.entries: tuple[ParamEntry, ...] = tuple(entries)
        self.numel: int = offset
        """N, the length of the flat vector."""

    @classmethod
    def from_model(cls, model: nn.Module) -> ParamLayout:
        """The layout of ``model.named_parameters()``."""
        entries: list[ParamEntry] = []
        offset = 0
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            entries.append(ParamEntry(name=name, shape=shape, offset=offset, numel=param.numel()))
            offset += param.numel()
        return cls(entries)

    def slice_bounds(self, num_slices: int) -> list[tuple[int, int]]:
        """Bounds of the ``num_slices`` slices of this layout (see :func:`slice_bounds`)."""
        return slice_bounds(self.numel, num_slices)

    def flatten_params(self, model: nn.Module) -> torch.Tensor:
        """fp32 [N] copy of the parameters, on the parameters' device."""
        return self._flatten([param.detach() for param in self._params(model)])

    def flatten_grads(self, model: nn.Module) -> torch.Tensor:
        """fp32 [N] copy of the gradients (zeros where a parameter has none)."""
        grads = [
            param.grad.detach() if param.grad is not None else torch.zeros_like(param)
            for param in self._params(model)
        ]
        return self._flatten(grads)

    @torch.no_grad()
    def load_flat(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Copy the fp32 [N] vector ``flat`` (any device) into the parameters."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"flat vector has shape {list(flat.shape)}, expected [{self.numel}]")
        for entry, param in zip(self.entries, self._params(model), strict=True):
            part = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
            param.copy_(part)

    def _params(self, model: nn.Module) -> list[nn.Parameter]:
        params = list(model.named_parameters())
        if len(params) != len(self.entries) or any(
            name != entry.name or tuple(param.shape) != entry.shape
            for (name, param), entry in zip(params, self.entries, strict=True)
        ):
            raise ValueError("the model's parameters do not match this layout")
        return [param for _, param in params]

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])  # [N]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def check_no_buffers(model: nn.Module, name: str) -> None:
    """ValueError when ``model`` has buffers: the gradient plane aggregates parameters only,
    so running statistics (BatchNorm) would silently differ between trainers."""
    buffers = [buffer_name for buffer_name, _ in model.named_buffers()]
    if buffers:
        raise ValueError(
            f"model {name!r} keeps state outside its parameters (buffers {buffers[:3]}...), "
            "which the aggregator cannot aggregate; use a model without buffers "
            "(small_cnn, mlp, resnet18 with norm: group)"
        )


def build_job_model(
    spec: JobSpec, *, num_classes: int, sample_shape: Sequence[int], device: str = "cpu"
) -> nn.Module:
    """The job's model at version 0: built on the CPU right after
    ``torch.manual_seed(spec.training.seed)`` (the caller's RNG state is left untouched), then
    moved to ``device`` (``"meta"`` builds shapes only, for checks). Thread-safe against other
    calls of this function (not against other users of the global CPU generator). Options
    ``num_classes`` / ``in_channels`` in the spec must agree with the dataset. ValueError when
    the model cannot be built or has buffers."""
    channels, height, width = (int(v) for v in sample_shape)
    options = dict(spec.model.options)
    for key, actual in (("num_classes", num_classes), ("in_channels", channels)):
        stated = options.pop(key, actual)
        if stated != actual:
            raise ValueError(f"model.{key} is {stated} but the dataset has {actual}")

    def build() -> nn.Module:
        return build_model(
            spec.model.name,
            in_channels=channels,
            num_classes=num_classes,
            image_size=(height, width),
            **options,
        )

    try:
        if device == "meta":
            with torch.device("meta"):
                model = build()
        else:
            # The CPU generator is process-wide: two threads seeding and drawing at once
            # would interleave their draws, so every seeded build takes the lock.
            with _SEEDED_BUILD, torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.training.seed)
                model = build()
    except TypeError as exc:  # an option of the wrong kind
        raise ValueError(f"cannot build model {spec.model.name!r}: {exc}") from exc
    check_no_buffers(model, spec.model.name)
    return model if device in ("cpu", "meta") else model.to(device)
