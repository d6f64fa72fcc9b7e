"""Fixtures shared by several integration test files of this folder: a read failure injected
into the object stores' uploads (the storage behaviour suite and the S3 specifics use it). The
stack-wide fixtures, Kafka and the S3 endpoint, are in tests/conftest.py. Also: a count of the
Fetch requests sent (the bus tests of readers that pause or rest), and an in-memory span
exporter for the services' trace tests, the object-store ``backend`` (file and S3) of the
suites that run against both, a ready ``gateway`` (test_gateway_*.py), and the bus tests'
``settings`` for fast group changes (test_bus_groups.py, test_bus_records.py)."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from gateway_harness import Gateway, running_gateway
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once
from storage_backends import Backend, file_backend, s3_backend

from conveyor.platform.config import KafkaSettings
from conveyor.platform.storage.base import CHUNK_BYTES, HashingReader


@pytest.fixture
def fail_reads_after(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Arm: every source read through HashingReader fails with EIO once ``limit`` bytes
    went through; reads are cut to CHUNK_BYTES so the failure lands mid-stream."""

    def arm(limit_bytes: int) -> None:
        original = HashingReader.read

        def read(self: HashingReader, size: int = -1) -> bytes:
            if self.size_bytes >= limit_bytes:
                raise OSError(errno.EIO, "injected read failure")
            return original(self, CHUNK_BYTES if size < 0 else min(size, CHUNK_BYTES))

        monkeypatch.setattr(HashingReader, "read", read)

    return arm


@pytest.fixture
def fetch_requests(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts the Fetch requests every aiokafka client of this process sends from now on:
    call the returned function for the count so far."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.protocol.fetch import FetchRequest

    sent = 0
    original = AIOKafkaClient.send

    async def send(self: AIOKafkaClient, node_id: int, request: object, **kwargs: object) -> object:
        nonlocal sent
        if isinstance(request, FetchRequest):
            sent += 1
        return await original(self, node_id, request, **kwargs)

    monkeypatch.setattr(AIOKafkaClient, "send", send)
    return lambda: sent


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """A global SDK tracer provider for this test (OpenTelemetry allows one per process)."""
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        return file_backend(tmp_path)
    s3_server: dict[str, str] = request.getfixturevalue("s3_server")
    return s3_backend(s3_server, request.getfixturevalue("s3_bucket"))


@pytest.fixture
async def gateway(kafka_settings: KafkaSettings) -> AsyncIterator[Gateway]:
    async with running_gateway(kafka_settings) as gw:
        yield gw


@pytest.fixture
def settings(kafka_settings: KafkaSettings) -> KafkaSettings:
    """Settings for fast group changes: Tansu completes a join after half the session timeout;
    a real Kafka refuses sessions under 6 s (group.min.session.timeout.ms)."""
    session_s = 6.0 if os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP") else 2.0
    return kafka_settings.model_copy(
        update={"session_timeout_s": session_s, "heartbeat_interval_s": 0.3}
    )
