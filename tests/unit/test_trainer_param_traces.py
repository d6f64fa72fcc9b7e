"""ParamTraces: a parameter load continues one slice's trace, links the others, forgets old
versions."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from conveyor.platform.bus import Tailed
from conveyor.platform.messages import JobCancelled
from conveyor.services.trainer.plane.param_traces import ParamTraces

TOPIC = "conveyor.job.j1.params"


def _record(trace_id: int, span_id: int, *, sampled: bool = True) -> Tailed:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)
    return Tailed(
        topic=TOPIC, partition=0, offset=0, message=JobCancelled(job_id="j1", reason="x"),
        timestamp_ms=0, size_bytes=0,
        context=trace.set_span_in_context(NonRecordingSpan(context)),
    )  # fmt: skip


def test_a_load_continues_a_sampled_slice_and_links_the_others() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traces = ParamTraces()
    traces.add(_record(1, 10), version=3)  # a version the trainer never loads
    traces.add(_record(2, 20, sampled=False), version=4)
    traces.add(_record(3, 30), version=4)
    traces.add(_record(4, 40), version=5)  # still filling
    traces.forget_before(4)

    with traces.load_span(provider.get_tracer("t"), TOPIC, 4):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.name == "process conveyor.job.{id}.params"
    assert span.kind == trace.SpanKind.CONSUMER
    assert span.parent is not None and (span.parent.trace_id, span.parent.span_id) == (3, 30)
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [(2, 20)]
    assert span.attributes is not None
    assert span.attributes["messaging.batch.message_count"] == 2
    assert span.attributes["conveyor.version"] == 4
    # Version 3 was forgotten, 4 taken by its load: only 5 is still held.
    with traces.load_span(provider.get_tracer("t"), TOPIC, 3):
        pass
    assert exporter.get_finished_spans()[-1].parent is None  # nothing held: a root
    traces.forget_before(5)
    with traces.load_span(provider.get_tracer("t"), TOPIC, 5):
        pass
    last = exporter.get_finished_spans()[-1]
    assert last.parent is not None and last.parent.span_id == 40
