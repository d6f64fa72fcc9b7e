"""Training one job: restore -> consume -> train / evaluate -> checkpoint -> complete.

Reads as the loop it runs::

    restore the latest trainer state (if any); publish "running"
    while the job is not done:
        wait for the next ready batch (exposed data wait, measured)
        classify it: hold (later epoch) | drop (duplicate) | train | evaluate
        train:    forward/backward; every micro_batches_per_step (or at the epoch's end) update
        epoch end: snapshot the parameters for the epoch's eval, checkpoint
        every checkpoint_every_steps: checkpoint
    final checkpoint; export the model and the ledger; publish "completed"

A checkpoint captures the state at a step boundary, writes it in the background and only then
acknowledges the records whose effect it holds, so a restarted trainer neither loses a batch
nor counts one twice. Compute runs on one dedicated thread; the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import torch
from opentelemetry import trace
from opentelemetry.trace import Link

from conveyor.libs.bus import Consumer, Producer, Received
from conveyor.libs.config import KafkaSettings
from conveyor.libs.messages import Topics
from conveyor.libs.storage import ObjectStore
from conveyor.services.trainer.checkpointing import Checkpointer
from conveyor.services.trainer.compute import MicroResult
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.input import TRACER_NAME, DeviceCopier, Prefetcher, ReadyBatch
from conveyor.services.trainer.ledger import Ledger
from conveyor.services.trainer.loop import Disposition, Schedule, ScheduleState
from conveyor.services.trainer.metrics import TrainerMetrics, open_gpu_probe
from conveyor.services.trainer.reporting import Reporter
from conveyor.services.trainer.session import JobFailed, JobSession
from conveyor.services.trainer.state import (
    StateStore,
    TrainerCheckpoint,
    capture_tensors,
    restore_tensors,
)
from conveyor.services.trainer.summary import build_summary, export_model, write_ledger
from conveyor.services.trainer.tally import JobTally
from conveyor.services.trainer.timing import StageLatencies, WaitMeter

logger = logging.getLogger(__name__)

R = TypeVar("R")


class JobRunner:
    """Trains one job to its end; single use. ``run()`` returns the summary.

    Raises :class:`JobFailed` when the job cannot go on, ``BusError``/``StorageError`` when
    the broker or the store failed (retriable ones: rejoin and resume from the checkpoint).
    """

    def __init__(
        self,
        session: JobSession,
        *,
        settings: TrainerSettings,
        kafka: KafkaSettings,
        producer: Producer,
        store: ObjectStore,
        metrics: TrainerMetrics,
        compute_executor: Executor,
        copy_executor: Executor,
    ) -> None:
        self.session = session
        self.settings = settings
        self._kafka = kafka
        self._producer = producer
        self._store = store
        self.metrics = metrics
        self._compute_executor = compute_executor
        self._copy_executor = copy_executor
        plan, spec = session.plan, session.spec
        self.schedule: Schedule[ReadyBatch] = Schedule(
            epochs=spec.training.epochs,
            train_batches_per_epoch=plan.train_batches_per_epoch,
            eval_batches_per_epoch=plan.eval_batches_per_epoch,
        )
        self.tally = JobTally()
        self.ledger = Ledger(plan.num_train + plan.num_eval)
        self.checkpointer = Checkpointer(
            StateStore(store, session.job_id, keep_last=settings.keep_states), metrics
        )
        self.meter = WaitMeter(window_s=settings.rate_window_s)
        self.stages = StageLatencies(window=settings.stage_window)
        self._snapshots: dict[int, torch.nn.Module] = {}
        self._step_batches: list[ReadyBatch] = []
        self._step_loss_sum = 0.0
        self._last_loss: float | None = None
        self._consumer: Consumer | None = None
        self._prefetch: Prefetcher | None = None
        self._waiting = False
        self._gpu = open_gpu_probe(session.device)
        self._tracer = trace.get_tracer(TRACER_NAME)
        self.reporter = Reporter(
            producer,
            jobs_topic=Topics(kafka.topic_prefix).jobs,
            control_topic=plan.control_topic,
            job_id=session.job_id,
            worker_id=settings.worker_id,
            progress_interval_s=settings.progress_interval_s,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            lead_batches=spec.flow.max_lead_batches,
            progress=self.progress,
            heartbeat=self.heartbeat,
            waiting=lambda: self._waiting,
        )

    # -- the job ------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        await self._restore()
        await self.reporter.publish_event("running", {"worker_id": self.settings.worker_id})
        session = self.session
        async with Consumer(
            self._kafka,
            [session.plan.batches_topic],
            group_id=session.group_id,
            max_in_flight=session.max_in_flight,
            dead_letter_producer=self._producer,
        ) as consumer:
            self._consumer = self.checkpointer.consumer = consumer
            try:
                await self._consume(consumer)
                await self._checkpoint()
            finally:
                # Also on a stop: the write in flight finishes and its acks are committed.
                await self.checkpointer.settle()
                self.checkpointer.consumer = None
        return await self._complete()

    async def _consume(self, consumer: Consumer) -> None:
        prefetch = Prefetcher(
            consumer,
            DeviceCopier(self.session.device),
            job_id=self.session.job_id,
            depth=self.settings.prefetch_batches,
            consumer_group=self.session.group_id,
            reject=self._reject,
            executor=self._copy_executor,
        )
        self._prefetch = prefetch
        try:
            async with asyncio.TaskGroup() as group:
                fetching = group.create_task(prefetch.run(), name="trainer.prefetch")
                reporting = group.create_task(self.reporter.run(), name="trainer.report")
                await self._loop(prefetch)
                fetching.cancel()
                reporting.cancel()
        except BaseExceptionGroup as failed:
            if len(failed.exceptions) == 1:  # the failing task's own exception, not a group
                raise failed.exceptions[0] from None
            raise

    def _finished(self) -> bool:
        max_steps = self.session.spec.training.max_steps
        return self.schedule.done or (max_steps is not None and self.tally.step >= max_steps)

    async def _loop(self, prefetch: Prefetcher) -> None:
        first = True
        while not self._finished():
            if prefetch.empty():
                self._waiting = True  # the reporter now sends consumed counts promptly
                await self._relieve_backpressure()
            item, wait_s = await prefetch.get()
            self._waiting = False
            if not first:  # the wait for the job's very first batch is start-up, not starvation
                self.meter.add(wait_s=wait_s)
                self.metrics.data_wait.observe(wait_s)
            first = False
            await self._handle(item)
            self.metrics.held_batches.set(self.schedule.held)
            self.metrics.ready_batches.set(prefetch.qsize())

    async def _handle(self, item: ReadyBatch) -> None:
        work = deque([item])
        while work and not self._finished():
            batch = work.popleft()
            disposition = self.schedule.classify(batch.batch_id, batch.epoch, batch.split)
            if disposition is Disposition.HOLD:
                self.schedule.hold(batch.batch_id, batch.epoch, batch.split, batch)
            elif disposition is Disposition.TRAIN:
                if await self._train_batch(batch):
                    await self._close_train_epoch()
                    work.extend(self.schedule.take_ready())
            elif disposition is Disposition.EVAL:
                await self._eval_batch(batch)
            else:
                self._drop(batch, disposition)

    # -- batches ------------------------------------------------------------------------------

    async def _train_batch(self, batch: ReadyBatch) -> bool:
        """Forward/backward one micro-batch; update when the step is full. True at epoch end."""
        result = await self._compute(self.session.engine.accumulate, batch.x, batch.y, span=batch)
        self._batch_done(batch, result)
        self.ledger.add(batch.epoch, batch.sample_ids)
        tally = self.tally
        tally.epoch_loss_sum += result.loss_sum
        tally.epoch_samples += result.samples
        tally.consumed_batches += 1
        tally.consumed_train_batches += 1
        self._step_batches.append(batch)
        self._step_loss_sum += result.loss_sum
        epoch_closed = self.schedule.mark_trained(batch.batch_id)
        if epoch_closed or len(self._step_batches) >= self.session.micro_batches_per_step:
            await self._apply_step(epoch_closed=epoch_closed)
        return epoch_closed

    async def _apply_step(self, *, epoch_closed: bool) -> None:
        batches, self._step_batches = self._step_batches, []
        loss_sum, self._step_loss_sum = self._step_loss_sum, 0.0
        samples = sum(batch.samples for batch in batches)
        started_ns = time.time_ns()
        update_s = await self._compute(self.session.updater.apply, samples)
        tally = self.tally
        tally.step += 1
        tally.samples_trained += samples
        tally.update_s += update_s
        self.meter.add(compute_s=update_s)
        self._last_loss = loss_sum / samples
        for batch in batches:
            self.checkpointer.hold(batch.received)
        # A step is a fan-in of batches: its span links to each batch's trace.
        self._tracer.start_span(
            "step",
            links=[Link(batch.span.get_span_context()) for batch in batches],
            start_time=started_ns,
            attributes={"conveyor.step": tally.step, "conveyor.samples": samples},
        ).end()
        self.metrics.steps.inc()
        self.metrics.samples.inc(samples)
        self.metrics.step_time.observe(update_s)
        if not epoch_closed and tally.step % self.session.checkpoint_every_steps == 0:
            await self._checkpoint()

    async def _close_train_epoch(self) -> None:
        epoch = self.schedule.train_epoch
        with_eval = self.session.plan.eval_batches_per_epoch > 0
        if with_eval:
            self._snapshots[epoch] = await self._compute(self.session.engine.snapshot)
        self.schedule.close_train_epoch()
        self.tally.close_train_epoch(epoch, with_eval=with_eval)
        if not with_eval:
            await self._epoch_completed(epoch)
        await self._checkpoint()
        self.reporter.request_progress()
        logger.info(
            "job %s: epoch %d trained (step %d)", self.session.job_id, epoch, self.tally.step
        )

    async def _eval_batch(self, batch: ReadyBatch) -> None:
        snapshot = self._snapshots[batch.epoch]
        engine = self.session.engine
        result = await self._compute(engine.evaluate, snapshot, batch.x, batch.y, span=batch)
        self._batch_done(batch, result)
        self.tally.evals[batch.epoch].add(result.loss_sum, result.correct, result.samples)
        self.tally.consumed_batches += 1
        self.checkpointer.hold(batch.received)
        if self.schedule.mark_evaluated(batch.epoch, batch.batch_id):
            self.tally.close_eval(batch.epoch)
            del self._snapshots[batch.epoch]
            await self._epoch_completed(batch.epoch)

    async def _epoch_completed(self, epoch: int) -> None:
        results = self.tally.results[epoch]
        await self.reporter.send_event("epoch_completed", {"epoch": epoch, **results})
        self.reporter.request_progress()
        logger.info("job %s: epoch %d completed: %s", self.session.job_id, epoch, results)

    def _batch_done(self, batch: ReadyBatch, result: MicroResult) -> None:
        batch.timestamps["compute_end"] = time.time()
        self.stages.add_batch(batch.timestamps, result.compute_s)
        train = batch.split == "train"
        self.meter.add(compute_s=result.compute_s, samples=result.samples if train else 0)
        self.metrics.compute.observe(result.compute_s)
        self.metrics.batches.labels(split=batch.split, outcome="done").inc()
        batch.span.end()

    def _drop(self, batch: ReadyBatch, disposition: Disposition) -> None:
        # No effect, but acknowledged only with the next checkpoint, like everything else.
        self.checkpointer.hold(batch.received)
        if disposition is Disposition.DUPLICATE:
            self.tally.duplicates += 1
        else:
            logger.warning(
                "job %s: dropping batch %s of epoch %d (outside the job)",
                self.session.job_id,
                batch.batch_id,
                batch.epoch,
            )
        batch.span.set_attribute("conveyor.outcome", disposition.value)
        batch.span.end()
        self.metrics.batches.labels(split=batch.split, outcome=disposition.value).inc()

    def _reject(self, received: Received, reason: str) -> None:
        logger.warning(
            "job %s: skipping record %s[%d]@%d: %s",
            self.session.job_id,
            received.topic,
            received.partition,
            received.offset,
            reason,
        )
        self.metrics.rejected.inc()
        self.checkpointer.hold(received)

    async def _compute(self, fn: Callable[..., R], *args: Any, span: ReadyBatch | None = None) -> R:
        """Run ``fn`` on the compute thread; a failure there fails the job."""
        started_ns = time.time_ns()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._compute_executor, fn, *args)
        except Exception as exc:
            raise JobFailed(f"training failed: {type(exc).__name__}: {exc}") from exc
        if span is not None:
            parent = trace.set_span_in_context(span.span)
            self._tracer.start_span("compute", context=parent, start_time=started_ns).end()
        return result

    # -- checkpoints --------------------------------------------------------------------------

    async def _relieve_backpressure(self) -> None:
        """Checkpoint early when unacknowledged records have paused the consumer (they are
        acknowledged only by a checkpoint, so waiting for data would wait forever)."""
        consumer = self._consumer
        if (
            consumer is not None
            and consumer.in_flight >= self.session.max_in_flight
            and self.checkpointer.held
            and not self._step_batches
        ):
            logger.info("job %s: consumer full, checkpointing early", self.session.job_id)
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """Capture the state at this step boundary and write it in the background; the records
        it covers are acknowledged once it is durable."""
        assert not self._step_batches, "checkpoints are taken between steps"
        self.tally.wait_s, self.tally.compute_s = self.meter.wait_s, self.meter.compute_s
        meta = {
            "job_id": self.session.job_id,
            "worker_id": self.settings.worker_id,
            "saved_at": time.time(),
            "schedule": self.schedule.state.to_json(),
            "tally": self.tally.to_json(),
        }
        session = self.session
        tensors, meta["optimizer"] = await self._compute(
            capture_tensors, session.model, session.optimizer, self._snapshots, self.ledger
        )
        await self.checkpointer.save(
            TrainerCheckpoint(step=self.tally.step, tensors=tensors, meta=meta)
        )

    async def _restore(self) -> None:
        checkpoint = await asyncio.to_thread(self.checkpointer.states.load_latest)
        if checkpoint is None:
            return
        session, meta = self.session, checkpoint.meta
        try:
            schedule = ScheduleState.from_json(meta["schedule"])
            tally = JobTally.from_json(meta["tally"])
            self._snapshots = await asyncio.get_running_loop().run_in_executor(
                self._compute_executor,
                functools.partial(
                    restore_tensors,
                    checkpoint,
                    session.model,
                    session.optimizer,
                    snapshot_epochs=list(schedule.eval_open),
                    make_snapshot=session.engine.snapshot,
                ),
            )
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise JobFailed(f"trainer state of step {checkpoint.step} is unusable: {exc}") from exc
        self.schedule.state = schedule
        self.tally = tally
        self.ledger = Ledger.from_tensors(self.ledger.size, checkpoint.tensors)
        self.meter.wait_s, self.meter.compute_s = tally.wait_s, tally.compute_s
        self.meter.samples = tally.samples_trained
        logger.info(
            "job %s: resumed from the trainer state of step %d (epoch %d)",
            session.job_id, checkpoint.step, schedule.train_epoch,
        )  # fmt: skip

    # -- the end ------------------------------------------------------------------------------

    async def _complete(self) -> dict[str, Any]:
        session = self.session

        def export() -> str:
            write_ledger(self._store, session.job_id, self.ledger)
            return export_model(
                self._store, session.job_id, session.model, spec=session.spec,
                num_classes=session.plan.num_classes, sample_shape=session.plan.sample_shape,
                step=self.tally.step,
            )  # fmt: skip

        model_uri = await asyncio.get_running_loop().run_in_executor(self._compute_executor, export)
        result = self.tally.last_result()
        busy_s = self.meter.wait_s + self.meter.compute_s
        summary = build_summary(
            job_id=session.job_id,
            epochs=self.schedule.epochs_completed,
            steps=self.tally.step,
            samples=self.tally.samples_trained,
            eval_accuracy=result["eval_accuracy"],
            eval_loss=result["eval_loss"],
            samples_per_second=self.tally.samples_trained / busy_s if busy_s > 0 else 0.0,
            data_wait_ratio=self.meter.ratio,
            checkpoint=model_uri,
        )
        await self.reporter.send_event(
            "progress", {"worker_id": self.settings.worker_id, **self.progress()}
        )
        await self.reporter.publish_event("completed", {"summary": summary})
        logger.info("job %s: completed: %s", session.job_id, summary)
        return summary

    # -- reports ------------------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        """The data of a ``progress`` event (worker_id is added by the reporter)."""
        recent_ratio, recent_rate = self.meter.recent()
        tally = self.tally
        return {
            "epoch": self.schedule.train_epoch,
            "step": tally.step,
            "samples_trained": tally.samples_trained,
            "batches_consumed": tally.consumed_batches,
            "consumed_batches": tally.consumed_batches,
            "consumed_train_batches": tally.consumed_train_batches,
            "duplicates": tally.duplicates,
            "held_batches": self.schedule.held,
            "loss": self._last_loss,
            "samples_per_second": recent_rate,
            "data_wait_ratio": recent_ratio,
            "data_wait_ratio_job": self.meter.ratio,
            "stage_latency_s": self.stages.percentile(50),
            "stage_latency_p95_s": self.stages.percentile(95),
        }

    def heartbeat(self) -> dict[str, Any]:
        """The ``info`` of a heartbeat: throughput, per-step time breakdown, queues, GPU."""
        recent_ratio, recent_rate = self.meter.recent()
        steps = max(1, self.tally.step)
        info: dict[str, Any] = {
            "device": str(self.session.device),
            "epoch": self.schedule.train_epoch,
            "step": self.tally.step,
            "samples_per_second": recent_rate,
            "data_wait_ratio": recent_ratio,
            "step_time_s": {
                "data_wait": self.meter.wait_s / steps,
                "compute": (self.meter.compute_s - self.tally.update_s) / steps,
                "update": self.tally.update_s / steps,
            },
            "ready_batches": self._prefetch.qsize() if self._prefetch is not None else 0,
            "held_batches": self.schedule.held,
            "in_flight": self._consumer.in_flight if self._consumer is not None else 0,
        }
        if self._gpu is not None:
            reading = self._gpu.read()
            self.metrics.set_gpu(reading)
            info["gpu"] = reading
            info["gpu"]["torch_allocated_bytes"] = torch.cuda.memory_allocated(self.session.device)
        if recent_ratio is not None:
            self.metrics.data_wait_ratio.set(recent_ratio)
        self.metrics.samples_per_second.set(recent_rate)
        return info
