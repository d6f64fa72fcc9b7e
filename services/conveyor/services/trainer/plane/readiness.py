"""Which slices of the flat gradient are complete while a backward pass runs (a pure fold).

The flat vector is the layout's entries end to end, cut into K contiguous slices
(:mod:`conveyor.training.slicing`). During the backward pass of a step's last micro-batch each
trainable entry (a parameter that requires a gradient) has its gradient accumulated once, the
layers nearest the loss first; a slice is complete when every trainable entry overlapping it
has been accumulated. Entries that are not trainable (statistics, frozen parameters) are not
waited for: their values are final before the backward starts. A slice with nothing to wait
for, and a slice whose parameters the pass never reached (a parameter outside the graph keeps
its earlier gradient), is handed over by :meth:`SliceReadiness.rest` when the pass has ended.
Each slice is handed over exactly once; an entry accumulated twice in one pass (its slice may
have left without the second part) is refused with a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence


class SliceReadiness:
    """Counts, per slice, the trainable entries still to be accumulated in one backward pass."""

    __slots__ = ("_done", "_handed", "_slices_of", "_waiting")

    def __init__(
        self,
        entries: Sequence[tuple[int, int, bool]],
        bounds: Sequence[tuple[int, int]],
    ) -> None:
        """``entries``: ``(offset, numel, trainable)`` of each layout entry, in layout order;
        ``bounds``: ``(start, stop)`` of each slice
        (:func:`conveyor.training.slicing.slice_bounds`)."""
        self._slices_of: list[list[int]] = []
        self._waiting = [0] * len(bounds)
        for offset, numel, trainable in entries:
            overlapping = [
                p
                for p, (start, stop) in enumerate(bounds)
                if trainable and offset < stop and start < offset + numel
            ]
            self._slices_of.append(overlapping)
            for p in overlapping:
                self._waiting[p] += 1
        self._done = [False] * len(entries)
        self._handed = [False] * len(bounds)

    def accumulated(self, entry: int) -> list[int]:
        """Entry ``entry`` has its gradient for this pass: the slices that became complete
        (ascending; empty if none did). ValueError when the entry was already accumulated in
        this pass (a slice holding it may have left without its second part: a model that
        runs a parameter's backward twice, as reentrant activation checkpointing can, needs
        ``overlap_backward: false``); IndexError for an entry outside the layout."""
        if self._done[entry]:
            raise ValueError(
                f"layout entry {entry} had its gradient accumulated twice in one backward pass, "
                "so its slice may have been sent incomplete: set "
                "distribution.overlap_backward: false for this model"
            )
        self._done[entry] = True
        ready: list[int] = []
        for p in self._slices_of[entry]:
            self._waiting[p] -= 1
            if self._waiting[p] == 0 and not self._handed[p]:
                self._handed[p] = True
                ready.append(p)
        return ready

    def rest(self) -> list[int]:
        """The pass has ended: every slice not handed over yet (ascending), now handed."""
        rest = [p for p, handed in enumerate(self._handed) if not handed]
        for p in rest:
            self._handed[p] = True
        return rest
