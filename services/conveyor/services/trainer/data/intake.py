"""A job's batches into one trainer: the consumer group, prefetch to the device, and where each
delivered batch stands.

:meth:`BatchIntake.open` joins the job's consumer group on the batches topic and builds the
:class:`Prefetcher` over it (its ``run()`` is the caller's task). :meth:`BatchIntake.receive`
takes the next ready batch and places it in the :class:`BatchBook` against the control fold: a
batch done already (or outside the job) is acknowledged and dropped, a copy of one in memory
keeps only its delivery, the rest is queued or held; every record is acknowledged once the
control log shows its batch's effect (:meth:`BatchIntake.done`). A partition that moved to
another trainer takes its waiting batches with it: they are dropped here, unacknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any

from conveyor.platform.bus import Consumer, Producer, Received
from conveyor.platform.config import KafkaSettings
from conveyor.services.trainer.compute.session import JobSession
from conveyor.services.trainer.data.batches import AckBook, BatchBook, Disposition
from conveyor.services.trainer.data.order import PlanOrder
from conveyor.services.trainer.data.prefetch import DeviceCopier, Prefetcher, ReadyBatch
from conveyor.services.trainer.plane.control import ControlState
from conveyor.services.trainer.reporting.figures import TrainerFigures

logger = logging.getLogger(__name__)

_GIVE_UP_POLL_S = 0.02
"""How often :meth:`BatchIntake.receive_unless` asks whether to stop waiting."""

STARVED_WARN_S = 30.0
"""A trainer that has received no batch for this long while its epoch still has batches to
train logs where it stands (again after each further period)."""


class BatchIntake:
    """The batches of one job delivered to one trainer (see the module docstring)."""

    def __init__(
        self,
        session: JobSession,
        control: ControlState,
        figures: TrainerFigures,
        *,
        kafka: KafkaSettings,
        producer: Producer,
        prefetch_batches: int,
        copy_executor: Executor,
    ) -> None:
        self._session = session
        self._kafka = kafka
        self._producer = producer
        self._control = control
        self._figures = figures
        self._prefetch_batches = prefetch_batches
        self._copy_executor = copy_executor
        spec = session.spec
        order = (
            PlanOrder(
                job_id=session.job_id,
                batches_per_shard=spec.shard_size // spec.training.micro_batch_size,
                train_batches=session.plan.train_batches_per_epoch,
            )
            if spec.distribution.deterministic
            else None
        )
        self.book: BatchBook[ReadyBatch] = BatchBook(epochs=spec.training.epochs, order=order)
        """Where each batch in memory stands: queued to train (in plan order when the job is
        deterministic) or evaluate, or held."""
        self.acks: AckBook[Received] = AckBook(self._ack)
        """The deliveries of the batches in memory, acknowledged when the log shows them done."""
        self._consumer: Consumer | None = None
        self._prefetch: Prefetcher | None = None
        self._assigned: frozenset[tuple[str, int]] = frozenset()
        self._waited_once = False
        self._join_awaited = False
        self._starved_since: float | None = None
        """Monotonic time of the first empty receive since the last batch (None: fed)."""
        self._starved_warned_at = 0.0

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Prefetcher]:
        """Join the job's consumer group; yields the prefetcher to run. Call :meth:`let_go`
        before leaving (the consumer leaves the group on exit, committing what was
        acknowledged)."""
        session = self._session
        group = session.topics.trainer_group(session.job_id, incarnation=session.incarnation)
        async with Consumer(
            self._kafka,
            [session.plan.batches_topic],
            group_id=group,
            max_in_flight=session.max_in_flight,
            dead_letter_producer=self._producer,
        ) as consumer:
            prefetch = Prefetcher(
                consumer,
                DeviceCopier(session.device),
                job_id=session.job_id,
                depth=self._prefetch_batches,
                consumer_group=group,
                reject=self.reject,
                executor=self._copy_executor,
            )
            self.attach(consumer, prefetch)
            yield prefetch

    def attach(self, consumer: Consumer, prefetch: Prefetcher) -> None:
        """Take batches from ``prefetch`` and acknowledge them on ``consumer``."""
        self._consumer = consumer
        self._prefetch = prefetch

    async def joined(self) -> None:
        """Wait until the consumer joined the job's group (its first assignment, possibly
        empty), at most the group's session timeout (a join takes less on any broker).

        A fresh job's trainers wait for it before their first step (and :meth:`receive` does
        if they did not): until then no batch can arrive, and each step would be an empty
        contribution, a version without samples that still counts toward ``max_steps``,
        ``checkpoint.every_steps``, local mode's inner learning-rate schedule and the job's
        samples/s (the embedded broker completes a join after half the session timeout: ~20
        empty versions of the digits demo). A trainer that joins a job past version 0
        contributes empty steps meanwhile, as the others are training."""
        consumer = self._consumer
        assert consumer is not None, "open() first"
        self._join_awaited = True  # once: a join that timed out is not waited for again
        await self._within_session(consumer.joined(), "not in the batches group")

    async def _rebalanced(self) -> bool:
        """Wait out a rebalance of the batches group, at most its session timeout; whether
        there was one. During it no member can receive a batch, so a trainer that gave up on
        its step instead would send an empty contribution every ``empty_contribution_wait_s``,
        each a version without samples (the embedded broker takes ~5 s to rebalance: ~20 of
        them whenever a trainer joined or left a running job)."""
        consumer = self._consumer
        if consumer is None or not consumer.rebalancing:
            return False
        started = time.perf_counter()
        await self._within_session(consumer.settled(), "the batches group still rebalancing")
        logger.info(
            "job %s: waited %.2f s for the batches group to rebalance",
            self._session.job_id, time.perf_counter() - started,
        )  # fmt: skip
        return True

    async def _within_session(self, wait: Coroutine[Any, Any, None], what: str) -> None:
        """Await ``wait`` at most the group's session timeout (a join or a rebalance takes less
        on any broker); past it, log ``what`` and go on."""
        try:
            async with asyncio.timeout(self._kafka.session_timeout_s):
                await wait
        except TimeoutError:
            logger.warning(
                "job %s: %s after %.0f s; stepping anyway",
                self._session.job_id, what, self._kafka.session_timeout_s,
            )  # fmt: skip

    def let_go(self) -> None:
        """Stop using the consumer (it is about to leave): nothing more is acknowledged and no
        partition counts as owned."""
        self._consumer = None

    async def receive(
        self, timeout_s: float | None, *, count_wait: bool = True
    ) -> tuple[bool, float]:
        """Take one delivered batch and place it; (False, waited) when none came in time. In a
        fresh job (version 0) it first waits until this trainer joined the batches group
        (:meth:`joined`); when none came and the group is rebalancing, it waits for the
        rebalance (:meth:`_rebalanced`) and then ``timeout_s`` again (not when ``timeout_s``
        is 0: a caller that waits for nothing). Neither wait counts as waiting for data."""
        prefetch = self._prefetch
        assert prefetch is not None
        if self._control.version == 0 and not self._join_awaited:
            await self.joined()
        item, waited = await prefetch.get(timeout_s)
        if item is None and timeout_s != 0 and await self._rebalanced():
            item, more = await prefetch.get(timeout_s)
            waited += more
        if count_wait and self._waited_once:  # the wait for the very first batch is start-up
            self._figures.data_waited(waited)
        self._waited_once = True
        if item is None:
            self._note_starving(time.monotonic())
            return False, waited
        self._starved_since = None
        self._admit(item)
        self._figures.batches_waiting(held=self.book.held, ready=prefetch.qsize())
        return True, waited

    async def receive_unless(
        self, timeout_s: float, given_up: Callable[[], bool]
    ) -> tuple[bool, float]:
        """:meth:`receive`, looking every :data:`_GIVE_UP_POLL_S` whether ``given_up()`` says
        to stop waiting (then (False, waited) before ``timeout_s``)."""
        waited_s = 0.0
        while True:
            received, waited = await self.receive(min(_GIVE_UP_POLL_S, timeout_s - waited_s))
            waited_s += waited
            if received or waited_s >= timeout_s or given_up():
                return received, waited_s

    def done(self, batch_ids: Sequence[str]) -> None:
        """The log shows these batches' effect: acknowledge their deliveries, forget them."""
        self.acks.done(batch_ids)
        self.book.finish(batch_ids)

    def drop_revoked(self) -> None:
        """Drop the waiting batches of partitions this trainer no longer owns: their new owner
        gets them again (were they trained here too, one of the two would be rejected)."""
        consumer = self._consumer
        if consumer is None:
            return
        assigned = consumer.assignment()
        if assigned == self._assigned:
            return
        self._assigned = assigned
        dropped = self.book.forget_if(
            lambda item: (item.received.topic, item.received.partition) not in assigned
        )
        self.acks.discard(item.batch_id for item in dropped)
        self._figures.batches_dropped(dropped, "revoked")

    def reject(self, received: Received, reason: str) -> None:
        """Skip a record that is not a batch of the job (acknowledged: it never will be one)."""
        logger.warning(
            "job %s: skipping record %s[%d]@%d: %s",
            self._session.job_id, received.topic, received.partition, received.offset, reason,
        )  # fmt: skip
        self._figures.record_skipped()
        self._ack(received)

    def queues(self) -> dict[str, int]:
        """Batches prefetched, queued to train, held, and delivered but unacknowledged."""
        prefetch, consumer = self._prefetch, self._consumer
        return {
            "ready_batches": prefetch.qsize() if prefetch is not None else 0,
            "queued_batches": self.book.queued_train,
            "held_batches": self.book.held,
            "in_flight": consumer.in_flight if consumer is not None else 0,
        }

    def partitions(self) -> list[int]:
        """The batches topic's partitions this trainer owns now, in order."""
        consumer = self._consumer
        owned = consumer.assignment() if consumer is not None else frozenset()
        topic = self._session.plan.batches_topic
        return sorted(tp.partition for tp in owned if tp.topic == topic)

    def _note_starving(self, now: float) -> None:
        """Log, once per :data:`STARVED_WARN_S` without a batch while the current epoch has
        train batches left, what this trainer has and where its reads of the batches topic
        stand: a read position at the high-water mark means nothing more was written (look at
        the preprocessors and the sharder), one below it a reader that does not get what is
        there."""
        if self._starved_since is None:
            self._starved_since = self._starved_warned_at = now
            return
        if now - self._starved_warned_at < STARVED_WARN_S:
            return
        self._starved_warned_at = now
        control, consumer = self._control, self._consumer
        epoch = control.current_epoch
        if control.train_done or consumer is None:
            return
        topic = self._session.plan.batches_topic
        reads = {p: consumer.offsets(topic, p) for p in self.partitions()}
        logger.warning(
            "job %s: no batch for %.0f s at version %d; epoch %d has %d of %d train batches "
            "left to apply; here: %s; batches partition -> (read position, high-water): %s",
            self._session.job_id, now - self._starved_since, control.version, epoch,
            control.train_left(epoch), self._session.plan.train_batches_per_epoch,
            self.queues(), reads,
        )  # fmt: skip

    def _admit(self, item: ReadyBatch) -> None:
        self.drop_revoked()
        if (item.received.topic, item.received.partition) not in self._assigned:
            # Fetched before its partition moved (it sat in the prefetch queue): the new owner
            # has it; an ack of it would be ignored anyway.
            self._figures.batches_dropped([item], "revoked")
            return
        disposition = self.book.admit(item, self._control)
        if disposition in (Disposition.DONE, Disposition.INVALID):
            self._ack(item.received)
        else:
            self.acks.add(item.batch_id, item.received)
        if disposition in (Disposition.DONE, Disposition.COPY):
            self._figures.duplicate_dropped()
        if disposition is Disposition.INVALID:
            logger.warning(
                "job %s: dropping batch %s of epoch %d (outside the job)",
                self._session.job_id, item.batch_id, item.epoch,
            )  # fmt: skip
        if disposition in (Disposition.DONE, Disposition.COPY, Disposition.INVALID):
            self._figures.batches_dropped([item], disposition.value)

    def _ack(self, received: Received) -> None:
        consumer = self._consumer
        if consumer is not None:
            consumer.ack(received)
