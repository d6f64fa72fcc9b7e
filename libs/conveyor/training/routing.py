"""Throughput-weighted routing of a job's batches to the partitions of its batches topic.

The trainers of a job share its batches topic through one consumer group, which gives each
member an equal share of the partitions. To give a fast trainer more batches than a slow one
without a custom assignor (and without extra rebalances), the producer side weights the
partitions instead:

- each trainer's heartbeat lists the partitions it owns (``batches_partitions``);
- the coordinator turns the members' rates and partitions into one weight per partition
  (:func:`partition_weights`) and publishes them as ``routing`` in its progress events;
- the sharder stamps the latest routing into every shard task it releases
  (``ShardTask.routing``), and the preprocessor sends each batch to the partition
  :func:`choose_partition` picks from the batch id.

Routing changes where batches go, never which batches exist: ids stay deterministic and the
trainers and the coordinator deduplicate by batch id, so a redelivered task routed the same
way (its routing travels inside it) or a stale routing (a rebalance moved partitions since)
costs balance for a while, never correctness.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence


def partition_weights(
    members: Iterable[tuple[float | None, Sequence[int]]], num_partitions: int
) -> list[float] | None:
    """Weights of partitions ``0 .. num_partitions-1``, summing to 1, from the members'
    ``(rate, owned partitions)``: each partition a member owns gets ``rate / len(owned)``
    (claims of one partition by two members, as seen around a rebalance, add up).

    A rate that is None, not finite or <= 0 (not measured yet) counts as the mean of the
    members' known rates, or 1.0 when none is known. Partitions outside the range are
    ignored; a partition nobody claims gets 0 (no member would read it). Returns None when
    no member claims any partition (nothing to weight by). Raises ValueError for
    ``num_partitions < 1``.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    owners: list[tuple[float | None, list[int]]] = []
    for rate, partitions in members:
        owned = sorted({p for p in partitions if 0 <= p < num_partitions})
        if owned:
            known_rate = rate is not None and math.isfinite(rate) and rate > 0
            owners.append((rate if known_rate else None, owned))
    if not owners:
        return None
    known = [rate for rate, _ in owners if rate is not None]
    default = sum(known) / len(known) if known else 1.0
    weights = [0.0] * num_partitions
    for rate, owned in owners:
        share = (default if rate is None else rate) / len(owned)
        for partition in owned:
            weights[partition] += share
    total = sum(weights)
    return [weight / total for weight in weights]


def choose_partition(batch_id: str, weights: Sequence[float]) -> int:
    """The partition of ``batch_id`` under ``weights`` (one per partition, >= 0, positive
    sum): a point drawn from a hash of the id, placed on the
    cumulative weights. Stable across processes and runs (the same id and weights give the
    same partition); over many ids partition p gets a share ``weights[p] / sum(weights)``;
    a partition of weight 0 never gets one. Raises ValueError for weights without a positive
    sum."""
    total = math.fsum(weights)
    if not total > 0:
        raise ValueError(f"routing weights need a positive sum, got {list(weights)!r}")
    digest = hashlib.blake2b(batch_id.encode(), digest_size=8).digest()
    point = int.from_bytes(digest, "big") / 2.0**64 * total  # uniform in [0, total)
    reached = 0.0
    last = 0
    for partition, weight in enumerate(weights):
        if weight > 0:
            reached += weight
            last = partition
            if point < reached:
                return partition
    return last  # the point fell on the rounding error past the last positive weight
