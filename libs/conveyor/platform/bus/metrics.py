"""Prometheus metrics of the bus, labelled by topic *kind* (jobs, batches, ...).

Per-job topic names are unbounded, so they never become label values; the kind is the last
part of the name (``<prefix>job.<id>.batches`` -> ``batches``) or the name of a shared topic
(``<prefix>jobs`` -> ``jobs``), and ``other`` for anything else.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from conveyor.platform import telemetry

_SHARED_KINDS = frozenset({"jobs", "shards", "dlq"})
_JOB_KINDS = frozenset({"batches", "grads", "params", "control"})
_JOB_SEGMENT = "job."

PRODUCED_RECORDS = telemetry.counter(
    "bus", "produced_records_total", "Records acknowledged by the broker.", ["topic_kind"]
)
PRODUCED_BYTES = telemetry.counter(
    "bus",
    "produced_bytes_total",
    "Value bytes of records acknowledged by the broker.",
    ["topic_kind"],
)
SEND_LATENCY = telemetry.histogram(
    "bus", "send_latency_seconds", "Time from send() to the broker's ack.", ["topic_kind"]
)
SEND_ERRORS = telemetry.counter(
    "bus", "send_errors_total", "Records the broker did not acknowledge.", ["topic_kind"]
)
CONSUMED_RECORDS = telemetry.counter(
    "bus", "consumed_records_total", "Records handed to the application.", ["topic_kind"]
)
CONSUMED_BYTES = telemetry.counter(
    "bus",
    "consumed_bytes_total",
    "Value bytes of records handed to the application.",
    ["topic_kind"],
)
DEAD_LETTERS = telemetry.counter(
    "bus",
    "dead_letters_total",
    "Undecodable records sent to the dead-letter topic.",
    ["topic_kind"],
)
CONSUMER_LAG = telemetry.gauge(
    "bus",
    "consumer_lag_records",
    "High-water mark minus position, summed over this process's assigned partitions.",
    ["topic_kind"],
)


def topic_kind(topic: str, prefix: str) -> str:
    """The bounded label value for ``topic`` (see the module docstring)."""
    return _topic_kind(topic, prefix)


@lru_cache(maxsize=4096)
def _topic_kind(topic: str, prefix: str) -> str:
    if not topic.startswith(prefix):
        return "other"
    rest = topic[len(prefix) :]
    if rest in _SHARED_KINDS:
        return rest
    if rest.startswith(_JOB_SEGMENT):
        kind = rest.rsplit(".", 1)[-1]
        if kind in _JOB_KINDS:
            return kind
    return "other"


@dataclass(frozen=True, slots=True)
class TopicMetrics:
    """The labelled metric children of one topic kind (looked up once, not per record)."""

    produced_records: Counter
    produced_bytes: Counter
    send_latency: Histogram
    send_errors: Counter
    consumed_records: Counter
    consumed_bytes: Counter
    dead_letters: Counter


@lru_cache(maxsize=4096)
def topic_metrics(topic: str, prefix: str) -> TopicMetrics:
    """The metric children for ``topic`` (cached: label lookup is slower than an increment)."""
    kind = _topic_kind(topic, prefix)
    return _kind_metrics(kind)


@lru_cache(maxsize=64)
def _kind_metrics(kind: str) -> TopicMetrics:
    return TopicMetrics(
        produced_records=PRODUCED_RECORDS.labels(kind),
        produced_bytes=PRODUCED_BYTES.labels(kind),
        send_latency=SEND_LATENCY.labels(kind),
        send_errors=SEND_ERRORS.labels(kind),
        consumed_records=CONSUMED_RECORDS.labels(kind),
        consumed_bytes=CONSUMED_BYTES.labels(kind),
        dead_letters=DEAD_LETTERS.labels(kind),
    )


class LagSource(Protocol):
    """Something that knows its consumer lag (a :class:`Consumer`)."""

    def lag(self, topic_kind: str | None = None) -> int: ...


_lag_sources: weakref.WeakSet[Any] = weakref.WeakSet()
_lag_kinds: set[str] = set()


def register_lag_source(source: LagSource, kinds: set[str]) -> None:
    """Report ``source``'s lag in the lag gauge (computed at scrape time) until unregistered."""
    for kind in kinds - _lag_kinds:
        CONSUMER_LAG.labels(kind).set_function(partial(_total_lag, kind))
        _lag_kinds.add(kind)
    _lag_sources.add(source)


def unregister_lag_source(source: LagSource) -> None:
    """Stop reporting ``source``'s lag (the consumer stopped)."""
    _lag_sources.discard(source)


def _total_lag(kind: str) -> float:
    return float(sum(source.lag(kind) for source in list(_lag_sources)))
