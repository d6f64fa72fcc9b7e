"""Fixtures shared by every test: the real embedded broker and a real S3 endpoint.

Set ``CONVEYOR_KAFKA_BOOTSTRAP`` to run the same tests against a real Kafka.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from conveyor.embedded.broker import EmbeddedBroker, free_port
from conveyor.platform.config import KafkaSettings


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """bootstrap address of a broker shared by the session (one fresh topic per test)."""
    external = os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    with EmbeddedBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def kafka_settings(kafka_bootstrap: str) -> KafkaSettings:
    """Settings for this test with a unique topic prefix, so tests never share topics."""
    return KafkaSettings(
        bootstrap=kafka_bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        session_timeout_s=10.0,
        heartbeat_interval_s=1.0,
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """A real HTTP S3 endpoint (moto server) for the session."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield {
            "endpoint": f"127.0.0.1:{port}",
            "access_key": "testing",
            "secret_key": "testing",
            "region": "us-east-1",
        }
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: dict[str, str]) -> str:
    """A fresh, empty bucket on the session's S3 endpoint."""
    from minio import Minio

    client = Minio(
        s3_server["endpoint"],
        access_key=s3_server["access_key"],
        secret_key=s3_server["secret_key"],
        region=s3_server["region"],
        secure=False,
    )
    name = f"test-{uuid.uuid4().hex[:12]}"
    client.make_bucket(name)
    return name
