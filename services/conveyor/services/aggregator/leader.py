"""The coordinator's voice: publishes its decisions, the job's progress, epoch results and,
at the end, the exported model and the ``completed`` event.

Runs in the aggregator process that owns partition 0 of the job's grads topic, and only when
the control log has been read to its end (the decisions must rest on the whole log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from conveyor.platform.bus import Producer, TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    CoordinatorProgress,
    EpochCompleted,
    JobCompleted,
    JobEvent,
    Topics,
)
from conveyor.platform.storage import ObjectStore
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.coordinator import Coordinator
from conveyor.services.aggregator.epochs import EpochResult
from conveyor.services.aggregator.finish import final_params, summarise, write_outputs
from conveyor.services.aggregator.job import JobContext
from conveyor.services.aggregator.metrics import AggregatorMetrics, rejection_label
from conveyor.training.cadence import ConsumptionRate, coordinator_progress_interval_s
from conveyor.training.checkpoint import manifest_key

logger = logging.getLogger(__name__)


class Leader:
    """Publishes for a :class:`Coordinator`; ``reported(epoch)`` says whether the jobs topic
    already has that epoch's ``epoch_completed`` (a previous coordinator may have sent it)."""

    def __init__(
        self,
        ctx: JobContext,
        coordinator: Coordinator,
        *,
        settings: AggregatorSettings,
        kafka: KafkaSettings,
        producer: Producer,
        store: ObjectStore,
        metrics: AggregatorMetrics,
        reported: Callable[[int], bool],
        folded: asyncio.Event,
    ) -> None:
        """``folded``: set whenever control records are folded into ``coordinator``."""
        self.ctx = ctx
        self.coordinator = coordinator
        self.settings = settings
        self.kafka = kafka
        self.topics = Topics(kafka.topic_prefix)
        self.producer = producer
        self.store = store
        self.metrics = metrics
        self.reported = reported
        self._folded = folded
        self.completed = False
        self._completion: asyncio.Task[None] | None = None
        self._announced: set[int] = set()
        self._progress_at = 0.0
        self._progress_key: tuple[Any, ...] | None = None
        self._started_at = time.monotonic()
        self._rate = ConsumptionRate()

    async def decide(self, control_log: TopicTail) -> bool:
        """Decide and publish the rejections and the step close that are due.

        Returns whether it closed a step and folded that StepClose at once: when every record
        before it on the control log (``control_log``, the tail this process folds) was read
        already, folding it now is folding it in log order, and this process's slice owners may
        apply it without the hop of reading it back. Otherwise it is folded when read. The
        caller applies it before :meth:`report`, whose publishes are not the step's.
        """
        if self._completion is not None:
            if self._completion.done():
                self._completion.result()  # re-raises what the export failed with
            return False
        coordinator = self.coordinator
        folded = False
        decisions = coordinator.decide(time.time())
        control = self.topics.control(self.ctx.job_id, incarnation=self.ctx.incarnation)
        for rejection in decisions.rejections:
            logger.info("job %s: rejecting %s: %s",
                        self.ctx.job_id, rejection.contribution_id, rejection.reason)  # fmt: skip
            await self.producer.publish(control, rejection)
            self.metrics.rejections.labels(rejection_label(rejection.reason)).inc()
        if decisions.close is not None:
            record = await self.producer.publish(control, decisions.close)
            if control_log.position(record.partition) == record.offset:
                coordinator.fold(decisions.close)
                folded = True
            for entry in decisions.close.contributions:
                self.metrics.staleness.observe(entry.staleness)
        return folded

    async def report(self) -> None:
        """Publish the progress, the results of ended epochs and, once training is over, start
        the job's completion (the export)."""
        if self._completion is not None:
            return
        coordinator = self.coordinator
        await self._progress()
        for result in coordinator.epochs.results():
            await self._epoch_completed(result)
        if coordinator.finished:
            # In a task: the final ParamSlices may come from this very process's slice owners,
            # which the caller advances between two passes.
            await self._progress(force=True)
            self._completion = asyncio.create_task(
                self._complete(), name=f"aggregator.complete.{self.ctx.job_id}"
            )

    async def stop(self) -> None:
        """Cancel a completion in progress (the next coordinator redoes it)."""
        task = self._completion
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    async def _progress(self, *, force: bool = False) -> None:
        c = self.coordinator
        routing = c.routing(time.time())
        # A routing that moved by less than a percent point is not news on its own.
        rounded = None if routing is None else tuple(round(w, 2) for w in routing)
        key = (c.version, c.consumed_batches, rounded)
        now = time.monotonic()
        due = force or now - self._progress_at >= self.interval(now)
        if key == self._progress_key or not due:
            return
        self._rate.published(now, c.consumed_batches)
        self._progress_key, self._progress_at = key, now
        await self._publish(CoordinatorProgress(
            job_id=self.ctx.job_id,
            consumed_batches=c.consumed_batches,
            consumed_train_batches=c.applied_train_batches,
            version=c.version,
            step=c.steps,
            epoch=c.current_epoch,
            samples_trained=c.samples_trained,
            loss=c.last_loss,
            # The sharder stamps it into the shard tasks it releases.
            routing=[] if routing is None else list(routing),
        ))  # fmt: skip

    def interval(self, now: float) -> float:
        """Least seconds between two progress events at ``now`` (monotonic s)."""
        return coordinator_progress_interval_s(
            now - self._started_at,
            least_s=self.settings.progress_interval_s,
            most_s=self.settings.progress_max_interval_s,
            lead_batches=self.ctx.spec.lead_batches,
            batches_per_s=self._rate.batches_per_s,
        )

    async def _epoch_completed(self, result: EpochResult) -> None:
        if result.epoch in self._announced or self.reported(result.epoch):
            self._announced.add(result.epoch)
            return
        logger.info("job %s: epoch %d done: eval loss %s accuracy %s", self.ctx.job_id,
                    result.epoch, result.eval_loss, result.eval_accuracy)  # fmt: skip
        await self._publish(EpochCompleted(
            job_id=self.ctx.job_id,
            epoch=result.epoch,
            version=result.version,
            eval_loss=result.eval_loss,
            eval_accuracy=result.eval_accuracy,
            train_loss=result.train_loss,
        ))  # fmt: skip
        self._announced.add(result.epoch)

    async def _complete(self) -> None:
        c = self.coordinator
        flat = await final_params(
            self.kafka, self.ctx, c.version, timeout_s=self.settings.export_timeout_s
        )
        uri = await asyncio.to_thread(write_outputs, self.store, self.ctx, flat, c)
        summary = summarise(c, uri)
        summary["last_checkpoint"] = await self._final_checkpoint()
        await self._publish(
            JobCompleted(job_id=self.ctx.job_id, summary=summary, worker_id=self.settings.worker_id)
        )
        self.completed = True
        logger.info("job %s: completed: %s", self.ctx.job_id, summary)

    async def _final_checkpoint(self) -> str | None:
        """Wait (up to ``export_timeout_s``) until every slice announced its state of the
        job's last checkpointed version, so the checkpointer can commit it before the job's
        topics go; the URI its manifest gets (None: no checkpoint, or a slice failed)."""
        c = self.coordinator
        version = c.last_checkpointed_version()
        if version is None:
            return None
        try:
            async with asyncio.timeout(self.settings.export_timeout_s):
                while True:
                    self._folded.clear()  # before the check: a fold after it sets it again
                    if c.checkpoint_answered(version):
                        break
                    await self._folded.wait()
        except TimeoutError:
            logger.warning("job %s: the slices of checkpoint v%d were not all saved in %.0f s",
                           self.ctx.job_id, version, self.settings.export_timeout_s)  # fmt: skip
            return None
        if any(saved.error for saved in c.saved[version].values()):
            return None
        return self.store.uri_for(manifest_key(self.ctx.job_id, version))

    async def _publish(self, event: JobEvent) -> None:
        await self.producer.publish(self.topics.jobs, event, key=self.ctx.job_id)
