"""Routing of a job's batches to the partitions of its batches topic, by the trainers' shares.

The trainers of a job share its batches topic through one consumer group, which gives each
member an equal share of the partitions. To give a trainer the share of the batches it
consumes (its micro-batches per step in sync mode, its throughput under bounded staleness)
without a custom assignor (and without extra rebalances), the producer side weights the
partitions instead:

- each trainer's heartbeat lists the partitions it owns (``batches_partitions``);
- the coordinator turns the members' shares and partitions into one weight per partition
  (:func:`partition_weights`) and publishes them as ``routing`` in its progress events;
- the sharder gives every batch of a shard task it releases its partition
  (``ShardTask.partitions``, :func:`shard_partitions`) from the latest weights and the batch's
  place in its epoch's split; the preprocessor sends each batch there.

The partitions follow an evenly spread sequence over the batches' places (a smooth weighted
round robin, :func:`spread`), not a hash: every prefix of an epoch gives each partition its
weight's share to within one batch, so each trainer receives exactly the batches its steps
take (a hash left one trainer a few batches more at each epoch's end, which the others
waited for and which took extra, partial steps). With equal weights the sequence is
``0, 1, ..., P-1, 0, ...``; the consumer group's round-robin assignment gives member ``j`` of
``n`` partitions ``j, j+n, ...``, so consecutive batches go to consecutive members, the order
in which the coordinator's turns take them (:mod:`conveyor.services.aggregator.membership`).

Routing changes where batches go, never which batches exist: ids stay deterministic and the
trainers and the coordinator deduplicate by batch id, so a redelivered task (its partitions
travel inside it) or a stale routing (a rebalance moved partitions since) costs balance for a
while, never correctness.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

SPREAD_RESOLUTION = 24
"""Slots per partition in one cycle of :func:`spread`: weights are rounded to 1/(24 P), exact
for the shares of 2, 3, 4, 6 and 8 equal parts. A cycle costs O(24 P^2) to build, once per
weights (cached)."""


def partition_weights(
    members: Iterable[tuple[float | None, Sequence[int]]], num_partitions: int
) -> list[float] | None:
    """Weights of partitions ``0 .. num_partitions-1``, summing to 1, from the members'
    ``(share, owned partitions)``: each partition a member owns gets ``share / len(owned)``
    (claims of one partition by two members, as seen around a rebalance, add up).

    A share that is None, not finite or <= 0 (not measured yet) counts as the mean of the
    members' known shares, or 1.0 when none is known. Partitions outside the range are
    ignored; a partition nobody claims gets 0 (no member would read it). Returns None when
    no member claims any partition (nothing to weight by). Raises ValueError for
    ``num_partitions < 1``.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    owners: list[tuple[float | None, list[int]]] = []
    for share, partitions in members:
        owned = sorted({p for p in partitions if 0 <= p < num_partitions})
        if owned:
            known = share is not None and math.isfinite(share) and share > 0
            owners.append((share if known else None, owned))
    if not owners:
        return None
    known_shares = [share for share, _ in owners if share is not None]
    default = sum(known_shares) / len(known_shares) if known_shares else 1.0
    weights = [0.0] * num_partitions
    for share, owned in owners:
        part = (default if share is None else share) / len(owned)
        for partition in owned:
            weights[partition] += part
    total = sum(weights)
    return [weight / total for weight in weights]


def claims_complete(claims: Iterable[Sequence[int]], num_partitions: int) -> bool:
    """Whether the members' ``claims`` (the partitions each one owns) hold every partition
    ``0 .. num_partitions-1`` exactly once: one consistent view of the group's assignment.

    Each claim comes from a member's latest heartbeat, so around a join or a rebalance some
    are stale: a member that has not yet reported its first assignment leaves its partitions
    unclaimed (weights from that view would send every batch to the others' partitions), one
    that has not yet reported a revocation claims a partition twice. A member may claim
    nothing when the others hold every partition (more members than partitions)."""
    claimed = [p for claim in claims for p in claim]
    return len(claimed) == num_partitions and set(claimed) == set(range(num_partitions))


@functools.lru_cache(maxsize=64)
def spread(weights: tuple[float, ...]) -> tuple[int, ...]:
    """One cycle of the evenly spread sequence of partitions for ``weights`` (one per
    partition, >= 0, positive sum): the weights rounded to whole slots
    (:data:`SPREAD_RESOLUTION` per partition, largest remainder, reduced by their greatest
    common divisor), ordered by smooth weighted round robin, so every run of the cycle holds
    each partition's share to within one slot. A partition of weight 0 never appears. Raises
    ValueError for weights without a positive sum or with a negative or non-finite one."""
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not math.fsum(weights) > 0:
        raise ValueError(f"routing weights need finite values >= 0 and a positive sum, "
                         f"got {list(weights)!r}")  # fmt: skip
    slots = _round_to_slots(weights, SPREAD_RESOLUTION * len(weights))
    divisor = math.gcd(*slots)
    slots = [s // divisor for s in slots]
    length = sum(slots)
    credit = [0] * len(slots)
    cycle: list[int] = []
    for _ in range(length):
        for partition, count in enumerate(slots):
            credit[partition] += count
        chosen = max(range(len(slots)), key=lambda p: (credit[p], -p))  # ties: lowest index
        credit[chosen] -= length
        cycle.append(chosen)
    return tuple(cycle)


def _round_to_slots(weights: Sequence[float], total: int) -> list[int]:
    """Whole slots summing to ``total`` in proportion to ``weights`` (largest remainder); a
    positive weight keeps at least one slot when there are slots enough."""
    scale = total / math.fsum(weights)
    ideal = [w * scale for w in weights]
    slots = [math.floor(x) for x in ideal]
    for p in sorted(range(len(ideal)), key=lambda p: (slots[p] - ideal[p], p)):
        if sum(slots) >= total:
            break
        slots[p] += 1
    for p, w in enumerate(weights):  # a sliver of a share still reads its partition
        if w > 0 and slots[p] == 0:
            donor = max(range(len(slots)), key=lambda q: (slots[q], -q))
            if slots[donor] > 1:
                slots[donor] -= 1
                slots[p] = 1
    return slots


def shard_partitions(
    first_batch: int, num_batches: int, weights: Sequence[float] | None, num_partitions: int
) -> list[int]:
    """The partition of each of a shard's ``num_batches`` batches, the first being batch
    ``first_batch`` of its epoch's split (from 0): the batch's place in the cycle of
    :func:`spread` (equal weights when ``weights`` is None or empty: before any trainer has
    reported its partitions). Stable: the same arguments give the same partitions in any
    process. Raises ValueError for weights not one per partition, or as :func:`spread`."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if first_batch < 0 or num_batches < 0:
        raise ValueError(f"batch places must be >= 0, got {first_batch}, {num_batches}")
    if weights and len(weights) != num_partitions:
        raise ValueError(f"{len(weights)} routing weights for {num_partitions} partitions")
    cycle = spread(tuple(weights) if weights else (1.0,) * num_partitions)
    return [cycle[(first_batch + i) % len(cycle)] for i in range(num_batches)]
