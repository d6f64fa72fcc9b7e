"""The flat state vector of a model and its K slices: what the gradient plane moves.

Every parameter of ``model.named_parameters()`` (in that order), then every floating-point
buffer of ``model.named_buffers()`` (BatchNorm's running mean and variance: the model's
*statistics*), is flattened into one fp32 vector of N elements; slice p of K is
``[p * N // K, (p + 1) * N // K)``, partition p of the job's grads and params topics. Trainers
and aggregators compute the layout from the same model independently, so it is never sent.

Statistics ride the gradient plane like gradients (departure 28): where a trainer sends the
summed gradient of a parameter, it sends its statistic after the step's forward passes times
the step's sample count, so the aggregator's ``sum / num_samples`` is the sample-weighted mean
of the trainers' statistics, which the slice owner takes as the new value instead of an
optimizer step (:meth:`ParamLayout.statistic_ranges`). Integer buffers (BatchNorm's
``num_batches_tracked``) are not carried: :func:`check_buffers` refuses models that would
need them. :func:`build_job_model` builds a job's model at version 0 (the seeded
initialisation every process computes the same way).
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
    statistic: bool = False
    """A floating-point buffer (running statistics): its new value is the trainers'
    sample-weighted mean, not an optimizer step's."""


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
        """The layout of ``model.named_parameters()`` then its floating-point buffers."""
        entries: list[ParamEntry] = []
        offset = 0
        for statistic, (name, tensor) in _state(model):
            shape = tuple(tensor.shape)
            entries.append(
                ParamEntry(
                    name=name, shape=shape, offset=offset, numel=tensor.numel(), statistic=statistic
                )
            )
            offset += tensor.numel()
        return cls(entries)

    @property
    def has_statistics(self) -> bool:
        """Whether the layout carries statistics (buffers) besides parameters."""
        return any(entry.statistic for entry in self.entries)

    def statistic_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``[(lo, hi), ...]``: the statistics' elements within ``[start, stop)`` of the flat
        vector, relative to ``start`` (what a slice owner averages instead of stepping)."""
        ranges: list[tuple[int, int]] = []
        for entry in self.entries:
            lo, hi = max(entry.offset, start), min(entry.offset + entry.numel, stop)
            if entry.statistic and lo < hi:
                ranges.append((lo - start, hi - start))
        return ranges

    def slice_bounds(self, num_slices: int) -> list[tuple[int, int]]:
        """Bounds of the ``num_slices`` slices of this layout (see :func:`slice_bounds`)."""
        return slice_bounds(self.numel, num_slices)

    def flatten_params(self, model: nn.Module) -> torch.Tensor:
        """fp32 [N] copy of the parameters and statistics, on the parameters' device."""
        return self._flatten([tensor.detach() for tensor in self.tensors(model)])

    def flatten_grads(
        self,
        model: nn.Module,
        num_samples: int | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> torch.Tensor:
        """fp32 [stop - start]: elements ``[start, stop)`` (default: all N) of the flat vector
        of the gradients (zeros where a parameter has none) and, at the statistics, their
        current values times ``num_samples`` (the samples of the summed gradient, so that
        dividing the sum over trainers by the step's samples averages them). ValueError when
        the layout has statistics and ``num_samples`` is not given, or for a range outside
        ``[0, N]``."""
        if num_samples is None and self.has_statistics:
            raise ValueError("a layout with statistics needs the step's num_samples")
        stop = self.numel if stop is None else stop
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"range [{start}, {stop}) lies outside [0, {self.numel}]")
        parts: list[torch.Tensor] = []
        for entry, tensor in zip(self.entries, self.tensors(model), strict=True):
            lo, hi = max(entry.offset, start), min(entry.offset + entry.numel, stop)
            if lo >= hi:
                continue
            if entry.statistic:
                value = tensor.detach().to(torch.float32) * float(num_samples or 0)
            elif tensor.grad is not None:
                value = tensor.grad.detach()
            else:
                value = torch.zeros_like(tensor)
            parts.append(value.reshape(-1)[lo - entry.offset : hi - entry.offset])
        return self._flatten(parts)

    @torch.no_grad()
    def load_flat(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Copy the fp32 [N] vector ``flat`` (any device) into the parameters and
        statistics."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"flat vector has shape {list(flat.shape)}, expected [{self.numel}]")
        for entry, tensor in zip(self.entries, self.tensors(model), strict=True):
            part = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
            tensor.copy_(part)

    def tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors of ``model`` in layout order (its parameters, then its floating-point
        buffers). ValueError when they do not match the layout."""
        state = _state(model)
        if len(state) != len(self.entries) or any(
            name != entry.name or tuple(tensor.shape) != entry.shape
            for (_, (name, tensor)), entry in zip(state, self.entries, strict=True)
        ):
            raise ValueError("the model's parameters do not match this layout")
        return [tensor for _, (_, tensor) in state]

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])  # [N]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _state(model: nn.Module) -> list[tuple[bool, tuple[str, torch.Tensor]]]:
    """``(is_statistic, (name, tensor))`` of the parameters, then the floating buffers."""
    params = [(False, item) for item in model.named_parameters()]
    statistics = [(True, item) for item in model.named_buffers() if item[1].is_floating_point()]
    return params + statistics


def check_buffers(model: nn.Module, name: str, spec: JobSpec) -> None:
    """ValueError when ``model`` keeps state the gradient plane cannot carry: an integer
    buffer other than BatchNorm's ``num_batches_tracked`` (read only when its momentum is
    None, refused too), or statistics in a job whose gradients are compressed (a top-k or
    fp16 gradient would drop or overflow the statistics travelling with it) or in local mode
    (its contributions are parameter deltas)."""
    norms = {module_name for module_name, module in model.named_modules()
             if isinstance(module, nn.modules.batchnorm._BatchNorm)}  # fmt: skip
    cumulative = [n for n, m in model.named_modules() if n in norms and m.momentum is None]
    if cumulative:
        raise ValueError(
            f"model {name!r}: BatchNorm with momentum=None ({cumulative[0]}) keeps a cumulative "
            "average that needs num_batches_tracked, which the gradient plane does not carry"
        )
    for buffer_name, buffer in model.named_buffers():
        owner, _, leaf = buffer_name.rpartition(".")
        if buffer.is_floating_point() or (leaf == "num_batches_tracked" and owner in norms):
            continue
        raise ValueError(
            f"model {name!r} keeps integer state in buffer {buffer_name!r}, which the gradient "
            "plane cannot average across trainers"
        )
    has_statistics = ParamLayout.from_model(model).has_statistics
    if spec.distribution.mode == "local" and has_statistics:
        raise ValueError(
            f"model {name!r} has running statistics (BatchNorm), which travel as sample-weighted "
            "values in sync and ssp modes, not as local mode's parameter deltas: use mode sync "
            "or ssp (or resnet18 with norm: group)"
        )
    compression = spec.distribution.compression.kind
    if compression != "none" and has_statistics:
        raise ValueError(
            f"model {name!r} has running statistics (BatchNorm), which travel with the "
            f"gradients uncompressed: use distribution.compression.kind none, not "
            f"{compression!r} (or resnet18 with norm: group)"
        )


def build_job_model(
    spec: JobSpec, *, num_classes: int, sample_shape: Sequence[int], device: str = "cpu"
) -> nn.Module:
    """The job's model at version 0: built on the CPU right after
    ``torch.manual_seed(spec.training.seed)`` (the caller's RNG state is left untouched), then
    moved to ``device`` (``"meta"`` builds shapes only, for checks). Thread-safe against other
    calls of this function (not against other users of the global CPU generator). Options
    ``num_classes`` / ``in_channels`` in the spec must agree with the dataset. ValueError when
    the model cannot be built or keeps state :func:`check_buffers` refuses."""
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
    check_buffers(model, spec.model.name, spec)
    return model if device in ("cpu", "meta") else model.to(device)
