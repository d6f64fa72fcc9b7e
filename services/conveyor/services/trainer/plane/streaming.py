"""Gradient slices sent while the backward pass that completes them still runs (DDP-style
buckets; ``distribution.overlap_backward``).

A step's gradient is the sum over its micro-batches, so only the last micro-batch's backward
can finish a slice early. Backward reaches the layers nearest the loss first, and a slice is a
contiguous range of the flat vector, so the last slices are complete while the first layers'
gradients are still being computed
(:class:`~conveyor.services.trainer.plane.readiness.SliceReadiness`).

Two sides, two threads:

- :class:`BackwardSlices`, on the compute thread: post-accumulate-grad hooks on the model's
  parameters for the one pass; each completed slice is encoded there, by the job's
  :class:`~conveyor.services.trainer.plane.gradients.SliceEncoder` (the same bytes as encoding
  the whole gradient after the pass), and handed to a callback;
- :class:`SliceStream`, on the event loop: the callback it gives puts the slice on a queue
  with ``call_soon_threadsafe``, and it sends each slice as it arrives while the pass runs.
  The queue holds at most the K slices of one step (each is handed over exactly once).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from conveyor.services.trainer.plane.gradients import EncodedGrad, SliceEncoder
from conveyor.services.trainer.plane.readiness import SliceReadiness
from conveyor.training.compression import EncodedSlice
from conveyor.training.slicing import ParamLayout

R = TypeVar("R")

SliceReady = Callable[[int, EncodedSlice], None]
"""Called with (slice index, encoded slice) on the thread that runs the backward pass."""
SendSlice = Callable[[int, EncodedSlice], Awaitable[None]]
"""Sends (slice index, encoded slice) on the event loop (its ack is awaited later)."""


class BackwardSlices:
    """Encodes the slices of one step's gradient as its last backward pass completes them.

    Use :meth:`armed` around the pass, then :meth:`finish`. Blocking tensor work on the compute
    thread (the hooks run on the thread autograd runs them on: the caller's on the CPU, the
    device's autograd thread on CUDA, while the caller waits in ``backward``)."""

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        encoder: SliceEncoder,
        *,
        num_samples: int,
        ready: SliceReady,
    ) -> None:
        """``num_samples``: the step's samples, the last micro-batch's included (statistics
        and momentum correction are scaled by them)."""
        self._model = model
        self._layout = layout
        self._encoder = encoder
        self._num_samples = num_samples
        self._ready = ready
        self._tensors = layout.tensors(model)
        self._trainable = [
            not entry.statistic and tensor.requires_grad
            for entry, tensor in zip(layout.entries, self._tensors, strict=True)
        ]
        self._readiness = SliceReadiness(
            [(e.offset, e.numel, t) for e, t in zip(layout.entries, self._trainable, strict=True)],
            encoder.bounds,
        )
        self._parts: dict[int, tuple[EncodedSlice, torch.Tensor | None]] = {}
        self.encode_s = 0.0
        """Seconds spent encoding slices, inside the pass and after it."""

    @contextmanager
    def armed(self) -> Iterator[None]:
        """The hooks are on the trainable parameters while the block runs."""
        handles = [
            tensor.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                functools.partial(self._accumulated, index)
            )
            for index, tensor in enumerate(self._tensors)
            if self._trainable[index]
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def finish(self) -> EncodedGrad:
        """The pass has ended: encode and hand over the slices it did not complete, then the
        whole step's gradient, slice p at index p."""
        for index in self._readiness.rest():
            self._emit(index)
        parts = [self._parts[p] for p in range(len(self._encoder.bounds))]
        return self._encoder.join(parts, self._num_samples)

    def _accumulated(self, entry: int, _: torch.Tensor) -> None:
        for index in self._readiness.accumulated(entry):
            self._emit(index)

    def _emit(self, index: int) -> None:
        started = time.perf_counter()
        start, stop = self._encoder.bounds[index]
        grad = self._layout.flatten_grads(
            self._model, self._num_samples, start=start, stop=stop
        )  # [stop - start]
        self._parts[index] = self._encoder.encode_part(index, grad, self._num_samples)
        self.encode_s += time.perf_counter() - started
        self._ready(index, self._parts[index][0])


class SliceStream:
    """The event loop's side: sends one contribution's slices as the compute thread hands
    them over. Create it on the loop; :meth:`ready` may be called from any thread."""

    def __init__(self, send: SendSlice, num_slices: int) -> None:
        self._send_slice = send
        self._num_slices = num_slices
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, EncodedSlice]] = asyncio.Queue(maxsize=num_slices)

    def ready(self, index: int, part: EncodedSlice) -> None:
        """Hand slice ``index`` to the loop (thread-safe; never blocks: at most K slices)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, part))

    async def run(self, compute: Awaitable[R]) -> R:
        """Await ``compute`` (the pass, which hands over all K slices) while sending the slices
        it hands over; returns its result once every slice is sent (their acks are awaited by
        the sender). A failure of either is raised once the pass has ended (the
        model's gradients must not change under a pass still running); if the pass fails, the
        sends are cancelled and the slices already sent are never applied (no Contribution
        names them)."""
        sending = asyncio.create_task(self._send(), name="trainer.grad-stream")
        try:
            result = await compute
        except BaseException:
            sending.cancel()
            await asyncio.wait([sending])
            if not sending.cancelled():
                sending.exception()  # retrieved: the pass's failure is the one raised
            raise
        await sending
        return result

    async def _send(self) -> None:
        for _ in range(self._num_slices):
            index, part = await self._queue.get()
            await self._send_slice(index, part)
