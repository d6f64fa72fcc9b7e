"""Where a sync step's time goes, hop by hop, from the stamps on the control topic.

A sync step from version v to v+1, seen from the trainer whose Contribution came last (the one
the step waited for)::

    StepClose v closed ──apply──▶ its ParamSlices published ──delivery──▶ all received by
    the trainer ──load──▶ step started ──compute──▶ gradient encoded ──grad_send──▶ every
    GradSlice acknowledged, Contribution stamped ──close──▶ StepClose v+1 closed

``apply``: the slice owners read the close (or fold it themselves) and the GradSlices, step the
optimizer, publish; ``delivery``: broker and the trainer's params reader; ``load``: the trainer
folds the close and loads the flat vector into its model; ``compute``: gathering (data wait
included), forward/backward, encoding, the only hop that is not the plane's; ``grad_send``: the
GradSlices produced and acknowledged; ``close``: the Contribution produced, read by the
coordinator, folded, the StepClose stamped. The six add up to the step (closed_at to closed_at)
exactly. ``barrier`` (beside them, not in the sum): how long the first trainer's Contribution
waited for the last one's.

The stamps are Unix seconds of several processes (``Contribution`` v4, ``StepClose.closed_at``):
on one machine one clock; across machines only as good as their clock sync.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HOPS = ("apply", "delivery", "load", "compute", "grad_send", "close")
PLANE_HOPS = ("apply", "delivery", "load", "grad_send", "close")
"""The hops that are the gradient plane's cost (all but compute)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stamped:
    """One Contribution's stamps (Unix seconds), as read from the control topic."""

    base_version: int
    sent_at: float
    params_published_at: float | None = None
    params_received_at: float | None = None
    started_at: float | None = None
    computed_at: float | None = None


@dataclass(frozen=True, slots=True)
class StepHops:
    """Seconds of each hop of one step (:data:`HOPS`), and the barrier beside them."""

    version: int
    hops: dict[str, float]
    barrier: float

    @property
    def step(self) -> float:
        return sum(self.hops.values())


def step_hops(
    closes: Mapping[int, tuple[float, Sequence[str]]], contributions: Mapping[str, Stamped]
) -> list[StepHops]:
    """Per step v+1 whose previous close v is known and whose last Contribution carries every
    stamp (an empty contribution carries none; version 0 has no close): its hops.

    ``closes``: version -> (closed_at, ids of the contributions it applied);
    ``contributions``: id -> its stamps. Unknown ids are left out of the step's barrier.
    """
    found: list[StepHops] = []
    for version in sorted(closes):
        previous = closes.get(version - 1)
        closed_at, ids = closes[version]
        stamped = [contributions[i] for i in ids if i in contributions]
        if previous is None or not stamped:
            continue
        last = max(stamped, key=lambda c: c.sent_at)
        times = (last.params_published_at, last.params_received_at, last.started_at,
                 last.computed_at)  # fmt: skip
        if last.base_version != version - 1 or any(t is None for t in times):
            continue
        published, received, started, computed = (float(t) for t in times)  # type: ignore[arg-type]
        hops = {
            "apply": published - previous[0],
            "delivery": received - published,
            "load": started - received,
            "compute": computed - started,
            "grad_send": last.sent_at - computed,
            "close": closed_at - last.sent_at,
        }
        barrier = last.sent_at - min(c.sent_at for c in stamped)
        found.append(StepHops(version, hops, barrier))
    return found


def median_hops(steps: Sequence[StepHops]) -> dict[str, float]:
    """Median seconds over ``steps`` of each hop, of the barrier, of the plane's hops together
    (``plane``) and of the step; empty when there is no step."""
    if not steps:
        return {}
    found = {hop: statistics.median(s.hops[hop] for s in steps) for hop in HOPS}
    found["plane"] = statistics.median(sum(s.hops[h] for h in PLANE_HOPS) for s in steps)
    found["barrier"] = statistics.median(s.barrier for s in steps)
    found["step"] = statistics.median(s.step for s in steps)
    return found
