"""The pure parts of tracing: templated destinations, fan-in parents, parent-based sampling."""

from __future__ import annotations

import pydantic
import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from conveyor.platform.bus.tracing import destination_template, fan_in, messaging_span
from conveyor.platform.config import TelemetrySettings
from conveyor.platform.telemetry import sampler


@pytest.mark.parametrize(
    ("topic", "template"),
    [
        ("conveyor.job.4f2a.batches", "conveyor.job.{id}.batches"),
        ("conveyor.job.4f2a.grads", "conveyor.job.{id}.grads"),
        ("conveyor.job.4f2a.params", "conveyor.job.{id}.params"),
        ("conveyor.job.4f2a.control", "conveyor.job.{id}.control"),
        ("test-7.job.j1.batches", "test-7.job.{id}.batches"),  # another prefix
        ("conveyor.jobs", None),  # shared topics are their own template
        ("conveyor.shards", None),
        ("conveyor.job.4f2a.other", None),
    ],
)
def test_destination_template(topic: str, template: str | None) -> None:
    assert destination_template(topic) == template


def test_messaging_span_names_the_template_and_keeps_the_topic() -> None:
    name, attributes = messaging_span("send", "conveyor.job.4f2a.batches")
    assert name == "send conveyor.job.{id}.batches"
    assert attributes["messaging.destination.name"] == "conveyor.job.4f2a.batches"
    assert attributes["messaging.destination.template"] == "conveyor.job.{id}.batches"
    assert attributes["messaging.operation.type"] == "send"
    name, attributes = messaging_span("process", "conveyor.shards")
    assert name == "process conveyor.shards"
    assert "messaging.destination.template" not in attributes


def _context(trace_id: int, span_id: int, *, sampled: bool) -> SpanContext:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)


def _parent_of(context: Context) -> SpanContext:
    return trace.get_current_span(context).get_span_context()


def test_fan_in_continues_the_first_sampled_input_and_links_the_others() -> None:
    unsampled, first, second = (
        _context(1, 11, sampled=False),
        _context(2, 22, sampled=True),
        _context(3, 33, sampled=True),
    )
    parent, links = fan_in([unsampled, first, second, first])  # a duplicate is linked once
    assert _parent_of(parent) == first
    assert [link.context for link in links] == [unsampled, second]


def test_fan_in_without_a_sampled_input_continues_the_first_and_without_any_starts_a_root() -> None:
    a, b = _context(1, 11, sampled=False), _context(2, 22, sampled=False)
    parent, links = fan_in([a, b])
    assert _parent_of(parent) == a and [link.context for link in links] == [b]
    parent, links = fan_in([trace.INVALID_SPAN_CONTEXT])
    assert not _parent_of(parent).is_valid and links == []


def _tracer(ratio: float) -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler(ratio))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_sampling_decides_at_the_root_and_follows_remote_parents() -> None:
    tracer, exporter = _tracer(0.0)
    tracer.start_span("release shard").end()  # a root: kept with probability 0
    sampled_parent = trace.set_span_in_context(NonRecordingSpan(_context(5, 55, sampled=True)))
    tracer.start_span("process batches", context=sampled_parent).end()
    assert [s.name for s in exporter.get_finished_spans()] == ["process batches"]

    tracer, exporter = _tracer(1.0)
    unsampled = trace.set_span_in_context(NonRecordingSpan(_context(6, 66, sampled=False)))
    tracer.start_span("grad send", context=unsampled).end()  # its batch was not sampled
    tracer.start_span("release shard").end()
    assert [s.name for s in exporter.get_finished_spans()] == ["release shard"]


def test_sample_ratio_setting_is_bounded() -> None:
    assert TelemetrySettings(trace_sample_ratio=0.01).trace_sample_ratio == 0.01
    with pytest.raises(pydantic.ValidationError, match="trace_sample_ratio"):
        TelemetrySettings(trace_sample_ratio=1.5)
