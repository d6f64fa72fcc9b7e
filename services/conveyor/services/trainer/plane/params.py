"""Parameter versions from the params topic: slices in, complete flat vectors out.

:class:`ParamAssembler` (pure) collects the ParamSlices of each version and keeps only the
newest complete one (an fp32 [N] CPU vector): a trainer computes on the newest parameters, and
older versions are of no use to it except an epoch's end-of-epoch version for evaluation, which
the runner copies when it loads it or, when it skipped it, looks up in the topic's history with
:func:`fetch_version`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from conveyor.platform.bus import TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import ParamSlice

logger = logging.getLogger(__name__)


class ParamAssembler:
    """Slices of versions -> the newest complete version.

    ``bounds[p] = (start, stop)`` of slice p in the flat vector. Slices of a version older than
    the newest complete one are dropped; a slice of the wrong size raises ValueError (the
    layout of the job differs: nothing sensible can be computed on it).
    """

    def __init__(self, bounds: Sequence[tuple[int, int]]) -> None:
        if not bounds:
            raise ValueError("a layout has at least one slice")
        self._sizes = [stop - start for start, stop in bounds]
        self._partial: dict[int, dict[int, torch.Tensor]] = {}
        self._published: dict[int, list[float]] = {}
        """version -> ``published_at`` of its slices held in ``_partial``."""
        self.version: int | None = None
        """Version of the newest complete vector (None before any)."""
        self.flat: torch.Tensor | None = None
        """fp32 [N] parameters of ``version``."""
        self.published_at: float | None = None
        """The latest ``published_at`` of ``version``'s slices (Unix seconds)."""
        self.received_at: float | None = None
        """When ``version`` became complete here (the ``received_at`` of its last slice)."""

    def add(self, message: ParamSlice, *, received_at: float) -> bool:
        """Fold one slice that arrived at ``received_at`` (Unix seconds); True when it
        completed a version newer than the newest."""
        index, version = message.slice_index, message.version
        if not 0 <= index < len(self._sizes):
            raise ValueError(f"slice {index} outside the layout's {len(self._sizes)} slices")
        if message.values.numel() != self._sizes[index]:
            raise ValueError(
                f"slice {index} of version {version} has {message.values.numel()} values, "
                f"the layout {self._sizes[index]}"
            )
        if self.version is not None and version <= self.version:
            return False
        slices = self._partial.setdefault(version, {})
        if index not in slices:  # the first of a (slice, version) wins
            slices[index] = message.values
            self._published.setdefault(version, []).append(message.published_at)
        if len(slices) < len(self._sizes):
            return False
        # [N] = the slices in order; a copy, so the records' buffers can go.
        self.flat = torch.cat([slices[p].to(torch.float32) for p in range(len(self._sizes))])
        self.version = version
        self.published_at = max(self._published.pop(version))
        self.received_at = received_at
        self._partial = {v: s for v, s in self._partial.items() if v > version}
        self._published = {v: t for v, t in self._published.items() if v > version}
        return True


async def fetch_version(
    settings: KafkaSettings, topic: str, version: int, num_slices: int, *, timeout_s: float = 10.0
) -> torch.Tensor | None:
    """The fp32 [N] parameters of ``version`` read back from the params topic's history, or
    None when some slice of it is no longer there.

    A slice's owner publishes its versions in increasing order, so within a partition versions
    mostly grow with offsets: a binary search finds the record (the first guess, offset ==
    version, is exact when the partition holds every version from 0 once). Around a change of
    owner two owners may both publish for a while; when the search misses, the partition is
    read from its beginning.
    """
    parts: list[torch.Tensor] = []
    async with TopicTail(settings, topic) as tail:
        ends = await tail.end_offsets()
        for partition in range(num_slices):
            end = ends.get(partition, 0)
            found = await _search(tail, partition, version, end, timeout_s)
            if found is None:
                found = await _scan(tail, partition, version, end, timeout_s)
            if found is None:
                logger.warning("version %d of slice %d is not on %s", version, partition, topic)
                return None
            parts.append(found.values.to(torch.float32))
    return torch.cat(parts)


async def _scan(
    tail: TopicTail, partition: int, version: int, end: int, timeout_s: float
) -> ParamSlice | None:
    for offset in range(end):
        record = await tail.read_at(partition, offset, timeout_s)
        message = record.message if record is not None else None
        if isinstance(message, ParamSlice) and message.version == version:
            return message
    return None


async def _search(
    tail: TopicTail, partition: int, version: int, end: int, timeout_s: float
) -> ParamSlice | None:
    low, high = 0, end - 1
    guess = min(max(version, low), high)
    while low <= high:
        record = await tail.read_at(partition, guess, timeout_s)
        message = record.message if record is not None else None
        if not isinstance(message, ParamSlice):
            return None
        if message.version == version:
            return message
        if message.version < version:
            low = guess + 1
        else:
            high = guess - 1
        guess = (low + high) // 2
        await asyncio.sleep(0)
    return None
