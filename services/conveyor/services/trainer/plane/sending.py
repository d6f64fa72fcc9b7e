"""What a trainer puts on the gradient plane: GradSlices, Contributions, EvalResults.

A contribution's slices go out pipelined (one ``Producer.send`` per slice, partition = slice
index, then every ack awaited); only then is its Contribution published on the control topic,
so a Contribution on the log promises that every slice of it is on the grads topic. The
``grad send`` span covers both; it continues the trace of one of the contribution's batches
(the first sampled one) and links to the process spans of the others (a fan-in of several
traces, :func:`~conveyor.platform.bus.tracing.fan_in`).

A Contribution says what its gradient was computed on: one :class:`Computed` per forward and
backward pass the step ran, whose batch's sample ids go into ``sample_ids`` in that order (the
coordinator's sample ledger counts them); ``batch_ids`` names each batch once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from conveyor.platform.bus import Producer
from conveyor.platform.bus.tracing import fan_in
from conveyor.platform.messages import Contribution, EvalResult, GradSlice, sample_ids_tensor
from conveyor.services.trainer.compute.engine import MicroResult
from conveyor.services.trainer.compute.session import JobSession
from conveyor.services.trainer.data.prefetch import ReadyBatch
from conveyor.services.trainer.plane.gradients import EncodedGrad
from conveyor.services.trainer.plane.outstanding import Pending


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

    async def send(
        self,
        base_version: int,
        computed: list[Computed],
        encoded: EncodedGrad,
        *,
        inner_steps: list[int] | None = None,
        stamps: StepStamps,
    ) -> tuple[Pending[ReadyBatch], float]:
        """Send the slices of ``encoded`` (the gradient accumulated by ``computed``, all of one
        epoch; local mode: the window's weighted delta, ``inner_steps`` passes per inner
        step), await their acks, publish the Contribution with ``stamps``; returns it as
        :class:`Pending` and the seconds it took. Raises ``BusError`` when the broker fails."""
        session, contribution_id = self._session, self._next_id()
        started = time.perf_counter()
        batches = list({c.batch.batch_id: c.batch for c in computed}.values())  # each once
        num_samples = sum(c.result.samples for c in computed)
        loss_sum = sum(c.result.loss_sum for c in computed)
        sample_ids = sample_ids_tensor([i for c in computed for i in c.batch.sample_ids])
        parent, links = fan_in(batch.span.get_span_context() for batch in batches)
        attributes: dict[str, str | int] = {
            "conveyor.contribution_id": contribution_id,
            "conveyor.base_version": base_version,
            "conveyor.samples": num_samples,
            "conveyor.grad_bytes": encoded.nbytes,
        }
        with self._tracer.start_as_current_span(
            "grad send", context=parent, links=links, attributes=attributes
        ):
            acks = []
            for index, part in enumerate(encoded.slices):
                message = GradSlice(
                    job_id=session.job_id,
                    contribution_id=contribution_id,
                    worker_id=self.worker_id,
                    base_version=base_version,
                    slice_index=index,
                    numel=part.numel,
                    encoding=part.encoding,
                    values=part.values,
                    indices=part.indices,
                    sent_at=time.time(),
                )
                acks.append(
                    await self._producer.send(
                        session.grads_topic, message, key=str(index), partition=index
                    )
                )
            await asyncio.gather(*acks)
            await self._producer.publish(
                session.plan.control_topic,
                Contribution(
                    job_id=session.job_id,
                    contribution_id=contribution_id,
                    worker_id=self.worker_id,
                    base_version=base_version,
                    num_samples=num_samples,
                    batch_ids=[batch.batch_id for batch in batches],
                    epoch=batches[0].epoch,
                    sample_ids=sample_ids,
                    loss_sum=loss_sum,
                    grad_bytes=encoded.nbytes,
                    sent_at=time.time(),
                    inner_steps=list(inner_steps or []),
                    params_published_at=stamps.params_published_at,
                    params_received_at=stamps.params_received_at,
                    started_at=stamps.started_at,
                    computed_at=stamps.computed_at,
                ),
                key=self.worker_id,
            )
        pending = Pending(
            contribution_id=contribution_id,
            base_version=base_version,
            batches=batches,
            num_samples=num_samples,
            loss_sum=loss_sum,
            grad_bytes=encoded.nbytes,
            sent_at=time.time(),
            feedback=encoded if encoded.feedback_inputs is not None else None,
        )
        return pending, time.perf_counter() - started

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
