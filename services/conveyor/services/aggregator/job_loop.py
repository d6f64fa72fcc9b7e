"""Serving one job in one aggregator process: read, route, apply, publish, coordinate.

Three tasks share the job's state::

    control: tail the control topic from the beginning -> Coordinator.fold (every process)
    grads:   group member on the grads topic -> GradSlices to the owner of their partition's slice
             (resting while the control log announces no slice it lacks: see .demand)
    engine:  on every arrival or tick_s:
               follow the assignment: open a SliceOwner per new partition (from the last
                 ParamSlice of that partition, or version 0 published by us: see .opening),
                 drop lost ones
               advance each owner: apply the next StepClose once its slices are held,
                 publish the ParamSlice, acknowledge the GradSlices it consumed
               this process owns partition 0 and caught up with the control log:
                 Leader.decide(), the owners apply a close it folded at once, Leader.report()

GradSlice records are acknowledged (committed) only once the ParamSlice of the version that
applied them is acknowledged by the broker, or when no future version can apply them; so the
next owner of a partition after a failover gets every GradSlice it still needs again, and it
rebuilds the slice's exact state, optimizer included, from the latest checkpoint and the log
after it (:mod:`.restore`).

Checkpoints: when a StepClose asks for one (``StepClose.checkpoint``), each owner copies its
slice's state right after applying it (in the step's thread), publishes the ParamSlice as usual
and writes the copy (slice 0's with the job's progress, ledger included) in the background
(:mod:`.saving`), then announces it with a ``SliceSaved``; the checkpointer commits once every
slice is announced. A resumed job's log starts with a ``ResumePoint``: the coordinator and the
slices start from its checkpoint instead of version 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import torch
from opentelemetry import trace

from conveyor.platform.bus import (
    BusError,
    Consumer,
    ConsumerStopped,
    Producer,
    Received,
    TopicTail,
)
from conveyor.platform.bus.tracing import fan_in, producer_context
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    GradSlice,
    ParamSlice,
    ResumePoint,
    StepClose,
    Topics,
)
from conveyor.platform.storage import ObjectStore
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig
from conveyor.services.aggregator.demand import grads_wanted
from conveyor.services.aggregator.job import JobContext
from conveyor.services.aggregator.leader import Leader
from conveyor.services.aggregator.metrics import AggregatorMetrics
from conveyor.services.aggregator.opening import SliceOpener
from conveyor.services.aggregator.resting import ControlRest
from conveyor.services.aggregator.saving import SliceSaver
from conveyor.services.aggregator.slice_owner import SliceOwner
from conveyor.training.checkpoint import (
    CheckpointError,
    CheckpointStore,
    SliceState,
    read_progress,
    slice_key,
)
from conveyor.training.compression import CompressionError
from conveyor.training.jobhost import JobFailure

logger = logging.getLogger(__name__)

_CONTROL_POLL_S = 0.2
_STALL_WARN_S = 5.0
"""A slice whose next StepClose is folded but not applied for this long is logged (with
what it waits for), again every such period."""


class JobAggregator:
    """Serves one job until cancelled (module docstring). ``run()`` raises
    :class:`JobFailure` when the job cannot go on, ``BusError`` on broker failures."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        settings: AggregatorSettings,
        kafka: KafkaSettings,
        producer: Producer,
        metrics: AggregatorMetrics,
        store: ObjectStore,
        reported: Callable[[int], bool],
    ) -> None:
        """``store``: where the job's model and ledger go; ``reported(epoch)``: whether the
        jobs topic already has that epoch's ``epoch_completed``."""
        self.ctx = ctx
        self.settings = settings
        self.kafka = kafka
        self.producer = producer
        self.metrics = metrics
        self.topics = Topics(kafka.topic_prefix)
        self._folded = asyncio.Event()
        """Set whenever control records were folded (waiters clear it, then check)."""
        self._log_read = asyncio.Event()  # set once the log as it was at start is folded
        self.coordinator = Coordinator(
            CoordinatorConfig(
                job_id=ctx.job_id,
                spec=ctx.spec,
                train_batches_per_epoch=ctx.train_batches_per_epoch,
                eval_batches_per_epoch=ctx.eval_batches_per_epoch,
                dataset_samples=ctx.dataset_samples,
                member_timeout_s=settings.member_timeout_s,
                batches_partitions=ctx.batches_partitions,
            )
        )
        self.leader = Leader(
            ctx,
            self.coordinator,
            settings=settings,
            kafka=kafka,
            producer=producer,
            store=store,
            metrics=metrics,
            reported=reported,
            folded=self._folded,
        )
        self.owners: dict[int, SliceOwner[Received]] = {}
        """The slices this process owns now (its grads partitions), by slice index."""
        self._early: dict[int, list[Received]] = {}
        self._wake = asyncio.Event()
        self._drained_at = -1.0
        """Start (monotonic s) of the latest control fetch that found nothing left to read."""
        self._rest = ControlRest(enabled=self.coordinator.sync)
        self._owned_since: float | None = None
        """Since when (monotonic s) this process owns partition 0."""
        self._engine_doing = "starting"
        """What the engine task awaits now (stall warnings)."""
        self._unchanged_since: dict[int, tuple[int, float]] = {}
        """Slice -> (version, monotonic s since it is at that version), for stall warnings."""
        self._tracer = trace.get_tracer(__name__)
        self._grads_topic = self.topics.grads(ctx.job_id, incarnation=ctx.incarnation)
        self._params_topic = self.topics.params(ctx.job_id, incarnation=ctx.incarnation)
        self.checkpoints = CheckpointStore(store, ctx.job_id)
        self.saver = SliceSaver(
            self.checkpoints,
            producer=producer,
            control_topic=ctx.planned.control_topic,
            jobs_topic=self.topics.jobs,
            worker_id=settings.worker_id,
            metrics=metrics,
        )
        self.opener = SliceOpener(
            ctx,
            self.coordinator,
            kafka=kafka,
            checkpoints=self.checkpoints,
            saver=self.saver,
            grads_topic=self._grads_topic,
            params_topic=self._params_topic,
            folded=self._folded,
            log_read=self._log_read,
            publish=self._publish,
        )

    @property
    def coordinating(self) -> bool:
        """Whether this process owns partition 0 of the grads topic now."""
        return 0 in self.owners

    async def run(self) -> None:
        plane = self.kafka.for_gradient_plane()  # every step waits on these two readers
        async with (
            TopicTail(plane, self.ctx.planned.control_topic) as control,
            Consumer(
                plane,
                [self._grads_topic],
                group_id=self.topics.aggregator_group(
                    self.ctx.job_id, incarnation=self.ctx.incarnation
                ),
                max_in_flight=self.settings.max_held_slices,
                dead_letter_producer=self.producer,
            ) as grads,
        ):
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self._read_control(control, grads))
                    tasks.create_task(self._read_grads(grads))
                    tasks.create_task(self._engine(control, grads))
                    tasks.create_task(self._watch(control, grads))
            except BaseExceptionGroup as group:
                # One task's failure cancels the others; callers expect that exception.
                raise group.exceptions[0] from None
            finally:
                await self.leader.stop()
                self.owners.clear()
                await self.saver.close()

    # -- readers -----------------------------------------------------------------------------

    async def _read_control(self, control: TopicTail, grads: Consumer) -> None:
        while True:
            rest_s = self._rest.rest_s(time.monotonic()) if self._settled() else 0.0
            if rest_s > 0:  # a step's members are computing (see resting.py)
                control.pause()
                try:
                    await asyncio.sleep(rest_s)
                finally:
                    control.resume()
                self.metrics.control_rest_seconds.inc(rest_s)
                continue  # not a fetch that found nothing: _drained_at stays
            started = time.monotonic()
            records = await control.get_many(_CONTROL_POLL_S)
            read_at = time.monotonic()
            for record in records:
                self._rest.folded(record.message, read_at)
                if isinstance(record.message, ResumePoint):
                    await self._resume(record.message)
                else:
                    self.coordinator.fold(record.message)
            if control.caught_up:
                self._log_read.set()
            if records:
                # The GradSlices a folded Contribution announces are fetched from now on, not
                # once the engine gets round to it: it may be publishing this very step's close
                # first, and the step waits for both.
                grads.rest(not self._grads_wanted(grads))
                self._wake.set()
                self._folded.set()
            else:
                self._drained_at = started

    def _settled(self) -> bool:
        """Nothing waits on this process: no contribution undecided, every owned slice
        applied the latest close, no slice being opened."""
        version = self.coordinator.version
        return (
            not self._early
            and not self.coordinator.undecided()
            and all(owner.version >= version for owner in self.owners.values())
        )

    async def _resume(self, point: ResumePoint) -> None:
        try:
            progress = await asyncio.to_thread(read_progress, self.checkpoints, point.version)
            self.coordinator.resume(point, progress)
        except (CheckpointError, ValueError) as exc:
            raise JobFailure(f"cannot resume from checkpoint v{point.version}: {exc}") from exc

    async def _read_grads(self, grads: Consumer) -> None:
        while True:
            try:
                received = await grads.get()
            except ConsumerStopped:
                return
            except BusError as exc:
                if not exc.retriable:
                    raise
                logger.warning("job %s: reading gradients: %s; retrying", self.ctx.job_id, exc)
                await asyncio.sleep(self.settings.retry_backoff_s)
                continue
            self._on_grad(received, grads)
            self._wake.set()

    def _on_grad(self, received: Received, grads: Consumer) -> None:
        grad = received.message
        if not isinstance(grad, GradSlice) or grad.job_id != self.ctx.job_id:
            logger.warning("job %s: ignoring %s on %s", self.ctx.job_id,
                           type(grad).__name__, received.topic)  # fmt: skip
            grads.ack(received)
            return
        owner = self.owners.get(received.partition)
        if owner is None:  # the slice is being opened
            self._early.setdefault(received.partition, []).append(received)
            return
        self.metrics.grad_bytes.inc(_payload_bytes(grad))
        applied = self.coordinator.applied_version(grad.contribution_id)
        if (applied is not None and applied <= owner.version) or (
            grad.base_version < owner.version - self.coordinator.staleness_bound
        ):
            grads.ack(received)  # its effect is published already, or it can never apply
            return
        try:
            owner.add(grad, received)
        except ValueError as exc:
            logger.error("job %s: dropping a GradSlice: %s", self.ctx.job_id, exc)
            grads.ack(received)

    # -- engine ------------------------------------------------------------------------------

    async def _engine(self, control: TopicTail, grads: Consumer) -> None:
        while True:
            self._engine_doing = "waiting for records"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.tick_s):
                    await self._wake.wait()
            self._wake.clear()
            self._engine_doing = "following the assignment"
            await self._follow_assignment(grads)
            for owner in list(self.owners.values()):
                await self._advance(owner, grads)
            if self._may_lead(control):
                self._engine_doing = "coordinating"
                if await self.leader.decide(control):
                    # A StepClose folded at once: the owners apply it before the reports.
                    for owner in list(self.owners.values()):
                        await self._advance(owner, grads)
                    self._wake.set()  # and look again: the close may have made more due
                self._engine_doing = "reporting"
                await self.leader.report()
            grads.rest(not self._grads_wanted(grads))
            self.metrics.held_slices.set(sum(s.buffered for s in self.owners.values()))

    def _grads_wanted(self, grads: Consumer) -> bool:
        owned = {tp.partition for tp in grads.assignment() if tp.topic == self._grads_topic}
        return grads_wanted(self.coordinator, self.owners, owned=owned, opening=bool(self._early))

    async def _watch(self, control: TopicTail, grads: Consumer) -> None:
        while True:
            await asyncio.sleep(_STALL_WARN_S / 2)
            self._warn_if_stalled(control, grads)

    def _warn_if_stalled(self, control: TopicTail, grads: Consumer) -> None:
        """Log a slice that has not moved for _STALL_WARN_S although its next StepClose is
        folded or the control log has records not read yet: which slices it lacks and how far
        its readers got (a step takes milliseconds)."""
        now = time.monotonic()
        control_at, control_end = control.position(0), control.highwater(0)
        control_behind = None not in (control_at, control_end) and control_end > control_at  # type: ignore[operator]
        for index, owner in self.owners.items():
            version, since = self._unchanged_since.get(index, (-1, now))
            if owner.version != version:
                self._unchanged_since[index] = (owner.version, now)
                continue
            close = self.coordinator.closes.get(version + 1)
            if (close is None and not control_behind) or now - since < _STALL_WARN_S:
                continue
            self._unchanged_since[index] = (version, now)  # again after another period
            position, highwater = grads.offsets(self._grads_topic, index)
            logger.warning(
                "job %s: slice %d at version %d for %.0f s; next StepClose folded: %s, "
                "slices missing: %s; grads partition %d: fetch position %s, high-water %s, "
                "%d records unacked, paused %s, resting %s; control position %s, high-water %s; "
                "engine: %s",
                self.ctx.job_id, index, version, now - since, close is not None,
                owner.missing(close) if close is not None else "-", index, position, highwater,
                grads.in_flight, grads.paused, grads.resting, control_at, control_end,
                self._engine_doing,
            )  # fmt: skip

    def _may_lead(self, control: TopicTail) -> bool:
        """Whether to decide now: this process owns partition 0 and has folded every control
        record that existed when it got it (the previous coordinator's last decisions): a
        fetch begun after that found nothing more."""
        if not self.coordinating:
            self._owned_since = None
            return False
        if self._owned_since is None:
            self._owned_since = time.monotonic()
        return control.caught_up and self._drained_at >= self._owned_since

    async def _follow_assignment(self, grads: Consumer) -> None:
        assigned = {tp.partition for tp in grads.assignment() if tp.topic == self._grads_topic}
        for index in [p for p in self.owners if p not in assigned]:
            logger.info("job %s: slice %d moved to another aggregator", self.ctx.job_id, index)
            del self.owners[index]
        for index in [p for p in self._early if p not in assigned]:
            del self._early[index]
        for index in sorted(assigned - set(self.owners)):
            await self._open_slice(index, grads)

    async def _open_slice(self, index: int, grads: Consumer) -> None:
        owner = await self.opener.open(index)
        self.owners[index] = owner
        logger.info(
            "job %s: serving slice %d from version %d", self.ctx.job_id, index, owner.version
        )
        await self._save_again_if_lost(owner, grads)
        for received in self._early.pop(index, []):
            self._on_grad(received, grads)

    async def _save_again_if_lost(self, owner: SliceOwner[Received], grads: Consumer) -> None:
        """A previous owner that died between applying a checkpointed version and announcing
        its slice left the checkpoint without it: announce the file it wrote, or write it."""
        close = self.coordinator.closes.get(owner.version)
        if close is None or close.checkpoint is None:
            return
        await asyncio.sleep(_CONTROL_POLL_S)  # the announcement may be just behind the close
        if owner.slice_index in self.coordinator.saved.get(owner.version, {}):
            return
        key = slice_key(self.ctx.job_id, owner.version, owner.slice_index)
        if not await self.saver.announce_written(key):
            offset = grads.low_water(self._grads_topic, owner.slice_index) or 0
            state = owner.snapshot(offset)
            if owner.slice_index == 0:
                state.progress = self.coordinator.progress_at.get(owner.version)
            await self.saver.start(state)

    async def _advance(self, owner: SliceOwner[Received], grads: Consumer) -> None:
        """Apply every StepClose the owner can apply now, in version order."""
        while self.owners.get(owner.slice_index) is owner:
            close = self.coordinator.closes.get(owner.version + 1)
            if close is None or owner.missing(close):
                return
            started = time.monotonic()
            # Before this step's records are acknowledged: a lower bound of what later
            # versions may need from the grads partition (a checkpoint records it).
            offset = 0
            if close.checkpoint is not None:
                offset = grads.low_water(self._grads_topic, owner.slice_index) or 0
            slices, records = owner.take(close)
            # One contribution's trace goes on through the aggregation; the others are links.
            parent, links = fan_in(producer_context(received.context) for received in records)
            with self._tracer.start_as_current_span(
                "aggregate",
                context=parent,
                links=links,
                attributes={
                    "conveyor.job_id": self.ctx.job_id,
                    "conveyor.slice": owner.slice_index,
                    "conveyor.version": close.version,
                    "conveyor.num_samples": close.num_samples,
                    "conveyor.contributions": len(close.contributions),
                },
            ):
                self._engine_doing = (
                    f"applying version {close.version} to slice {owner.slice_index}"
                )
                values, saved = await asyncio.to_thread(_step, owner, close, slices, offset)
                self._engine_doing = f"publishing ParamSlice {owner.slice_index} v{close.version}"
                await self._publish(owner.slice_index, close.version, values)
            if saved is not None:
                if owner.slice_index == 0:
                    saved.progress = self.coordinator.progress_at.get(close.version)
                # After the ParamSlice: a committed checkpoint never runs ahead of the log.
                await self.saver.start(saved)
            for received in records:
                grads.ack(received)
            for received in owner.drop_dead(self.coordinator.staleness_bound):
                grads.ack(received)
            self.metrics.steps.inc()
            self.metrics.step_seconds.observe(time.monotonic() - started)

    async def _publish(self, index: int, version: int, values: torch.Tensor) -> None:
        message = ParamSlice(
            job_id=self.ctx.job_id,
            slice_index=index,
            version=version,
            values=values,
            published_at=time.time(),
        )
        await self.producer.publish(self._params_topic, message, key=str(index), partition=index)


def _step(
    owner: SliceOwner[Received], close: StepClose, slices: list[GradSlice], grads_offset: int
) -> tuple[torch.Tensor, SliceState | None]:
    """Apply ``close``; the new values, and the slice's state when the close asks for a
    checkpoint (copied here, before any later step can change it)."""
    try:
        owner.step(close, slices)
    except CompressionError as exc:
        raise JobFailure(f"version {close.version}, slice {owner.slice_index}: {exc}") from exc
    saved = owner.snapshot(grads_offset) if close.checkpoint is not None else None
    return owner.values.clone(), saved


def _payload_bytes(grad: GradSlice) -> int:
    return sum(t.numel() * t.element_size() for t in (grad.values, grad.indices))
