"""Errors raised by the message bus; the retry policy travels on the class."""

from __future__ import annotations

from typing import ClassVar

from aiokafka.errors import KafkaError

from conveyor.platform.errors import ConveyorError


class BusError(ConveyorError):
    """A bus operation failed and retrying the same call will not help."""


class BusUnavailable(BusError):
    """The broker could not serve the request right now (timeout, leader change, rebalance).

    Retrying after a backoff is expected to succeed.
    """

    retriable: ClassVar[bool] = True


class RecordTooLarge(BusError):
    """A record exceeds ``KafkaSettings.max_message_bytes``; it was not sent.

    Real Kafka rejects records above the topic's ``max.message.bytes``; the bus enforces the
    same limit itself so that a permissive broker (Tansu) behaves like a production one.
    """


class ConsumerStopped(BusError):
    """The consumer was stopped (or never started); no more records will be returned."""


def from_kafka_error(exc: KafkaError, action: str) -> BusError:
    """Wrap an aiokafka error into :class:`BusUnavailable` or :class:`BusError` by its policy."""
    kind = BusUnavailable if getattr(exc, "retriable", False) else BusError
    return kind(f"{action} failed: {type(exc).__name__}: {exc}")
