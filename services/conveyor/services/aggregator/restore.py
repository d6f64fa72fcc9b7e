"""Opening a slice that another process served before: exactly where it left off.

The last ParamSlice of a partition says which version the slice is at and what its parameters
are, but not its optimizer state (momentum, Adam moments). The new owner rebuilds that state
exactly: it loads the slice from the job's latest good checkpoint (or starts from version 0
with a fresh optimizer when there is none), reads the GradSlices of the versions after it back
from the grads partition (from the offset the checkpoint recorded; every record of the job stays
on the topic while the job runs) and applies the StepCloses of those versions as their first
owner did, in the same order: the same floating-point operations, so the same bits. It then
checks the result against the last ParamSlice; a mismatch (which would be a bug) is logged and
the published parameters win.

Cost: a replay reads and applies at most the versions since the last checkpoint, so
``checkpoint.every_steps`` bounds it.

A resumed job's log starts at the checkpoint it resumed from (``floor``): its slices open from
that checkpoint's files (:func:`resumed_slice`), and a replay starts there at the beginning of
the new grads partition, never from an older checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from conveyor.platform.bus import TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import GradSlice, ParamSlice, StepClose
from conveyor.services.aggregator.slice_owner import SliceOwner
from conveyor.training.checkpoint import CheckpointError, CheckpointStore, Skipped, SliceState
from conveyor.training.jobspec import OptimizerSpec

logger = logging.getLogger(__name__)

_POLL_S = 0.2


class ReplayError(Exception):
    """The log after the checkpoint does not hold what the replay needs."""


@dataclass(frozen=True, slots=True)
class Restored:
    """The state a new owner starts from, and how it was obtained."""

    state: SliceState
    """At the last ParamSlice's version, optimizer state included."""
    checkpoint_version: int | None
    """The checkpoint it was rebuilt from (None: from version 0)."""
    replayed: int
    """Versions replayed after it."""
    skipped: list[Skipped]
    """Newer checkpoints that were torn or corrupt."""
    exact: bool
    """Whether the optimizer state is exact (False: the replay could not be done and the
    optimizer restarts from the last ParamSlice, as before checkpoints existed)."""


async def restore_slice(
    *,
    kafka: KafkaSettings,
    grads_topic: str,
    index: int,
    initial: torch.Tensor,
    last: ParamSlice,
    optimizer: OptimizerSpec,
    checkpoints: CheckpointStore,
    closes: Callable[[int, int], Awaitable[list[StepClose]]],
    floor: int = 0,
) -> Restored:
    """The state of slice ``index`` at ``last.version`` (module docstring). ``initial``: the
    slice's fp32 values at version 0; ``closes(after, version)`` waits until the control log
    is folded up to ``version`` and returns the StepCloses after..version in order;
    ``floor``: the version a resumed job's log starts at (0: not resumed). Raises the
    store's StorageError or BusError on I/O failures (the caller retries)."""
    target = last.version
    manifest, states, skipped = await asyncio.to_thread(checkpoints.latest_good, [index])
    if manifest is not None and floor <= manifest.version <= target:
        base = states[index]
        if base.version == floor:  # the new grads partition starts after it
            base.grads_offset = 0
    elif floor > 0:
        fallback = SliceState(slice_index=index, version=target, values=last.values.clone(),
                              optimizer={}, grads_offset=0)  # fmt: skip
        logger.error("slice %d: no good checkpoint from the resume point v%d on; the optimizer "
                     "state restarts", index, floor)  # fmt: skip
        return Restored(fallback, None, 0, skipped, exact=False)
    else:
        if manifest is not None:  # cannot be newer than what was published: ignore it
            logger.warning("slice %d: checkpoint v%d is past the published v%d; not used",
                           index, manifest.version, target)  # fmt: skip
        base = SliceState(slice_index=index, version=0, values=initial.clone(),
                          optimizer={}, grads_offset=0)  # fmt: skip
    checkpoint_version = base.version if base.version > 0 else None
    if base.version == target:
        return Restored(base, checkpoint_version, 0, skipped, exact=True)
    steps = await closes(base.version, target)
    try:
        grads = await _read_grads(kafka, grads_topic, index, base.grads_offset, steps)
        replayed = await asyncio.to_thread(_replay, base, steps, grads, optimizer)
    except ReplayError as exc:
        logger.error("slice %d: cannot replay v%d..v%d (%s); the optimizer state restarts",
                     index, base.version + 1, target, exc)  # fmt: skip
        fallback = SliceState(slice_index=index, version=target, values=last.values.clone(),
                              optimizer={}, grads_offset=0)  # fmt: skip
        return Restored(fallback, checkpoint_version, 0, skipped, exact=False)
    if not torch.equal(replayed.values, last.values.to(torch.float32)):
        logger.error("slice %d: the replay to v%d differs from the published parameters; "
                     "keeping the published ones", index, target)  # fmt: skip
        replayed.values = last.values.clone()
        return Restored(replayed, checkpoint_version, len(steps), skipped, exact=False)
    return Restored(replayed, checkpoint_version, len(steps), skipped, exact=True)


async def _read_grads(
    kafka: KafkaSettings, topic: str, index: int, offset: int, steps: list[StepClose]
) -> dict[str, GradSlice]:
    needed = {e.contribution_id for c in steps for e in c.contributions if e.num_samples > 0}
    found: dict[str, GradSlice] = {}
    async with TopicTail(kafka, topic, offsets={index: offset}) as tail:
        while not tail.caught_up and len(found) < len(needed):
            for record in await tail.get_many(_POLL_S):
                grad = record.message
                if isinstance(grad, GradSlice) and grad.contribution_id in needed:
                    found.setdefault(grad.contribution_id, grad)
    if missing := needed - set(found):
        raise ReplayError(f"{len(missing)} gradient slices are not on the topic after offset "
                          f"{offset}")  # fmt: skip
    return found


def _replay(
    base: SliceState, steps: list[StepClose], grads: dict[str, GradSlice], optimizer: OptimizerSpec
) -> SliceState:
    owner: SliceOwner[None] = SliceOwner(
        slice_index=base.slice_index,
        values=base.values,
        version=base.version,
        optimizer=optimizer,
        optimizer_state=base.optimizer,
    )
    for close in steps:
        slices = [grads[e.contribution_id] for e in close.contributions if e.num_samples > 0]
        owner.step(close, slices)
    return owner.snapshot(grads_offset=0)


def resumed_slice(checkpoints: CheckpointStore, version: int, index: int, numel: int) -> SliceState:
    """Slice ``index`` (``numel`` values) of checkpoint ``version`` (verified; blocking),
    where a resumed job starts: its grads partition is new, so a replay from it starts at
    offset 0. CheckpointError when the file is missing, corrupt or of another size."""
    manifest = checkpoints.read_manifest(version)
    if index >= len(manifest.files):
        raise CheckpointError(f"version {version} has no slice {index}")
    state = checkpoints.read_slice(manifest.files[index])
    if state.values.numel() != numel:
        raise CheckpointError(f"version {version}, slice {index}: {state.values.numel()} "
                              f"values, the model's slice has {numel}")  # fmt: skip
    return SliceState(
        slice_index=index,
        version=version,
        values=state.values.clone(),
        optimizer={name: tensor.clone() for name, tensor in state.optimizer.items()},
        grads_offset=0,
    )
