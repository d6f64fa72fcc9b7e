"""Bounded prefetch: records -> batches on the device, ahead of the step loop.

A :class:`Prefetcher` task takes decoded records from the consumer, checks them, records the
batch's ``queue wait`` (from the preprocessor's send to this fetch) and opens its
``process conveyor.job.{id}.batches`` span, both children of the producer's span; it copies
the uint8 images to the device and puts the result in a bounded queue. With CUDA the copy
goes through pinned memory on a side stream (``non_blocking``) in its own thread, so it
overlaps the compute of earlier batches; on the CPU the decoded tensors (views over the
record) are used as they are. The step loop's :meth:`Prefetcher.get` measures the *exposed*
data wait: only the time it actually waits for a ready batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from conveyor.platform.bus import Received
from conveyor.platform.bus.tracing import messaging_span
from conveyor.platform.messages import Batch

logger = logging.getLogger(__name__)

TRACER_NAME = "conveyor.trainer"


class BatchSource(Protocol):
    """Where records come from (a :class:`~conveyor.platform.bus.Consumer`)."""

    async def get(self) -> Received: ...


@dataclass(slots=True, kw_only=True, eq=False)
class ReadyBatch:
    """A batch whose tensors are on the device, with its record and its trace span."""

    received: Received
    """The record; acknowledged once the control log shows the batch's effect."""
    batch_id: str
    epoch: int
    split: str
    sample_ids: list[int]
    x: torch.Tensor
    """uint8 [B, C, H, W] on the device (normalised later, on the device)."""
    y: torch.Tensor
    """int64 [B] on the device."""
    timestamps: dict[str, float]
    """The pipeline's stamps plus ``received`` and ``h2d_end`` (unix seconds)."""
    span: Span
    """``process <topic>``; ended by the step loop when the batch is done."""
    h2d_s: float = 0.0
    """Seconds the copy to the device took (in the copy thread, beside the compute)."""

    @property
    def samples(self) -> int:
        return len(self.sample_ids)


class DeviceCopier:
    """Copies a batch's tensors to ``device``: pinned memory + side stream on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    @property
    def asynchronous(self) -> bool:
        """True when copies are real work (run them off the event loop)."""
        return self._stream is not None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of ``x`` [B,C,H,W] and ``y`` [B]; blocks until they are complete."""
        stream = self._stream
        if stream is None:
            return x.to(self.device), y.to(self.device)
        pinned_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        pinned_y = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
        pinned_x.copy_(x)
        pinned_y.copy_(y)
        with torch.cuda.stream(stream):
            x_dev = pinned_x.to(self.device, non_blocking=True)
            y_dev = pinned_y.to(self.device, non_blocking=True)
        # Waiting here (in the copy thread) dates h2d_end exactly and frees the pinned buffers.
        stream.synchronize()
        return x_dev, y_dev


class Prefetcher:
    """Keeps up to ``depth`` batches ready on the device.

    ``run()`` loops until cancelled (consumer errors propagate). A record that is not a
    :class:`Batch` of ``job_id`` goes to ``reject(received, reason)`` and is skipped.
    """

    def __init__(
        self,
        source: BatchSource,
        copier: DeviceCopier,
        *,
        job_id: str,
        depth: int,
        consumer_group: str,
        reject: Callable[[Received, str], None],
        executor: Executor | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._source = source
        self._copier = copier
        self._job_id = job_id
        self._group = consumer_group
        self._reject = reject
        self._executor = executor
        self._queue: asyncio.Queue[ReadyBatch] = asyncio.Queue(maxsize=depth)
        self._tracer = trace.get_tracer(TRACER_NAME)

    def empty(self) -> bool:
        """True when the step loop would wait now."""
        return self._queue.empty()

    def qsize(self) -> int:
        return self._queue.qsize()

    async def get(self, timeout_s: float | None = None) -> tuple[ReadyBatch | None, float]:
        """The next ready batch (None when none came within ``timeout_s``; None: wait as
        long as it takes) and the seconds spent waiting (0 when one was ready)."""
        try:
            return self._queue.get_nowait(), 0.0
        except asyncio.QueueEmpty:
            started = time.perf_counter()
            try:
                async with asyncio.timeout(timeout_s):
                    item: ReadyBatch | None = await self._queue.get()
            except TimeoutError:
                item = None
            return item, time.perf_counter() - started

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            received = await self._source.get()
            received_at = time.time()
            message = received.message
            if not isinstance(message, Batch):
                self._reject(received, f"not a Batch: {type(message).__name__}")
                continue
            if message.job_id != self._job_id:
                self._reject(received, f"batch of job {message.job_id}, not {self._job_id}")
                continue
            self._queue_wait_span(received, message, received_at)
            span = self._start_span(received, message, received_at)
            h2d_started = time.time_ns()
            if self._copier.asynchronous:
                x, y = await loop.run_in_executor(
                    self._executor, self._copier, message.x, message.y
                )
            else:
                x, y = self._copier(message.x, message.y)
            h2d_ended = time.time_ns()
            self._tracer.start_span(
                "h2d", context=trace.set_span_in_context(span), start_time=h2d_started
            ).end(end_time=h2d_ended)
            stamps = dict(message.timestamps)
            stamps["received"] = received_at
            stamps["h2d_end"] = h2d_ended / 1e9
            await self._queue.put(
                ReadyBatch(
                    received=received,
                    batch_id=message.batch_id,
                    epoch=message.epoch,
                    split=message.split,
                    sample_ids=list(message.sample_ids),
                    x=x,
                    y=y,
                    timestamps=stamps,
                    span=span,
                    h2d_s=(h2d_ended - h2d_started) / 1e9,
                )
            )

    def _queue_wait_span(self, received: Received, batch: Batch, received_at: float) -> None:
        """``queue wait``: the batch's time between the preprocessor's send and this fetch
        (wall clocks of two processes: skewed by whatever their clocks differ by)."""
        sent_at = batch.timestamps.get("sent")
        if sent_at is None:
            return
        self._tracer.start_span(
            "queue wait", context=received.context, start_time=int(sent_at * 1e9)
        ).end(end_time=int(received_at * 1e9))

    def _start_span(self, received: Received, batch: Batch, received_at: float) -> Span:
        name, attributes = messaging_span("process", received.topic)
        attributes.update(
            {
                "messaging.destination.partition.id": str(received.partition),
                "messaging.kafka.offset": received.offset,
                "messaging.message.body.size": received.size_bytes,
                "messaging.consumer.group.name": self._group,
                "messaging.message.id": batch.batch_id,
                "conveyor.epoch": batch.epoch,
                "conveyor.split": batch.split,
                "conveyor.samples": len(batch.sample_ids),
            }
        )
        return self._tracer.start_span(
            name,
            context=received.context,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_time=int(received_at * 1e9),
        )
