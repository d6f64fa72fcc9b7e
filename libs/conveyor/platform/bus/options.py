"""aiokafka client options derived from :class:`KafkaSettings`, in one place.

The limits are kept consistent: a record of ``max_message_bytes`` (value + key + headers, the
size the bus checks) always fits the producer's request, the topic's ``max.message.bytes`` and
one partition fetch, because each of those is the limit plus :data:`FRAMING_HEADROOM_BYTES` for
the record-batch framing Kafka counts on top of the payload.
"""

from __future__ import annotations

from typing import Any

from conveyor.platform.config import KafkaSettings

FRAMING_HEADROOM_BYTES = 64 * 1024
"""Room for record-batch and request framing on top of a maximal record (bytes)."""

_DEFAULT_FETCH_MAX_BYTES = 50 * 1024 * 1024
"""aiokafka's default total fetch size; raised when one record could be bigger."""


def wire_limit_bytes(settings: KafkaSettings) -> int:
    """The broker/client-side size limit (bytes) matching ``settings.max_message_bytes``."""
    return settings.max_message_bytes + FRAMING_HEADROOM_BYTES


def topic_config(settings: KafkaSettings) -> dict[str, str]:
    """Topic configs every bus topic is created with (real Kafka enforces them, Tansu ignores)."""
    return {"max.message.bytes": str(wire_limit_bytes(settings))}


def admin_options(settings: KafkaSettings) -> dict[str, Any]:
    """Keyword arguments of ``AIOKafkaAdminClient``."""
    return {
        "bootstrap_servers": settings.bootstrap,
        "client_id": f"{settings.client_id}-admin",
        "request_timeout_ms": int(settings.request_timeout_s * 1000),
    }


def producer_options(settings: KafkaSettings) -> dict[str, Any]:
    """Keyword arguments of ``AIOKafkaProducer``: every replica acks, no idempotence.

    Idempotence needs InitProducerId, which Tansu lacks; duplicates from retries are handled
    by the consumers' idempotency (deterministic message ids), as for any broker.
    """
    return {
        "bootstrap_servers": settings.bootstrap,
        "client_id": settings.client_id,
        "acks": "all",
        "enable_idempotence": False,
        "max_request_size": wire_limit_bytes(settings),
        "linger_ms": settings.linger_ms,
        "request_timeout_ms": int(settings.request_timeout_s * 1000),
    }


def consumer_options(settings: KafkaSettings, group_id: str) -> dict[str, Any]:
    """Keyword arguments of ``AIOKafkaConsumer`` for a group member that commits explicitly."""
    partition_fetch_bytes = wire_limit_bytes(settings)
    return {
        "bootstrap_servers": settings.bootstrap,
        "client_id": settings.client_id,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_uncommitted",
        "max_partition_fetch_bytes": partition_fetch_bytes,
        "fetch_max_bytes": max(_DEFAULT_FETCH_MAX_BYTES, partition_fetch_bytes),
        "request_timeout_ms": int(settings.request_timeout_s * 1000),
        "session_timeout_ms": int(settings.session_timeout_s * 1000),
        "heartbeat_interval_ms": int(settings.heartbeat_interval_s * 1000),
        "max_poll_interval_ms": int(settings.max_poll_interval_s * 1000),
        "fetch_max_wait_ms": settings.fetch_max_wait_ms,
    }
