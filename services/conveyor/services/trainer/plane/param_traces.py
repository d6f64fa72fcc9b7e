"""The trace of a parameter load: which aggregations a trainer's parameters came from.

A version arrives as one ParamSlice per aggregator shard, each sent inside that shard's
``aggregate`` span. Loading the version is one CONSUMER span ``process conveyor.job.{id}.params``
over the whole batch of slices: it continues the trace of one slice (the first sampled one,
so a sampled batch's chain reaches the load) and links to the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.trace import Span, SpanContext, SpanKind, Tracer

from conveyor.platform.bus import Tailed
from conveyor.platform.bus.tracing import fan_in, messaging_span, producer_context


class ParamTraces:
    """The producer span contexts of the ParamSlices of each version not yet loaded.

    Memory: one context per slice of the versions newer than the newest complete one (those
    still filling) and of that one, until it is loaded or a newer one completes.
    """

    def __init__(self) -> None:
        self._contexts: dict[int, list[SpanContext]] = {}

    def add(self, record: Tailed, version: int) -> None:
        """Remember the producer span of ``record``, a ParamSlice of ``version``."""
        context = producer_context(record.context)
        if context.is_valid:
            self._contexts.setdefault(version, []).append(context)

    def forget_before(self, version: int | None) -> None:
        """Drop versions older than ``version`` (the newest complete one: nothing older is
        ever loaded); None keeps everything."""
        if version is not None:
            self._contexts = {v: c for v, c in self._contexts.items() if v >= version}

    @contextmanager
    def load_span(self, tracer: Tracer, topic: str, version: int) -> Iterator[Span]:
        """The span of loading ``version`` (made current); its contexts are forgotten."""
        contexts = self._contexts.pop(version, [])
        parent, links = fan_in(contexts)
        name, attributes = messaging_span("process", topic)
        attributes["messaging.batch.message_count"] = len(contexts)
        attributes["conveyor.version"] = version
        with tracer.start_as_current_span(
            name, context=parent, links=links, kind=SpanKind.CONSUMER, attributes=attributes
        ) as span:
            yield span
