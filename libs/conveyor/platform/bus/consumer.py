"""Consumer: a group member that decodes, bounds in-flight work and commits only what is done.

Delivery is at-least-once. A record counts as done when the application calls
:meth:`Consumer.ack`; per partition, the bus commits one past the last record of the
contiguous acknowledged prefix, so a crash (or a rebalance) redelivers every record that was
not acknowledged, and possibly a few that were (consumers are idempotent by message id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from functools import partial

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import ConsumerStoppedError, KafkaError

from conveyor.platform.bus.dead_letters import DeadLetters
from conveyor.platform.bus.delivery import Delivery
from conveyor.platform.bus.errors import BusError, BusUnavailable, ConsumerStopped, from_kafka_error
from conveyor.platform.bus.group import RebalanceListener, fetch_position, stop_and_leave
from conveyor.platform.bus.handlers import Handler, run_handlers
from conveyor.platform.bus.holes import HOLE_RETRY_S, HoleGuard
from conveyor.platform.bus.metrics import register_lag_source, topic_kind, unregister_lag_source
from conveyor.platform.bus.offsets import InFlight
from conveyor.platform.bus.options import consumer_options
from conveyor.platform.bus.producer import Producer
from conveyor.platform.bus.received import Received
from conveyor.platform.bus.topic_wait import start_when_listed
from conveyor.platform.codec import CodecLimits
from conveyor.platform.config import KafkaSettings
from conveyor.platform.lifecycle import AsyncLifecycle

logger = logging.getLogger(__name__)

_COMMIT_TIMEOUT_S = 5.0
"""Longest wait for one commit (a healthy one takes milliseconds), see :meth:`Consumer._commit`."""


class Consumer(AsyncLifecycle):
    """A consumer-group member reading ``topics``; ``async with`` starts and stops it.

    * :meth:`get` (or ``async for``) returns the next decoded record as :class:`Received`;
      only one task may call it at a time. :meth:`ack` marks a record done.
    * Backpressure: once ``max_in_flight`` delivered records are unacknowledged, :meth:`get`
      waits and every assigned partition is paused; they resume when an ack frees a slot.
    * :meth:`rest`: a caller that knows no record it needs can be there yet stops the fetches
      (each empty one at a short fetch wait costs CPU here and in the broker) until it asks
      again; a new assignment fetches again by itself.
    * Commits (the contiguous acked prefix per partition) happen every ``commit_interval_s``
      inside :meth:`get`, on :meth:`commit`, when partitions are revoked and on :meth:`stop`.
    * On revocation the revoked partitions' in-flight state is dropped: acks of records
      delivered before it are ignored, the partition's next owner gets them again. With
      ``revoke_grace_s`` the revocation first waits (that long at most) for those records'
      acks, so that they commit instead of being done twice.
    * An undecodable record (:class:`CodecError`, or no value) is published as a
      :class:`DeadLetter` to ``Topics(prefix).dlq``, counted, acked and skipped.
    * Lag (high-water mark - position per assigned partition) is :meth:`lag`, and the gauge
      ``conveyor_bus_consumer_lag_records``.
    * Order: offset order within a partition. Across partitions, the client's fetch order
      (it drains one partition's fetched records before the next's), or with
      ``oldest_first`` the oldest record first: before each delivery the consumer takes the
      next record of every assigned partition the client holds one of, and delivers the one
      with the smallest timestamp. For work queues whose producer's order matters across
      partitions, as Kafka Streams picks the partition with the oldest head record.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        topics: Sequence[str],
        *,
        group_id: str,
        max_in_flight: int = 64,
        limits: CodecLimits | None = None,
        commit_interval_s: float = 1.0,
        poll_timeout_s: float = 0.5,
        drain_timeout_s: float = 30.0,
        revoke_grace_s: float = 0.0,
        oldest_first: bool = False,
        dead_letter_producer: Producer | None = None,
    ) -> None:
        """``dead_letter_producer``: a started producer to reuse for dead letters; by default
        the consumer starts its own. ``drain_timeout_s``: how long :meth:`stop` waits for the
        handlers of a running :meth:`run`. ``poll_timeout_s``: longest wait of one fetch, which
        bounds how late :meth:`stop` is noticed by a waiting :meth:`get`.

        ``revoke_grace_s``: how long a revocation waits for the revoked partitions' delivered
        records to be acked (0: no wait). The group's rebalance waits meanwhile: use it only
        where handling finishes without the group (e.g. :meth:`run`'s CPU-bound handlers),
        never where an ack waits for another member (which waits for the rebalance).

        ``oldest_first``: deliver across partitions oldest record first (see the class
        docstring); up to one record per assigned partition is then held beyond
        ``max_in_flight``."""
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        if not group_id:
            raise ValueError("group_id must not be empty")
        for name, value in [
            ("commit_interval_s", commit_interval_s),
            ("poll_timeout_s", poll_timeout_s),
            ("drain_timeout_s", drain_timeout_s),
        ]:
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if revoke_grace_s < 0:
            raise ValueError(f"revoke_grace_s must be >= 0, got {revoke_grace_s}")
        self._revoke_grace_s = revoke_grace_s
        self._settings = settings
        self._topics = list(topics)
        self._group_id = group_id
        self._commit_interval_s = commit_interval_s
        self._poll_timeout_ms = int(poll_timeout_s * 1000)
        self._drain_timeout_s = drain_timeout_s
        self._dead_letters = DeadLetters(settings, dead_letter_producer)

        self._consumer: AIOKafkaConsumer | None = None
        self._closing = False
        self._in_flight = InFlight(max_in_flight, oldest_first=oldest_first)
        self._delivery = Delivery(
            self._in_flight,
            self._dead_letters,
            limits=limits or CodecLimits(max_message_bytes=settings.max_message_bytes),
            topic_prefix=settings.topic_prefix,
        )
        self._holes = HoleGuard()
        self._paused = False
        self._resting = False
        self._capacity = asyncio.Event()
        self._acked = asyncio.Event()
        """Replaced (the old one set) on every ack: what a revocation's grace waits on."""
        self._joined = asyncio.Event()
        self._settled = asyncio.Event()
        """Set while this member holds an assignment: cleared when a rebalance revokes it, set
        again with the next one."""
        self._get_lock = asyncio.Lock()
        self._next_commit_at = 0.0
        self._runs_idle = asyncio.Event()
        self._runs_idle.set()
        self._active_runs = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and join the group (asynchronously: the assignment arrives in the
        background). Raises :class:`BusError` on failure."""
        if self._consumer is not None:
            return
        if self._closing:
            raise ConsumerStopped("a stopped Consumer cannot be restarted; create a new one")
        await self._dead_letters.start()
        options = consumer_options(self._settings, self._group_id)
        consumer: AIOKafkaConsumer | None = None
        try:
            # Joined without its topics listed, a member would be assigned nothing.
            consumer = await start_when_listed(
                lambda: AIOKafkaConsumer(**options),
                self._topics,
                timeout_s=self._settings.topic_wait_s,
            )
            consumer.subscribe(self._topics, listener=RebalanceListener(self))
        except BaseException as exc:
            if consumer is not None:
                await consumer.stop()
            await self._dead_letters.stop()
            if isinstance(exc, KafkaError):
                raise from_kafka_error(exc, f"joining group {self._group_id}") from exc
            raise
        self._consumer = consumer
        self._next_commit_at = time.monotonic() + self._commit_interval_s
        register_lag_source(self, {self._kind(t) for t in self._topics})

    async def stop(self) -> None:
        """Drain, commit what is acked and leave the group. Safe to call twice.

        A running :meth:`run` stops taking records and its handlers get ``drain_timeout_s``
        to finish (their acks are committed). Records delivered but not acked by then are
        redelivered to the group. Do not await this from inside a handler.
        """
        if self._closing:
            return
        self._closing = True
        self._capacity.set()
        try:
            async with asyncio.timeout(self._drain_timeout_s):
                await self._runs_idle.wait()
        except TimeoutError:
            logger.warning(
                "group %s: handlers still running after %.1fs; their records will be redelivered",
                self._group_id,
                self._drain_timeout_s,
            )
        consumer, self._consumer = self._consumer, None
        unregister_lag_source(self)
        try:
            if consumer is not None:
                try:
                    await self._commit(consumer, list(self._in_flight.partitions))
                except BusError as exc:
                    logger.warning("group %s: final commit failed: %s", self._group_id, exc)
                await stop_and_leave(consumer, self._group_id)
        finally:
            self._in_flight.clear()
            await self._dead_letters.stop()

    # -- state -----------------------------------------------------------------------------

    @property
    def group_id(self) -> str:
        return self._group_id

    @property
    def in_flight(self) -> int:
        """Delivered records not acknowledged yet (in the current assignment)."""
        return self._in_flight.unacked

    @property
    def paused(self) -> bool:
        """True while fetching is paused for backpressure."""
        return self._paused

    @property
    def resting(self) -> bool:
        """True while fetching is stopped by :meth:`rest`."""
        return self._resting

    def rest(self, resting: bool) -> None:
        """Stop fetching (``True``) until ``rest(False)`` or the next assignment, or fetch again.

        For a caller that knows when the records it needs can appear (they are announced
        elsewhere): nothing is lost, records already fetched are still delivered, and what a
        pending fetch brings back meanwhile is fetched again afterwards. Independent of the
        backpressure pause: fetching runs only when neither holds it.
        """
        if resting == self._resting:
            return
        self._resting = resting
        self._apply_pause()

    async def joined(self) -> None:
        """Until this member received its first assignment (possibly empty: the group joined).
        Before it nothing can be delivered; the join completes in the background after
        :meth:`start`."""
        await self._joined.wait()

    @property
    def rebalancing(self) -> bool:
        """Joined once, and a rebalance took the assignment away and has not given the next
        one yet: nothing can be delivered meanwhile (the group's members all wait for it)."""
        return self._joined.is_set() and not self._settled.is_set()

    async def settled(self) -> None:
        """Until this member holds an assignment (at once when it does; the first one is
        :meth:`joined`)."""
        await self._settled.wait()

    def assignment(self) -> frozenset[TopicPartition]:
        """Partitions currently assigned to this member (empty before the first join)."""
        return frozenset(self._in_flight.partitions)

    def offsets(self, topic: str, partition: int) -> tuple[int | None, int | None]:
        """(fetch position, high-water mark) of an assigned partition as last known, for
        diagnostics; None where not known yet."""
        consumer = self._consumer
        if consumer is None:
            return None, None
        tp = TopicPartition(topic, partition)
        return fetch_position(consumer, tp), consumer.highwater(tp)

    def low_water(self, topic: str, partition: int) -> int | None:
        """The lowest offset of an assigned partition whose record this member has not
        acknowledged (delivered and unacked, fetched and waiting, or not fetched yet): every
        record below it was acknowledged, by this member or by the one it took the partition
        from. None when the partition is not assigned or its position is not known yet."""
        offsets = self._in_flight.partitions.get((topic, partition))
        if offsets is None:
            return None
        candidates = [offsets.lowest_unacked, self._in_flight.positions().get((topic, partition))]
        if offsets.next_offset is None and self._consumer is not None:
            candidates.append(fetch_position(self._consumer, TopicPartition(topic, partition)))
        known = [c for c in candidates if c is not None]
        return min(known) if known else None

    def lag(self, topic_kind: str | None = None) -> int:
        """Records not yet delivered to the application, summed over assigned partitions
        (high-water mark - position; partitions not fetched yet count 0). ``topic_kind``
        restricts the sum to one kind of topic (``batches``, ``shards``, ...)."""
        consumer = self._consumer
        if consumer is None:
            return 0
        assigned = consumer.assignment()
        total = 0
        for tp, position in self._in_flight.positions().items():
            if tp not in assigned or (topic_kind is not None and self._kind(tp[0]) != topic_kind):
                continue
            highwater = consumer.highwater(tp)
            if position is None:
                position = fetch_position(consumer, tp)
            if highwater is not None and position is not None:
                total += max(0, highwater - position)
        return total

    def _kind(self, topic: str) -> str:
        return topic_kind(topic, self._settings.topic_prefix)

    # -- consuming -------------------------------------------------------------------------

    async def get(self) -> Received:
        """The next record. Waits while none is available or ``max_in_flight`` are unacked.

        Raises :class:`ConsumerStopped` once the consumer is stopped, :class:`BusError`
        (:class:`BusUnavailable` when retriable) on broker errors. Cancelling it loses nothing.
        """
        async with self._get_lock:
            while True:
                consumer = self._running_consumer()
                if self._in_flight.oldest_first and not self._in_flight.full:
                    await self._fetch_heads(consumer)
                if (fetched := self._in_flight.next_fetched()) is not None:
                    received = await self._delivery.accept(*fetched)
                    if received is not None:
                        return received
                elif self._in_flight.full:
                    await self._wait_for_capacity(consumer)
                else:
                    if time.monotonic() >= self._next_commit_at:
                        await self._periodic_commit(consumer)
                    await self._fetch(consumer, self._poll_timeout_ms)

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Received:
        try:
            return await self.get()
        except ConsumerStopped:
            raise StopAsyncIteration from None

    def ack(self, received: Received) -> None:
        """Mark ``received`` processed: it may be committed once every earlier record of its
        partition is acked too. Acking twice, or after its partition was revoked, does nothing."""
        tp = (received.topic, received.partition)
        if not self._in_flight.ack(tp, received._offsets, received.offset):
            return
        acked, self._acked = self._acked, asyncio.Event()
        acked.set()
        if not self._in_flight.full:
            self._capacity.set()
            if self._paused:
                self._resume()

    async def commit(self) -> None:
        """Commit the acked prefix of every assigned partition now (no-op if nothing moved).

        Raises :class:`BusError` when the broker refuses, e.g. because the group rebalanced
        (the records are then redelivered, which idempotent handlers absorb).
        """
        await self._commit(self._running_consumer(), list(self._in_flight.partitions))

    async def run(self, handler: Handler, *, concurrency: int = 1) -> None:
        """Call ``handler`` for every record, up to ``concurrency`` at a time, and ack each
        record after its handler returned. Returns when the consumer is stopped (after the
        running handlers finished, see :meth:`stop`).

        Retriable broker errors are logged and retried with exponential backoff. A handler
        exception is logged with its traceback and re-raised out of ``run`` (the other
        handlers are cancelled): the process is expected to crash so that its supervisor
        restarts it. The failed record is not acked, so the group redelivers it. Cancelling
        ``run`` cancels the running handlers; their records are not acked either.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._active_runs += 1
        self._runs_idle.clear()
        try:
            await run_handlers(self, handler, concurrency)
        finally:
            self._active_runs -= 1
            if self._active_runs == 0:
                self._runs_idle.set()

    # -- internals -------------------------------------------------------------------------

    def _running_consumer(self) -> AIOKafkaConsumer:
        if self._closing:
            raise ConsumerStopped(f"consumer of group {self._group_id} is stopped")
        if self._consumer is None:
            raise BusError("Consumer is not started; use `async with Consumer(...)`")
        return self._consumer

    async def _fetch(
        self,
        consumer: AIOKafkaConsumer,
        timeout_ms: int,
        partitions: Sequence[TopicPartition] = (),
        max_records: int | None = None,
    ) -> None:
        """Fetch up to ``max_records`` (default: the in-flight budget) of ``partitions``
        (default: all assigned) into the in-flight bookkeeping."""
        # A (re)assigned partition's position is where its first record must be.
        self._holes.expect_positions(consumer.assignment(), partial(fetch_position, consumer))
        try:
            batches = await consumer.getmany(
                *partitions,
                timeout_ms=timeout_ms,
                max_records=max_records or self._in_flight.fetch_budget(),
            )
        except ConsumerStoppedError:
            raise ConsumerStopped(f"consumer of group {self._group_id} stopped") from None
        except KafkaError as exc:
            raise from_kafka_error(exc, f"fetching for group {self._group_id}") from exc
        admitted, holes = self._holes.admit_fetched(batches, time.monotonic(), consumer.seek)
        for records in admitted.values():
            self._in_flight.add_fetched(records)
        if holes:
            await asyncio.sleep(HOLE_RETRY_S)

    async def _fetch_heads(self, consumer: AIOKafkaConsumer) -> None:
        """For ``oldest_first``: take one record of each assigned partition that has none
        fetched here, from what the client holds already (no wait)."""
        held = self._in_flight.partitions_fetched()
        for tp in consumer.assignment():
            if tp not in held:
                await self._fetch(consumer, 0, (tp,), max_records=1)

    async def _wait_for_capacity(self, consumer: AIOKafkaConsumer) -> None:
        self._pause()
        while self._in_flight.full and not self._closing:
            self._capacity.clear()
            try:
                async with asyncio.timeout(self._keepalive_s()):
                    await self._capacity.wait()
            except TimeoutError:
                # aiokafka leaves the group when getmany is not called for
                # max_poll_interval; polling paused partitions keeps membership and returns
                # nothing (records fetched before the pause stay buffered, under the bound).
                await self._fetch(consumer, 0)
            if time.monotonic() >= self._next_commit_at:
                await self._periodic_commit(consumer)

    def _keepalive_s(self) -> float:
        return min(self._settings.max_poll_interval_s / 3, 30.0)

    def _pause(self) -> None:
        self._paused = True
        self._apply_pause()

    def _resume(self) -> None:
        self._paused = False
        self._apply_pause()

    def _apply_pause(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        if self._paused or self._resting:
            consumer.pause(*consumer.assignment())
        else:
            consumer.resume(*consumer.assignment())

    async def _periodic_commit(self, consumer: AIOKafkaConsumer) -> None:
        self._next_commit_at = time.monotonic() + self._commit_interval_s
        try:
            await self._commit(consumer, list(self._in_flight.partitions))
        except BusError as exc:
            # Expected around rebalances; the records are redelivered and deduplicated.
            logger.warning("group %s: periodic commit failed: %s", self._group_id, exc)

    async def _commit(self, consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition]) -> None:
        offsets = self._in_flight.offsets_to_commit(tps)
        if not offsets:
            return
        try:
            # aiokafka retries a retriable commit error without end: a job's topics deleted
            # under its readers answer UnknownTopicOrPartition forever, which would hold a
            # stop, or a rebalance (revocation commits) and every stop after it, for good.
            async with asyncio.timeout(_COMMIT_TIMEOUT_S):
                await consumer.commit(offsets)
        except KafkaError as exc:
            raise from_kafka_error(exc, f"commit of group {self._group_id}") from exc
        except TimeoutError as exc:
            raise BusUnavailable(
                f"commit of group {self._group_id} took over {_COMMIT_TIMEOUT_S}s"
            ) from exc
        self._in_flight.committed(offsets)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._settled.clear()
        if self._revoke_grace_s > 0:
            self._in_flight.drop_fetched(revoked)  # no new record of them starts meanwhile
            await self._await_acks(revoked)
        consumer = self._consumer
        if consumer is not None:
            try:
                await self._commit(consumer, list(revoked))
            except BusError as exc:
                logger.warning("group %s: commit on revoke failed: %s", self._group_id, exc)
        self._in_flight.revoke(revoked)
        for tp in revoked:
            self._holes.forget(tp)
        self._capacity.set()

    async def _await_acks(self, revoked: set[TopicPartition]) -> None:
        """Wait, at most ``revoke_grace_s``, until no record of ``revoked`` is unacked."""
        if not self._in_flight.unacked_in(revoked):
            return
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._revoke_grace_s):
                while self._in_flight.unacked_in(revoked):
                    await self._acked.wait()
        except TimeoutError:
            logger.warning(
                "group %s: %d record(s) still unacked after %.0fs of revocation; the "
                "partitions' next owner gets them again", self._group_id,
                self._in_flight.unacked_in(revoked), self._revoke_grace_s,
            )  # fmt: skip
            return
        logger.info(
            "group %s: finished the revoked partitions' records in %.2fs",
            self._group_id, time.monotonic() - started,
        )  # fmt: skip

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._in_flight.assign(assigned)
        self._joined.set()
        self._settled.set()
        for tp in assigned:
            self._holes.forget(tp)
        # A new assignment starts unpaused; keep the bound if handlers still hold records.
        # Resting ends: what the new partitions hold is not announced to the caller.
        self._resting = False
        if self._in_flight.full:
            self._pause()
        else:
            self._paused = False
        logger.info("group %s: assigned %s", self._group_id, sorted(assigned))
