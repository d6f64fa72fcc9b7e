"""What a consumer hands to the application: one decoded record and where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.context import Context

from conveyor.platform.bus.offsets import PartitionOffsets
from conveyor.platform.messages import Message


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """One decoded record. Pass it back to ``Consumer.ack`` once its effect is durable."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    message: Message
    """The decoded message; its tensors are views over the record's bytes (no copy)."""
    headers: dict[str, bytes]
    timestamp_ms: int
    """Record timestamp (ms since the Unix epoch) as set by the producer or broker."""
    size_bytes: int
    """Size of the record value on the wire (bytes)."""
    context: Context
    """OpenTelemetry context extracted from the W3C headers (empty when there were none).
    Nothing is started from it; use :func:`conveyor.platform.bus.process_span` to trace the work."""
    _offsets: PartitionOffsets = field(repr=False, compare=False)
    """Bookkeeping of the assignment the record was delivered under (acks of records from a
    revoked assignment are ignored: the partition's new owner gets them again)."""
