"""What a trainer puts on the gradient plane: GradSlices, Contributions, EvalResults.

A contribution's slices go out pipelined (one ``Producer.send`` per slice, partition = slice
index, then every ack awaited), possibly while the backward pass still computes the others
(:mod:`~conveyor.services.trainer.plane.streaming`); only then is its Contribution published on
the control topic, so a Contribution on the log promises that every slice of it is on the grads
topic. The ``grad send`` span covers both; it continues the trace of one of the contribution's
batches (the first sampled one) and links to the process spans of the others (a fan-in of
several traces, :func:`~conveyor.platform.bus.tracing.fan_in`).

A Contribution says what its gradient was computed on: one :class:`Computed` per forward and
backward pass the step ran, whose batch's sample ids go into ``sample_ids`` in that order (the
coordinator's sample ledger counts them); ``batch_ids`` names each batch once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

from conveyor.platform.bus import Producer
from conveyor.platform.bus.tracing import fan_in
from conveyor.platform.messages import Contribution, EvalResult, GradSlice, sample_ids_tensor
from conveyor.services.trainer.compute.engine import MicroResult
from conveyor.services.trainer.compute.session import JobSession
from conveyor.services.trainer.data.prefetch import ReadyBatch
from conveyor.services.trainer.plane.gradients import EncodedGrad
from conveyor.services.trainer.plane.outstanding import Pending
from conveyor.services.trainer.plane.streaming import SliceReady, SliceStream
from conveyor.training.compression import EncodedSlice


@dataclass(frozen=True, slots=True)
class Computed:
    """One forward/backward pass a step ran: the micro-batch and what it gave."""

    batch: ReadyBatch
    result: MicroResult


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStamps:
    """When a step's parameters and gradient were ready (Unix seconds), carried in its
    Contribution to time the plane's hops (``Contribution`` v4). The parameters' stamps are
    None when the loaded version did not come from the params topic."""

    params_published_at: float | None
    params_received_at: float | None
    started_at: float
    computed_at: float


class Outgoing:
    """One contribution on its way out: GradSlices sent one by one (partition = slice index,
    acks awaited at the end), then the Contribution. Its ``grad send`` span runs from
    :class:`Outgoing`'s creation to the Contribution published (or the failure); it continues
    the trace of one of the contribution's batches (the first sampled one) and links to the
    others. Made by :meth:`ContributionSender.start`."""

    def __init__(
        self,
        producer: Producer,
        session: JobSession,
        tracer: Tracer,
        *,
        contribution_id: str,
        worker_id: str,
        base_version: int,
        batches: list[ReadyBatch],
    ) -> None:
        self._producer = producer
        self._session = session
        self.contribution_id = contribution_id
        self._worker_id = worker_id
        self._base_version = base_version
        self._batches = list({b.batch_id: b for b in batches}.values())  # each once
        parent, links = fan_in(batch.span.get_span_context() for batch in self._batches)
        self._span = tracer.start_span(
            "grad send",
            context=parent,
            links=links,
            attributes={
                "conveyor.contribution_id": contribution_id,
                "conveyor.base_version": base_version,
                "conveyor.samples": sum(len(b.sample_ids) for b in batches),
            },
        )
        self._acks: dict[int, asyncio.Future[None]] = {}

    async def send_slice(self, index: int, part: EncodedSlice) -> None:
        """Send slice ``index`` (once per contribution); its ack is awaited by :meth:`finish`."""
        assert index not in self._acks, f"slice {index} of {self.contribution_id} sent twice"
        message = GradSlice(
            job_id=self._session.job_id,
            contribution_id=self.contribution_id,
            worker_id=self._worker_id,
            base_version=self._base_version,
            slice_index=index,
            numel=part.numel,
            encoding=part.encoding,
            values=part.values,
            indices=part.indices,
            sent_at=time.time(),
        )
        with trace.use_span(self._span):  # the trace context rides in the record's headers
            self._acks[index] = await self._producer.send(
                self._session.grads_topic, message, key=str(index), partition=index
            )

    async def finish(
        self,
        computed: list[Computed],
        encoded: EncodedGrad,
        *,
        inner_steps: list[int] | None = None,
        carried_steps: int = 0,
        inner_state: dict[str, Any] | None = None,
        stamps: StepStamps,
    ) -> tuple[Pending[ReadyBatch], float]:
        """Send the slices of ``encoded`` not sent yet, await every ack, publish the
        Contribution (``computed``: every pass of it; local mode: ``inner_steps`` passes per
        inner step, the first ``carried_steps`` of them overlapped, ``inner_state`` the inner
        optimizer's before the window; ``stamps``); returns it
        as :class:`Pending` and the seconds this took (the sending left after the gradient was
        whole). Raises ``BusError`` when the broker fails."""
        session, batches = self._session, self._batches
        started = time.perf_counter()
        num_samples = sum(c.result.samples for c in computed)
        loss_sum = sum(c.result.loss_sum for c in computed)
        sample_ids = sample_ids_tensor([i for c in computed for i in c.batch.sample_ids])
        self._span.set_attribute("conveyor.grad_bytes", encoded.nbytes)
        with trace.use_span(self._span, end_on_exit=True):
            for index, part in enumerate(encoded.slices):
                if index not in self._acks:
                    await self.send_slice(index, part)
            await asyncio.gather(*self._acks.values())
            await self._producer.publish(
                session.plan.control_topic,
                Contribution(
                    job_id=session.job_id,
                    contribution_id=self.contribution_id,
                    worker_id=self._worker_id,
                    base_version=self._base_version,
                    num_samples=num_samples,
                    batch_ids=[batch.batch_id for batch in batches],
                    epoch=batches[0].epoch,
                    sample_ids=sample_ids,
                    loss_sum=loss_sum,
                    grad_bytes=encoded.nbytes,
                    sent_at=time.time(),
                    inner_steps=list(inner_steps or []),
                    carried_steps=carried_steps,
                    params_published_at=stamps.params_published_at,
                    params_received_at=stamps.params_received_at,
                    started_at=stamps.started_at,
                    computed_at=stamps.computed_at,
                ),
                key=self._worker_id,
            )
        pending = Pending(
            contribution_id=self.contribution_id,
            base_version=self._base_version,
            batches=batches,
            num_samples=num_samples,
            loss_sum=loss_sum,
            grad_bytes=encoded.nbytes,
            sent_at=time.time(),
            feedback=encoded if encoded.feedback_inputs is not None else None,
            inner_state=inner_state,
        )
        return pending, time.perf_counter() - started

    def abandon(self) -> None:
        """The gradient was never completed: end the span (the slices sent are never
        applied: no Contribution names them)."""
        self._span.end()


@dataclass(frozen=True, slots=True)
class StreamedGradient:
    """A step's gradient whose slices left while its last backward pass ran."""

    outgoing: Outgoing
    """Its contribution, every slice sent; :meth:`Outgoing.finish` publishes it."""
    encoded: EncodedGrad
    encode_s: float
    """Seconds spent encoding the slices (on the compute thread)."""


class ContributionSender:
    """Sends one trainer's messages for one job. ``next_sequence`` numbers its contributions
    (``<worker_id>:<sequence>``); set it past the log's highest before the first send."""

    def __init__(
        self, producer: Producer, session: JobSession, *, worker_id: str, tracer: Tracer
    ) -> None:
        self._producer = producer
        self._session = session
        self.worker_id = worker_id
        self._tracer = tracer
        self.next_sequence = 0

    def _next_id(self) -> str:
        contribution_id = f"{self.worker_id}:{self.next_sequence}"
        self.next_sequence += 1
        return contribution_id

    def start(self, base_version: int, batches: list[ReadyBatch]) -> Outgoing:
        """A contribution on ``base_version`` computed on ``batches`` (every pass of it, in
        order), numbered now; its slices may be sent before its gradient is whole
        (:meth:`Outgoing.send_slice`), then :meth:`Outgoing.finish` sends the rest, awaits
        their acks and publishes it."""
        return Outgoing(
            self._producer,
            self._session,
            self._tracer,
            contribution_id=self._next_id(),
            worker_id=self.worker_id,
            base_version=base_version,
            batches=batches,
        )

    async def stream(
        self,
        base_version: int | None,
        batches: list[ReadyBatch],
        compute: Callable[[SliceReady], Awaitable[tuple[MicroResult, EncodedGrad, float]]],
    ) -> tuple[MicroResult, StreamedGradient]:
        """A step's last pass, ``compute`` (given the callback that hands over each slice it
        encodes, :meth:`~conveyor.services.trainer.compute.engine.Engine.accumulate_streamed`),
        awaited while its slices are sent as a contribution on ``base_version`` computed on
        ``batches`` (:meth:`start`); :meth:`Outgoing.finish` of the result publishes it. A
        failure of either is raised once the pass has ended."""
        assert base_version is not None, "load a version before a step"
        outgoing = self.start(base_version, batches)
        stream = SliceStream(outgoing.send_slice, len(self._session.bounds))
        try:
            result, encoded, encode_s = await stream.run(compute(stream.ready))
        except BaseException:
            outgoing.abandon()
            raise
        return result, StreamedGradient(outgoing, encoded, encode_s)

    async def send_empty(self, base_version: int, epoch: int) -> Pending[ReadyBatch]:
        """Publish an empty Contribution (no batch was ready; it has no GradSlices) while the
        trainer is at ``epoch``."""
        session, contribution_id = self._session, self._next_id()
        await self._producer.publish(
            session.plan.control_topic,
            Contribution(
                job_id=session.job_id,
                contribution_id=contribution_id,
                worker_id=self.worker_id,
                base_version=base_version,
                num_samples=0,
                batch_ids=[],
                epoch=epoch,
                sample_ids=sample_ids_tensor([]),
                loss_sum=0.0,
                grad_bytes=0,
                sent_at=time.time(),
            ),
            key=self.worker_id,
        )
        return Pending(
            contribution_id=contribution_id,
            base_version=base_version,
            batches=[],
            num_samples=0,
            loss_sum=0.0,
            grad_bytes=0,
            sent_at=time.time(),
        )

    async def send_eval(self, batch: ReadyBatch, result: MicroResult, *, version: int) -> None:
        """Publish the EvalResult of one eval batch evaluated on ``version``."""
        session = self._session
        await self._producer.publish(
            session.plan.control_topic,
            EvalResult(
                job_id=session.job_id,
                worker_id=self.worker_id,
                epoch=batch.epoch,
                version=version,
                batch_ids=[batch.batch_id],
                loss_sum=result.loss_sum,
                correct=result.correct,
                num_samples=result.samples,
            ),
            key=self.worker_id,
        )
