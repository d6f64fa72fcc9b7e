"""W3C trace context in Kafka headers, and spans named after the messaging conventions.

Span names use the destination *template* (``send conveyor.job.{id}.batches``) so that their
number stays bounded however many jobs run; the concrete topic is in
``messaging.destination.name`` and the template in ``messaging.destination.template``.

A fan-in (several records, each with its own trace, feeding one piece of work: the batches of
a step, the contributions of an aggregation, the slices of a parameter version) continues one
of the traces and links to the others (:func:`fan_in`), so each batch's chain runs unbroken in
one trace and the other inputs stay reachable by link.

Headers travel as aiokafka's ``[(name, bytes), ...]`` on the producer side and as a
``dict[str, bytes]`` on the consumer side. The global propagator writes ``traceparent`` and
``tracestate`` (plus ``baggage``, when configured); with no SDK installed, the no-op tracer
still forwards the context it was given, so a hop without tracing does not break a trace.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Link, Span, SpanContext, SpanKind

if TYPE_CHECKING:
    from conveyor.platform.bus.received import Received

MESSAGING_SYSTEM = "kafka"

# <anything>job.<id>.<kind>: job ids never contain dots (Topics refuses them).
_JOB_TOPIC = re.compile(r"(?P<head>.*job\.)[^.]+\.(?P<kind>batches|grads|params|control)")


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


@lru_cache(maxsize=4096)
def destination_template(topic: str) -> str | None:
    """``conveyor.job.{id}.batches`` for a per-job topic, None for any other topic (its name
    is its own template: ``conveyor.jobs``, ``conveyor.shards``)."""
    match = _JOB_TOPIC.fullmatch(topic)
    if match is None:
        return None
    return f"{match['head']}{{id}}.{match['kind']}"


def messaging_span(operation: str, topic: str) -> tuple[str, dict[str, str | int]]:
    """The span name (``<operation> <destination template or name>``) and the attributes every
    messaging span of ``operation`` (``send``, ``process``) on ``topic`` carries."""
    template = destination_template(topic)
    attributes: dict[str, str | int] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": topic,
    }
    if template is not None:
        attributes["messaging.destination.template"] = template
    return f"{operation} {template or topic}", attributes


def fan_in(contexts: Iterable[SpanContext]) -> tuple[Context, list[Link]]:
    """The parent and links of a span whose inputs came from several traces.

    The parent is the first sampled valid context (the first valid one when none is sampled),
    so a sampled input's chain continues whole; every other distinct valid context becomes a
    link. No valid context: an empty Context (a new root, sampled by the root sampler) and no
    links.
    """
    distinct: dict[tuple[int, int], SpanContext] = {}
    for context in contexts:
        if context.is_valid:
            distinct.setdefault((context.trace_id, context.span_id), context)
    if not distinct:
        return Context(), []
    chosen = next(
        (c for c in distinct.values() if c.trace_flags.sampled), next(iter(distinct.values()))
    )
    parent = trace.set_span_in_context(trace.NonRecordingSpan(chosen), Context())
    return parent, [Link(c) for c in distinct.values() if c is not chosen]


def producer_context(context: Context) -> SpanContext:
    """The producer's span context that a record's extracted ``context`` carries."""
    return trace.get_current_span(context).get_span_context()


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
    """A CONSUMER span ``process <topic template>``, child of the producer's span, made current.

    Work done (and messages sent) inside the ``with`` block belong to the record's trace. An
    exception escaping the block is recorded on the span and re-raised.
    """
    tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
    name, attributes = messaging_span("process", received.topic)
    attributes["messaging.destination.partition.id"] = str(received.partition)
    attributes["messaging.kafka.offset"] = received.offset
    attributes["messaging.message.body.size"] = received.size_bytes
    if received.key is not None:
        attributes["messaging.kafka.message.key"] = key_attribute(received.key)
    if consumer_group is not None:
        attributes["messaging.consumer.group.name"] = consumer_group
    with tracer.start_as_current_span(
        name,
        context=received.context,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
    ) as span:
        yield span
