"""Checks of the traces a real run exported (spans as :class:`otlp_receiver.ReceivedSpan`).

:func:`batch_chain` finds one batch whose trace runs, with a parent at every hop, from the
sharder's shard release through the preprocessor, the trainer, the aggregator and back to a
trainer's parameter load; the other checks are about names, probes and the job's submission.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from otlp_receiver import ReceivedSpan

PROBES = ("/healthz", "/readyz", "/metrics")


class Spans:
    """Received spans indexed by id and by parent."""

    def __init__(self, spans: Iterable[ReceivedSpan]) -> None:
        self.all = list(spans)
        self.by_id = {s.span_id: s for s in self.all}
        self._children: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for span in self.all:
            self._children[span.parent_span_id].append(span)

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.all if s.name == name]

    def children(self, span: ReceivedSpan, name: str) -> list[ReceivedSpan]:
        return [s for s in self._children[span.span_id] if s.name == name]

    def parent(self, span: ReceivedSpan) -> ReceivedSpan | None:
        return self.by_id.get(span.parent_span_id)


def _descend(spans: Spans, start: ReceivedSpan, names: list[str]) -> list[ReceivedSpan] | None:
    """The first path of children called ``names`` in order below ``start``, or None."""
    if not names:
        return []
    for child in spans.children(start, names[0]):
        rest = _descend(spans, child, names[1:])
        if rest is not None:
            return [child, *rest]
    return None


def batch_chain(spans: Spans, prefix: str = "conveyor.") -> dict[str, ReceivedSpan]:
    """One batch's chain, by stage; AssertionError naming the missing hop when no batch has
    all of it. Every hop is the parent of the next (or, for siblings, they share the parent
    the stage names say)."""
    job = f"{prefix}job.{{id}}"
    down = ["grad send", f"send {job}.grads", "aggregate", f"send {job}.params",
            f"process {job}.params"]  # fmt: skip
    for process in spans.named(f"process {job}.batches"):
        below = _descend(spans, process, down)
        if below is None:
            continue
        send = spans.parent(process)
        shard_task = spans.parent(send) if send else None
        shard_send = spans.parent(shard_task) if shard_task else None
        release = spans.parent(shard_send) if shard_send else None
        assert send is not None and send.name == f"send {job}.batches", send
        assert shard_task is not None and shard_task.name == f"process {prefix}shards", shard_task
        assert shard_send is not None and shard_send.name == f"send {prefix}shards", shard_send
        assert release is not None and release.name == "release shard", release
        chain = {
            "release shard": release,
            "send shards": shard_send,
            "process shards": shard_task,
            "shard read": _one(spans.children(shard_task, "shard read"), "shard read"),
            "preprocess": _one(spans.children(shard_task, "preprocess"), "preprocess"),
            "send batches": send,
            "queue wait": _one(spans.children(send, "queue wait"), "queue wait"),
            "process batches": process,
            "h2d": _one(spans.children(process, "h2d"), "h2d"),
            "compute": _one(spans.children(process, "compute"), "compute"),
        }
        stages = ["grad send", "send grads", "aggregate", "send params", "load params"]
        chain.update(zip(stages, below, strict=True))
        return chain
    found = {name: len(spans.named(name)) for name in [f"process {job}.batches", *down]}
    raise AssertionError(f"no batch's trace reaches a parameter load; spans by name: {found}")


def _one(spans: list[ReceivedSpan], what: str) -> ReceivedSpan:
    assert spans, f"no {what} span"
    return spans[0]
