"""The gateway integration tests' harness: a GatewayService serving HTTP (uvicorn on a free
port) against the real broker, a client pointed at it, and helpers that publish lifecycle events
and wait for the view (test_gateway_jobs.py, test_gateway_api_guards.py; the ``gateway`` fixture
is in conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition
from job_events import job_event

from conveyor.platform.bus import Producer, create_topology
from conveyor.platform.codec import decode
from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.messages import JobEvent, Topics
from conveyor.platform.service import ServiceError
from conveyor.services.gateway.config import GatewaySettings
from conveyor.services.gateway.service import GatewayService
from conveyor.training.jobspec import JobSpec

SPEC = JobSpec.from_yaml(
    (Path(__file__).resolve().parents[2] / "examples" / "digits.yaml").read_text()
).to_dict()


TOKEN = "s3cret-token"


class Gateway:
    """A running GatewayService and an HTTP client pointed at it."""

    def __init__(self, service: GatewayService, client: httpx.AsyncClient) -> None:
        self.service = service
        self.client = client


@asynccontextmanager
async def serving_gateway(
    kafka: KafkaSettings, storage: StorageSettings | None = None, **settings: Any
) -> AsyncIterator[Gateway]:
    """A GatewayService that serves HTTP (ready or not) and a client pointed at it; ``storage``
    gives the roots jobs may use (default: the object store only)."""
    settings.setdefault("api_token", None)
    service = GatewayService(
        settings=GatewaySettings(port=0, **settings),
        kafka=kafka,
        storage=storage or StorageSettings(uri="file://./.conveyor/objects"),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )
    serving = asyncio.create_task(service.serve())
    deadline = time.monotonic() + 30
    while True:
        try:
            port = service.http_port
            break
        except ServiceError:
            assert time.monotonic() < deadline and not serving.done(), "gateway did not start"
            await asyncio.sleep(0.02)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
        try:
            yield Gateway(service, client)
        finally:
            service.request_stop()
            assert await asyncio.wait_for(serving, 30) == 0


async def wait_ready(gw: Gateway, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await gw.client.get("/readyz")).status_code != 200:
        assert time.monotonic() < deadline, "gateway never ready"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def running_gateway(
    kafka: KafkaSettings, storage: StorageSettings | None = None, **settings: Any
) -> AsyncIterator[Gateway]:
    """A ready gateway over the topics the sharder would have created."""
    await create_topology(kafka, TopologySettings())
    async with serving_gateway(kafka, storage, **settings) as gw:
        await wait_ready(gw)
        yield gw


async def jobs_topic_events(kafka: KafkaSettings) -> list[JobEvent]:
    """Every JobEvent on the jobs topic, read to its current end (group-less)."""
    topic = Topics(kafka.topic_prefix).jobs
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        events: list[JobEvent] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    message = decode(record.value)
                    assert isinstance(message, JobEvent)
                    assert record.key == message.job_id.encode()
                    events.append(message)
        return events
    finally:
        await consumer.stop()


async def publish(kafka: KafkaSettings, job_id: str, *events: tuple[str, dict[str, Any]]) -> None:
    """Publish lifecycle events as the sharder and trainers would."""
    async with Producer(kafka) as producer:
        for name, data in events:
            event = job_event(job_id, name, **data)
            await producer.publish(Topics(kafka.topic_prefix).jobs, event, key=job_id)


async def wait_for_state(gw: Gateway, job_id: str, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        body: dict[str, Any] = (await gw.client.get(f"/v1/jobs/{job_id}")).json()
        if body["state"] == state:
            return body
        assert time.monotonic() < deadline, f"job stuck in {body['state']}, wanted {state}"
        await asyncio.sleep(0.05)


async def wait_for_queue(
    gw: Gateway, predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """``/v1/queue`` once ``predicate`` holds of it. The view folds the jobs topic's partitions
    as their records come back, in no order between partitions: events of different jobs (or
    trainers) published one after another can show one at a time."""
    deadline = time.monotonic() + 10
    while True:
        queue: dict[str, Any] = (await gw.client.get("/v1/queue")).json()
        if predicate(queue):
            return queue
        assert time.monotonic() < deadline, f"the queue never got there: {queue}"
        await asyncio.sleep(0.05)
