"""The checkpoint side of one job's slice owners in one aggregator process: writing slice
states in the background and announcing them (``SliceSaved``), and reporting checkpoints found
unusable when a slice is restored.

Writes run in threads, at most ``MAX_PENDING_SAVES`` at once per job (each holds a copy of a
slice in memory); :meth:`SliceSaver.start` waits for one to end beyond that, which holds the
step that asked. A failed write is announced with its error: the job goes on and the
checkpointer reports that the version cannot be committed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from conveyor.platform.bus import Producer
from conveyor.platform.messages import CheckpointUnusable, SliceSaved
from conveyor.platform.storage import StorageError
from conveyor.services.aggregator.metrics import AggregatorMetrics
from conveyor.training.checkpoint import CheckpointStore, Skipped, SliceState
from conveyor.training.checkpoint.slicefile import decode_slice

logger = logging.getLogger(__name__)

MAX_PENDING_SAVES = 2


class SliceSaver:
    """Saves and announces the slice states of one job (module docstring)."""

    def __init__(
        self,
        checkpoints: CheckpointStore,
        *,
        producer: Producer,
        control_topic: str,
        jobs_topic: str,
        worker_id: str,
        metrics: AggregatorMetrics,
    ) -> None:
        self.checkpoints = checkpoints
        self._producer = producer
        self._control_topic = control_topic
        self._jobs_topic = jobs_topic
        self._worker_id = worker_id
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self._reported_unusable: set[int] = set()

    @property
    def job_id(self) -> str:
        return self.checkpoints.job_id

    async def start(self, state: SliceState) -> None:
        """Write ``state`` in the background, then announce it."""
        while len(self._tasks) >= MAX_PENDING_SAVES:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(
            self._save(state), name=f"save.{self.job_id}.{state.slice_index}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def announce_written(self, key: str) -> bool:
        """Announce the state file at ``key`` if it exists and parses (a previous owner wrote
        it and died before announcing); False when it must be written again."""
        store = self.checkpoints.store
        try:
            if not await asyncio.to_thread(store.exists, key):
                return False
            data = await asyncio.to_thread(store.get_bytes, key)
            info = await asyncio.to_thread(store.info, key)
            state = decode_slice(data)
        except (StorageError, ValueError) as exc:
            logger.warning("job %s: %s: %s; writing it again", self.job_id, key, exc)
            return False
        await self._publish(state, key=info.key, size_bytes=info.size_bytes, sha256=info.sha256)
        return True

    async def report_unusable(self, skipped: list[Skipped], used: int | None) -> None:
        """One ``CheckpointUnusable`` per checkpoint this process found torn or corrupt."""
        for entry in skipped:
            if entry.version in self._reported_unusable:
                continue
            self._reported_unusable.add(entry.version)
            await self._producer.publish(self._jobs_topic, CheckpointUnusable(
                job_id=self.job_id, version=entry.version, reason=entry.reason,
                used_version=used, worker_id=self._worker_id,
            ), key=self.job_id)  # fmt: skip

    async def close(self) -> None:
        """Cancel the writes in flight and wait for them."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def _save(self, state: SliceState) -> None:
        started = time.monotonic()
        try:
            entry = await asyncio.to_thread(self.checkpoints.write_slice, state)
        except StorageError as exc:
            logger.warning("job %s: saving slice %d v%d failed: %s",
                           self.job_id, state.slice_index, state.version, exc)  # fmt: skip
            await self._publish(state, key="", size_bytes=0, sha256="", error=str(exc))
            return
        self._metrics.checkpoint_write_seconds.observe(time.monotonic() - started)
        await self._publish(state, key=entry.key, size_bytes=entry.size_bytes, sha256=entry.sha256)

    async def _publish(
        self, state: SliceState, *, key: str, size_bytes: int, sha256: str, error: str | None = None
    ) -> None:
        await self._producer.publish(self._control_topic, SliceSaved(
            job_id=self.job_id, version=state.version, slice_index=state.slice_index,
            key=key, size_bytes=size_bytes, sha256=sha256, grads_offset=state.grads_offset,
            error=error,
        ))  # fmt: skip
