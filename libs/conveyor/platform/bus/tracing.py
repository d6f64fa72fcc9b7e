"""W3C trace context in Kafka headers, and spans named after the messaging conventions.

Headers travel as aiokafka's ``[(name, bytes), ...]`` on the producer side and as a
``dict[str, bytes]`` on the consumer side. The global propagator writes ``traceparent`` and
``tracestate`` (plus ``baggage``, when configured); with no SDK installed, the no-op tracer
still forwards the context it was given, so a hop without tracing does not break a trace.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Span, SpanKind

if TYPE_CHECKING:
    from conveyor.platform.bus.received import Received

MESSAGING_SYSTEM = "kafka"


class _ListSetter(Setter[list[tuple[str, bytes]]]):
    def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
        # A caller-supplied header of the same name would make two conflicting parents.
        carrier[:] = [item for item in carrier if item[0] != key]
        carrier.append((key, value.encode("ascii")))


class _MappingGetter(Getter[Mapping[str, bytes]]):
    def get(self, carrier: Mapping[str, bytes], key: str) -> list[str] | None:
        value = carrier.get(key)
        return None if value is None else [value.decode("ascii", "replace")]

    def keys(self, carrier: Mapping[str, bytes]) -> list[str]:
        return list(carrier)


_SETTER = _ListSetter()
_GETTER = _MappingGetter()


def inject_headers(headers: list[tuple[str, bytes]], context: Context | None = None) -> None:
    """Append the trace headers of ``context`` (default: the current one) to ``headers``."""
    propagate.inject(headers, context=context, setter=_SETTER)


def extract_context(headers: Mapping[str, bytes]) -> Context:
    """The context carried by ``headers``; an empty Context when they carry none."""
    if not headers:
        return Context()
    return propagate.extract(headers, context=Context(), getter=_GETTER)


def key_attribute(key: bytes) -> str:
    """A record key as a span attribute value (keys are ids, normally UTF-8)."""
    return key.decode("utf-8", "replace")


@contextmanager
def process_span(
    received: Received,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    consumer_group: str | None = None,
) -> Iterator[Span]:
    """A CONSUMER span ``process <topic>``, child of the producer's span, made current.

    Work done (and messages sent) inside the ``with`` block belong to the record's trace. An
    exception escaping the block is recorded on the span and re-raised.
    """
    tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
    attributes: dict[str, str | int] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": received.topic,
        "messaging.destination.partition.id": str(received.partition),
        "messaging.kafka.offset": received.offset,
        "messaging.message.body.size": received.size_bytes,
    }
    if received.key is not None:
        attributes["messaging.kafka.message.key"] = key_attribute(received.key)
    if consumer_group is not None:
        attributes["messaging.consumer.group.name"] = consumer_group
    with tracer.start_as_current_span(
        f"process {received.topic}",
        context=received.context,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
    ) as span:
        yield span
