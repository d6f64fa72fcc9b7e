"""When an aggregator needs to read the grads topic: only when the control log says a slice
it lacks is there.

A trainer publishes its Contribution on the control log only once every GradSlice of it is
acknowledged by the broker, so the control log announces every slice worth reading. Between
steps the grads consumer would only send empty fetches, one every ``plane_fetch_max_wait_ms``,
and each costs CPU here and in the broker (measured on the embedded broker: about 30 ms and
25 ms of CPU per second per reader at 10 ms), CPU a machine shared with trainers and
preprocessors does not have to spare. The aggregator rests the consumer
(:meth:`conveyor.platform.bus.Consumer.rest`) whenever :func:`grads_wanted` is False.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

from conveyor.services.aggregator.coordinator import Coordinator
from conveyor.services.aggregator.slice_owner import SliceOwner

R = TypeVar("R")


def grads_wanted(
    coordinator: Coordinator,
    owners: Mapping[int, SliceOwner[R]],
    *,
    owned: Collection[int],
    opening: bool,
) -> bool:
    """Whether a GradSlice these slice ``owners`` need may be waiting on the grads topic.

    True while a slice is being opened (``opening``, or an ``owned`` partition without its
    owner yet: a new owner reads from the committed offset), or when an owner lacks the
    GradSlice of its next StepClose, or of a folded contribution that is neither applied nor
    rejected yet (an empty contribution has no slices).
    """
    if opening or not set(owned) <= owners.keys():
        return True
    undecided = [c.contribution_id for c in coordinator.undecided() if c.num_samples > 0]
    for owner in owners.values():
        close = coordinator.closes.get(owner.version + 1)
        if close is not None and owner.missing(close):
            return True
        if not all(owner.holds(contribution_id) for contribution_id in undecided):
            return True
    return False
