"""What an aggregator process holds for a slice of a job it owns: the slice's parameters,
optimizer state and buffered gradients.

A slice is a 1/K part of the job's flat parameters (:mod:`conveyor.training.slicing`); slice p
is partition p of the job's grads and params topics, and the aggregator process assigned that
grads partition owns the slice and keeps its :class:`SliceOwner` (pure torch, no I/O):
GradSlices of partition p wait in the buffer by contribution id (with the records that carried
them, opaque here, acknowledged by the caller once the effect is durable); StepCloses are
applied strictly in version order, each once the slices of all its non-empty contributions are
held (an empty contribution, ``num_samples == 0``, sends no GradSlice).

The step: ``grad = sum(decoded slices of the step's contributions) / StepClose.num_samples``,
then one optimizer step at ``StepClose.lr`` (and ``StepClose.momentum`` when set); a step
without samples changes nothing but still makes the new version. The slice's statistics
(BatchNorm running mean/var, :meth:`ParamLayout.statistic_ranges`) take ``grad`` itself after
the step: the trainers sent them times their sample counts, so it is their sample-weighted
mean (departure 28). The optimizer steps them too (element-wise, so the other elements are
unaffected); its state there is never read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from conveyor.platform.messages import GradSlice, StepClose
from conveyor.training.checkpoint import SliceState
from conveyor.training.compression import CompressionError, decode_slice
from conveyor.training.jobspec import OptimizerSpec
from conveyor.training.optim import SliceOptimizer

logger = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass(slots=True)
class Buffered(Generic[R]):
    """A contribution's slice, and every record that carried it (duplicates included)."""

    grad: GradSlice
    records: list[R] = field(default_factory=list)


class SliceOwner(Generic[R]):
    """Slice ``slice_index`` of a job, at ``version``; see the module docstring."""

    def __init__(
        self,
        *,
        slice_index: int,
        values: torch.Tensor,
        version: int,
        optimizer: OptimizerSpec,
        optimizer_state: dict[str, torch.Tensor] | None = None,
        statistics: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``optimizer_state``: the optimizer's state at ``version`` (from a checkpoint);
        None: a fresh optimizer. ``statistics``: ``[lo, hi)`` ranges of the slice that hold
        running statistics (averaged, not optimized)."""
        self.slice_index = slice_index
        self.version = version
        """The version ``values`` are at."""
        self.numel = values.numel()
        self._optimizer = SliceOptimizer(optimizer, values)
        if optimizer_state:
            self._optimizer.load_state_tensors(optimizer_state)
        self._buffer: dict[str, Buffered[R]] = {}
        self._statistics = [(lo, hi) for lo, hi in statistics if lo < hi]
        if any(lo < 0 or hi > self.numel for lo, hi in self._statistics):
            raise ValueError(f"statistics {statistics} fall outside a slice of {self.numel}")

    @property
    def values(self) -> torch.Tensor:
        """fp32 [numel] parameters at :attr:`version` (a view: copy to keep)."""
        return self._optimizer.values

    @property
    def buffered(self) -> int:
        """Contributions whose slice is held."""
        return len(self._buffer)

    def add(self, grad: GradSlice, record: R) -> None:
        """Hold ``grad`` (arrived in ``record``). ValueError when it is not this slice (index
        or size): the caller logs and drops it."""
        if grad.slice_index != self.slice_index or grad.numel != self.numel:
            raise ValueError(
                f"GradSlice {grad.contribution_id} is slice {grad.slice_index} of {grad.numel} "
                f"elements; this owner holds slice {self.slice_index} of {self.numel}"
            )
        held = self._buffer.get(grad.contribution_id)
        if held is None:
            self._buffer[grad.contribution_id] = Buffered(grad, [record])
        else:
            held.records.append(record)  # a duplicate record: acknowledged with the first

    def holds(self, contribution_id: str) -> bool:
        """Whether the slice of ``contribution_id`` is held."""
        return contribution_id in self._buffer

    def missing(self, close: StepClose) -> list[str]:
        """Ids of the non-empty contributions of ``close`` whose slice is not held yet."""
        return [
            entry.contribution_id
            for entry in close.contributions
            if entry.num_samples > 0 and entry.contribution_id not in self._buffer
        ]

    def apply(self, close: StepClose) -> list[R]:
        """:meth:`take` then :meth:`step`; returns the records to acknowledge once the new
        version is published."""
        grads, records = self.take(close)
        self.step(close, grads)
        return records

    def take(self, close: StepClose) -> tuple[list[GradSlice], list[R]]:
        """Remove the slices of ``close``'s contributions from the buffer: (slices in the
        close's order, their records). ValueError unless ``close`` is the next version and
        every slice is held."""
        if close.version != self.version + 1:
            raise ValueError(f"cannot apply version {close.version} at version {self.version}")
        if missing := self.missing(close):
            raise ValueError(f"version {close.version}: slices of {missing} are not held")
        grads: list[GradSlice] = []
        records: list[R] = []
        for entry in close.contributions:
            held = self._buffer.pop(entry.contribution_id, None)
            if held is not None:
                grads.append(held.grad)
                records.extend(held.records)
        return grads, records

    def step(self, close: StepClose, grads: list[GradSlice]) -> None:
        """Apply ``close`` with its ``grads`` (from :meth:`take`); may run in a worker thread
        (it touches the optimizer only). Raises :class:`CompressionError` for a slice that
        does not decode (nothing is applied then)."""
        if close.version != self.version + 1:
            raise ValueError(f"cannot apply version {close.version} at version {self.version}")
        if close.num_samples > 0:
            total = torch.zeros(self.numel, dtype=torch.float32)  # [numel]
            for grad in grads:
                total += _dense(grad)
            mean = total / close.num_samples  # [numel]
            self._optimizer.step(mean, close.lr, close.momentum)
            values = self._optimizer.values
            for lo, hi in self._statistics:
                values[lo:hi] = mean[lo:hi]
        self.version = close.version

    def snapshot(self, grads_offset: int) -> SliceState:
        """A copy of the slice's state at :attr:`version` (parameters and optimizer state)
        for a checkpoint; ``grads_offset``: the lowest grads offset later versions may need."""
        return SliceState(
            slice_index=self.slice_index,
            version=self.version,
            values=self.values.clone(),
            optimizer=self._optimizer.state_tensors(),
            grads_offset=grads_offset,
        )

    def drop_dead(self, staleness_bound: int) -> list[R]:
        """Forget slices no future version can apply (``base_version < version - bound``: a
        later StepClose may only include contributions within the staleness bound of the
        version before it); returns their records, safe to acknowledge at once."""
        dead = [
            cid
            for cid, held in self._buffer.items()
            if held.grad.base_version < self.version - staleness_bound
        ]
        return [record for cid in dead for record in self._buffer.pop(cid).records]


def _dense(grad: GradSlice) -> torch.Tensor:
    try:
        return decode_slice(grad.encoding, grad.values, grad.indices, grad.numel)
    except CompressionError as exc:
        raise CompressionError(f"GradSlice {grad.contribution_id}: {exc}") from exc
