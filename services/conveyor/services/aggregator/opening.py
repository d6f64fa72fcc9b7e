"""Opening a slice in this process: the state its new owner starts from.

When this process is assigned partition p of a job's grads topic it opens slice p (a
:class:`~conveyor.services.aggregator.slice_owner.SliceOwner`) where the slice is: when the
params topic holds no ParamSlice of it yet, at the job's first version (0, or the checkpoint a
resumed job starts from), which it publishes; otherwise at the last ParamSlice's version, its
optimizer state rebuilt from the latest checkpoint and the grads log after it
(:mod:`conveyor.services.aggregator.restore`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from conveyor.platform.bus import Received
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import StepClose
from conveyor.services.aggregator.coordinator import Coordinator
from conveyor.services.aggregator.job import JobContext
from conveyor.services.aggregator.params import last_param_slices
from conveyor.services.aggregator.restore import restore_slice, resumed_slice
from conveyor.services.aggregator.saving import SliceSaver
from conveyor.services.aggregator.slice_owner import SliceOwner
from conveyor.training.checkpoint import CheckpointError, CheckpointStore, SliceState
from conveyor.training.jobhost import JobFailure
from conveyor.training.optim import aggregator_optimizer

logger = logging.getLogger(__name__)


class SliceOpener:
    """Opens one job's slices in this process (module docstring). :meth:`open` raises
    :class:`JobFailure` when a slice cannot be opened."""

    def __init__(
        self,
        ctx: JobContext,
        coordinator: Coordinator,
        *,
        kafka: KafkaSettings,
        checkpoints: CheckpointStore,
        saver: SliceSaver,
        grads_topic: str,
        params_topic: str,
        folded: asyncio.Event,
        log_read: asyncio.Event,
        publish: Callable[[int, int, torch.Tensor], Awaitable[None]],
    ) -> None:
        """``folded``: set whenever control records were folded into ``coordinator`` (waiters
        clear it, then check); ``log_read``: set once the control log as it was at start is
        folded; ``publish(index, version, values)``: publishes a ParamSlice."""
        self.ctx = ctx
        self.coordinator = coordinator
        self.kafka = kafka
        self.checkpoints = checkpoints
        self.saver = saver
        self._grads_topic = grads_topic
        self._params_topic = params_topic
        self._folded = folded
        self._log_read = log_read
        self._publish = publish

    async def open(self, index: int) -> SliceOwner[Received]:
        """The owner of slice ``index``, at the state the slice is in (module docstring)."""
        start, stop = self.ctx.bounds[index]
        optimizer = aggregator_optimizer(self.ctx.spec)
        statistics = self.ctx.layout.statistic_ranges(start, stop)
        last = (await last_param_slices(self.kafka, self._params_topic)).get(index)
        if last is None:
            await self._log_read.wait()  # a resumed job starts from its checkpoint
            state = await self._first_state(index)
            await self._publish(index, state.version, state.values.clone())
        else:
            if last.values.numel() != stop - start:
                raise JobFailure(
                    f"ParamSlice {index}: {last.values.numel()} values, not {stop - start}"
                )
            restored = await restore_slice(
                kafka=self.kafka,
                grads_topic=self._grads_topic,
                index=index,
                initial=self.ctx.initial[start:stop],
                last=last,
                optimizer=optimizer,
                checkpoints=self.checkpoints,
                closes=self._closes_through,
                floor=self.coordinator.resumed_from or 0,
                statistics=statistics,
            )
            await self.saver.report_unusable(restored.skipped, restored.checkpoint_version)
            state = restored.state
            logger.info("job %s: slice %d restored at version %d from %s + %d replayed versions "
                        "(optimizer state %s)", self.ctx.job_id, index, state.version,
                        f"checkpoint v{restored.checkpoint_version}"
                        if restored.checkpoint_version is not None else "version 0",
                        restored.replayed, "exact" if restored.exact else "restarted")  # fmt: skip
        # In a thread: building the first torch optimizer of a process imports for seconds.
        return await asyncio.to_thread(
            SliceOwner[Received],
            slice_index=index,
            values=state.values,
            version=state.version,
            optimizer=optimizer,
            optimizer_state=state.optimizer,
            statistics=statistics,
        )

    async def _first_state(self, index: int) -> SliceState:
        """Slice ``index`` at the job's first version: 0, or the checkpoint it resumed from."""
        start, stop = self.ctx.bounds[index]
        if (version := self.coordinator.resumed_from) is None:
            return SliceState(slice_index=index, version=0, values=self.ctx.initial[start:stop],
                              optimizer={}, grads_offset=0)  # fmt: skip
        try:
            return await asyncio.to_thread(
                resumed_slice, self.checkpoints, version, index, stop - start
            )
        except CheckpointError as exc:
            raise JobFailure(f"cannot resume from checkpoint v{version}: {exc}") from exc

    async def _closes_through(self, after: int, version: int) -> list[StepClose]:
        """StepCloses after+1..version, once the control log is folded that far."""
        while True:
            self._folded.clear()  # before the check: a fold after it sets it again
            if self.coordinator.version >= version:
                break
            await self._folded.wait()
        return [self.coordinator.closes[v] for v in range(after + 1, version + 1)]
