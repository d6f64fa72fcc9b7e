"""Metadata requests that never create topics (KIP-361's ``allow.auto.create.topics=false``).

A Kafka broker with ``auto.create.topics.enable`` (Apache Kafka's default, and the embedded
Tansu broker) creates any topic a client asks metadata for. aiokafka 0.14 sends every metadata
request with ``allow_auto_topic_creation=True`` and has no option to change it. For Conveyor that
is wrong: per-job topics are created by the sharder and deleted when the job ends, and a late
consumer or producer of an ended job would otherwise bring its topics back (measured: an
aggregator joining a job that failed 50 ms after its plan re-created the deleted grads topic).

:func:`disable_topic_auto_creation` makes aiokafka's client ask with the flag off (Metadata
v4+), so a missing topic stays missing: consumers get no partitions for it and a producer's send
fails after ``request_timeout_s``. It runs once when :mod:`conveyor.platform.bus` is
imported, before any client exists, and only changes the default of that one request field.
"""

from __future__ import annotations

import aiokafka.client
from aiokafka.protocol.metadata import MetadataRequest


class NoAutoCreateMetadataRequest(MetadataRequest):  # type: ignore[misc]
    """A metadata request whose ``allow_auto_topic_creation`` defaults to False."""

    def __init__(
        self, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = False
    ) -> None:
        super().__init__(topics, allow_auto_topic_creation)


def disable_topic_auto_creation() -> None:
    """Make every aiokafka client in this process send metadata requests that create nothing.

    Idempotent. Brokers older than Kafka 0.11 (Metadata v3 and below) ignore the flag.
    """
    aiokafka.client.MetadataRequest = NoAutoCreateMetadataRequest
