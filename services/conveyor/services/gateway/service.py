"""The gateway service: job API over the event-sourced view of ``conveyor.jobs``.

Lifecycle (``run``): wait for the jobs topic (the sharder creates it), start the producer, replay
the topic into the view (``/readyz`` turns 200 once caught up), then keep tailing. Writes (submit,
cancel) publish a :class:`JobEvent`, wait for the broker's ack, then wait until the tail has applied
that very record, so a client reads its own writes from any endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI
from opentelemetry import trace

from conveyor.platform.bus import BusError, Producer, wait_for_topics
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.messages import (
    CancelRequested,
    CheckpointRequest,
    JobEvent,
    JobResumed,
    JobSubmitted,
    Topics,
)
from conveyor.platform.service import Service
from conveyor.platform.storage import StorageError
from conveyor.services.gateway.artifacts import JobArtifacts
from conveyor.services.gateway.autoscaling import AutoscalerLog
from conveyor.services.gateway.config import GatewaySettings
from conveyor.services.gateway.errors import (
    GatewayUnavailable,
    IdempotencyConflict,
    JobFinished,
    JobNotFound,
    JobNotResumable,
    JobNotRunning,
    LocationsRefused,
)
from conveyor.services.gateway.events import EventHub, JobsTail
from conveyor.services.gateway.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from conveyor.services.gateway.routes import install_routes
from conveyor.services.gateway.schemas import ShownState
from conveyor.training.jobspec import JobSpec
from conveyor.training.jobview import JobsView, JobView
from conveyor.training.locations import refused_locations
from conveyor.training.scheduling import Schedule

logger = logging.getLogger(__name__)

IDEMPOTENCY_NAMESPACE = uuid.UUID("6f0d3c1e-6b0a-5c37-9a43-2f7f3e1c8b52")
"""uuid5 namespace of job ids derived from Idempotency-Key values."""


def job_id_for(idempotency_key: str | None) -> str:
    """uuid5 of the key (the same key always names the same job), else a random uuid4; hex."""
    if idempotency_key is None:
        return uuid.uuid4().hex
    return uuid.uuid5(IDEMPOTENCY_NAMESPACE, idempotency_key).hex


class GatewayService(Service):
    """Serves ``/v1/jobs...`` next to the base's ``/healthz``, ``/readyz`` and ``/metrics``.

    The HTTP address is ``settings.http_address(telemetry)``. Not ready until the jobs topic
    exists and the view has replayed it up to the end offsets seen at start. ``storage`` gives
    the roots a job's checkpoint and dataset locations must lie inside (the gateway opens no
    store).
    """

    name = "gateway"

    def __init__(
        self,
        *,
        settings: GatewaySettings,
        kafka: KafkaSettings,
        storage: StorageSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        host, port = settings.http_address(telemetry)
        super().__init__(
            telemetry=telemetry.model_copy(update={"http_host": host, "http_port": port})
        )
        self.settings = settings
        self.kafka = kafka
        self.storage = storage
        self.artifacts = JobArtifacts(storage)
        self.topics = Topics(kafka.topic_prefix)
        self.view = JobsView(stage_window=settings.stage_window)
        self.hub = EventHub(max_events=settings.sse_queue_events, schedule=self.view.schedule)
        self.autoscaler = AutoscalerLog()
        self._tail: JobsTail | None = None
        self._producer: Producer | None = None
        self._key_locks: dict[str, asyncio.Lock] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        await wait_for_topics(self.kafka, [self.topics.jobs])
        async with Producer(self.kafka) as producer, asyncio.TaskGroup() as group:
            group.create_task(self.autoscaler.follow(self.kafka, self.topics.autoscaler))
            tail = JobsTail(self.kafka, self.topics.jobs, self.view, self.hub)
            await tail.start()
            try:
                self._producer, self._tail = producer, tail
                await tail.run()
            finally:
                self._producer = None
                await tail.stop()

    async def drain(self) -> None:
        # Progress streams never end by themselves; end them so the HTTP server can stop.
        self.hub.close()

    def readiness(self) -> bool:
        return super().readiness() and self._tail is not None and self._tail.ready

    def http_app(self) -> FastAPI:
        app = super().http_app()
        app.title = "Conveyor gateway"
        app.description = "Submit, follow and cancel training jobs."
        install_routes(app, self)
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=self.settings.max_body_bytes)
        app.add_middleware(RequestMetricsMiddleware)  # outermost: counts 413s too
        return app

    # -- operations (the routes call these) -------------------------------------------------

    def get_job(self, job_id: str) -> JobView:
        """The job's view; :class:`JobNotFound` otherwise."""
        self._require_ready()
        job = self.view.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list_jobs(self, *, state: ShownState | None = None, limit: int = 100) -> list[JobView]:
        """Newest submission first, optionally in one state only (``queued``: the schedule's
        queue, which holds planned and started jobs)."""
        self._require_ready()
        if state != "queued":
            return self.view.list(state=state, limit=limit)
        queue = set(self.view.schedule().queue)
        return [job for job in self.view.list(limit=len(self.view)) if job.job_id in queue][:limit]

    def schedule(self) -> Schedule:
        """Where the trainer pool goes now and the queue, from the jobs topic as read here."""
        self._require_ready()
        return self.view.schedule()

    async def submit(self, spec: JobSpec, idempotency_key: str | None) -> tuple[JobView, bool]:
        """Accept a job; returns (job, created). created is False for a repeated key.

        Raises :class:`LocationsRefused` when the spec names a checkpoint or dataset location
        outside the operator's roots, :class:`IdempotencyConflict` when the key was used with
        another spec and :class:`GatewayUnavailable` when not ready or the broker did not
        answer in time.
        """
        # In a thread: resolving symbolic links reads the file system, which may be slow.
        refusals = await asyncio.to_thread(refused_locations, spec, self.storage)
        if refusals:
            raise LocationsRefused(refusals)
        self._require_ready()
        spec_dict = spec.to_dict()
        if idempotency_key is None:
            return await self._publish_submitted(job_id_for(None), spec_dict, None), True
        # One submit per key at a time in this process: a concurrent retry waits and then
        # finds the job in the view instead of publishing a second submitted event.
        lock = self._key_locks.setdefault(idempotency_key, asyncio.Lock())
        try:
            async with lock:
                existing = self.view.job_for_key(idempotency_key)
                if existing is None:
                    job_id = job_id_for(idempotency_key)
                    job = await self._publish_submitted(job_id, spec_dict, idempotency_key)
                    created = True
                else:
                    job, created = existing, False
        finally:
            if not lock.locked():
                self._key_locks.pop(idempotency_key, None)
        # Also catches a racing gateway replica whose submitted event came first in the log.
        if job.spec != spec_dict:
            raise IdempotencyConflict(idempotency_key, job.job_id)
        return job, created

    async def cancel(self, job_id: str) -> JobView:
        """Ask the job's services to stop it; the job turns ``cancelled`` when they have.

        :class:`JobNotFound`, :class:`JobFinished` when terminal; repeating is harmless.
        """
        job = self.get_job(job_id)
        if job.terminal:
            raise JobFinished(job_id, job.state)
        if not job.cancel_requested:
            await self._publish(CancelRequested(job_id=job_id, reason="cancelled through the API"))
        return self.get_job(job_id)

    async def request_checkpoint(self, job_id: str) -> JobView:
        """Ask the job's coordinator for a checkpoint at its next step (a
        ``CheckpointRequest`` on the job's control topic).

        :class:`JobNotFound`; :class:`JobNotRunning` unless the job is planned or running.
        """
        job = self.get_job(job_id)
        if job.terminal or job.plan is None:
            raise JobNotRunning(job_id, job.state)
        producer, _ = self._require_ready()
        request = CheckpointRequest(job_id=job_id, reason="request", requested_at=time.time())
        try:
            async with asyncio.timeout(self.settings.write_timeout_s):
                topic = self.topics.control(job_id, incarnation=job.incarnation)
                await producer.publish(topic, request)
        except (BusError, TimeoutError) as exc:
            raise GatewayUnavailable(f"could not reach the broker: {exc}") from exc
        return job

    async def resume(self, job_id: str) -> JobView:
        """Restart a failed or cancelled job from its newest usable checkpoint (a
        ``JobResumed`` event; the sharder plans it again from there).

        :class:`JobNotFound`; :class:`JobNotResumable` for a job in another state or without
        a usable checkpoint; :class:`GatewayUnavailable` when the store or the broker does not
        answer.
        """
        job = self.get_job(job_id)
        if job.state not in ("failed", "cancelled"):
            raise JobNotResumable(job_id, f"it is {job.state}; only a failed or cancelled job is")
        try:
            progress, refused = await asyncio.to_thread(self.artifacts.resume_point, job)
        except ValueError as exc:
            raise JobNotResumable(job_id, str(exc)) from exc
        except StorageError as exc:
            raise GatewayUnavailable(f"reading the job's checkpoints: {exc}") from exc
        if progress is None:
            why = "; ".join(refused) if refused else "none was committed"
            raise JobNotResumable(job_id, f"no checkpoint to resume from ({why})")
        await self._publish(JobResumed(
            job_id=job_id, spec=job.spec, checkpoint_version=progress.version,
            incarnation=job.incarnation + 1, reason="resumed through the API",
        ))  # fmt: skip
        return self.get_job(job_id)

    # -- helpers ----------------------------------------------------------------------------

    def _require_ready(self) -> tuple[Producer, JobsTail]:
        producer, tail = self._producer, self._tail
        if producer is None or tail is None or not tail.ready:
            raise GatewayUnavailable("the gateway is still reading the job log; retry shortly")
        return producer, tail

    async def _publish_submitted(
        self, job_id: str, spec: dict[str, Any], idempotency_key: str | None
    ) -> JobView:
        # The job's submission span: the JobSubmitted record carries its trace to the sharder,
        # whose plan (in this trace) every shard release of the job links to.
        tracer = trace.get_tracer(__name__)
        with tracer.start_as_current_span("submit job", attributes={"conveyor.job_id": job_id}):
            event = JobSubmitted(job_id=job_id, spec=spec, idempotency_key=idempotency_key)
            await self._publish(event)
        job = self.view.get(job_id)
        assert job is not None, "the view applied the submitted event"
        return job

    async def _publish(self, event: JobEvent) -> None:
        """Publish ``event`` (key = job id), wait for the ack and for the view to apply it."""
        producer, tail = self._require_ready()
        timeout_s = self.settings.write_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                metadata = await producer.publish(self.topics.jobs, event, key=event.job_id)
            await tail.wait_applied(metadata.partition, metadata.offset, timeout_s)
        except TimeoutError as exc:
            raise GatewayUnavailable(
                f"{event.EVENT} for job {event.job_id} not confirmed within {timeout_s}s"
            ) from exc
        except BusError as exc:
            raise GatewayUnavailable(f"{event.EVENT} for job {event.job_id}: {exc}") from exc
        logger.info("job %s: %s", event.job_id, event.EVENT)
