"""Acknowledge a record only once a durable trainer state holds its effect.

The step loop hands every record whose effect is in memory (applied, evaluated, or recognised
as a duplicate) to :meth:`Checkpointer.hold`. :meth:`Checkpointer.save` writes a captured
state in the background and, once it is durable, acknowledges exactly the records held up to
the capture and commits. One write runs at a time; a failed write raises from the next
``save`` or from :meth:`settle`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from conveyor.libs.bus import BusError, Consumer, Received
from conveyor.services.trainer.metrics import TrainerMetrics
from conveyor.services.trainer.state import StateStore, TrainerCheckpoint

logger = logging.getLogger(__name__)


class Checkpointer:
    """Background state writes and the acknowledgements they release, for one job."""

    def __init__(self, states: StateStore, metrics: TrainerMetrics) -> None:
        self.states = states
        self._metrics = metrics
        self._held: list[Received] = []
        self._writer: asyncio.Task[None] | None = None
        self.consumer: Consumer | None = None
        """Where acknowledgements go; None: nothing to acknowledge (not consuming)."""

    @property
    def held(self) -> int:
        """Records waiting for the next durable state."""
        return len(self._held)

    def hold(self, received: Received) -> None:
        """``received``'s effect is in memory: acknowledge it with the next durable state."""
        self._held.append(received)

    async def save(self, checkpoint: TrainerCheckpoint) -> None:
        """Start writing ``checkpoint`` (after the previous write finished) and return; it
        covers every record held so far."""
        await self.settle()
        records, self._held = self._held, []
        self._writer = asyncio.create_task(self._write(checkpoint, records))

    async def settle(self) -> None:
        """Wait for the write in flight, if any; raises what it raised. A cancelled caller
        does not cancel the write (it finishes and acknowledges its records on its own)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await asyncio.shield(writer)

    async def _write(self, checkpoint: TrainerCheckpoint, records: list[Received]) -> None:
        started = time.perf_counter()
        await asyncio.to_thread(self.states.save, checkpoint)
        self._metrics.checkpoints.inc()
        self._metrics.checkpoint_time.observe(time.perf_counter() - started)
        consumer = self.consumer
        if consumer is None:
            return
        for received in records:
            consumer.ack(received)
        try:
            await consumer.commit()
        except BusError as exc:  # the periodic commit retries; redeliveries are deduplicated
            logger.warning("commit after the state of step %d failed: %s", checkpoint.step, exc)
