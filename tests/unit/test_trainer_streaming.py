"""Gradient slices sent during the last backward pass (``distribution.overlap_backward``): which
slices are complete when (the readiness fold), the same bytes as encoding the whole gradient
after the pass (dense, fp16, top-k with error feedback and momentum correction, statistics),
and the hand-over from the compute thread to the event loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_trainer_engine import batch, make_engine
from torch import nn

from conveyor.services.trainer.compute.engine import Engine, Normalizer
from conveyor.services.trainer.plane.gradients import EncodedGrad, SliceEncoder
from conveyor.services.trainer.plane.readiness import SliceReadiness
from conveyor.services.trainer.plane.streaming import SliceReady, SliceStream
from conveyor.training.compression import EncodedSlice
from conveyor.training.jobspec import CompressionSpec
from conveyor.training.slicing import ParamLayout

CPU = torch.device("cpu")

# -- the readiness fold ----------------------------------------------------------------------

# Four entries of 4 elements: [0, 4) [4, 8) [8, 12) [12, 16); the third is a statistic.
ENTRIES = [(0, 4, True), (4, 4, True), (8, 4, False), (12, 4, True)]
BOUNDS = [(0, 6), (6, 10), (10, 16)]  # slice 1 covers entries 1 and 2, slice 2 entries 2 and 3


def test_a_slice_is_complete_when_every_trainable_entry_over_it_is_accumulated() -> None:
    readiness = SliceReadiness(ENTRIES, BOUNDS)
    assert readiness.accumulated(3) == [2]  # the statistic (entry 2) is not waited for
    assert readiness.accumulated(1) == [1]
    assert readiness.accumulated(0) == [0]
    assert readiness.rest() == []


def test_an_entry_accumulated_twice_in_one_pass_is_refused() -> None:
    readiness = SliceReadiness(ENTRIES, BOUNDS)
    assert readiness.accumulated(1) == [1]
    with pytest.raises(ValueError, match="accumulated twice"):
        readiness.accumulated(1)


def test_slices_the_pass_did_not_complete_are_handed_over_at_its_end_once() -> None:
    readiness = SliceReadiness(ENTRIES, BOUNDS)
    assert readiness.accumulated(3) == [2]
    assert readiness.rest() == [0, 1]  # entry 0 and 1 were outside the graph
    assert readiness.rest() == []
    assert readiness.accumulated(0) == []  # its slice was already handed over


def test_a_slice_without_trainable_entries_waits_for_the_end() -> None:
    readiness = SliceReadiness([(0, 4, False), (4, 4, True)], [(0, 4), (4, 8), (8, 8)])
    assert readiness.accumulated(1) == [1]
    assert readiness.rest() == [0, 2]  # statistics only, and an empty slice


# -- the compute thread: the same bytes, handed over while the pass runs -----------------------


def streamed_step(engine: Engine, steps: int = 2) -> list[tuple[EncodedGrad, list[int]]]:
    """``steps`` steps of two micro-batches (8 + 5 samples), the last one streamed: each
    step's gradient and the order its slices were handed over in."""
    found: list[tuple[EncodedGrad, list[int]]] = []
    for step in range(steps):
        engine.accumulate(*batch(8, seed=10 * step))
        x, y = batch(5, seed=10 * step + 1)
        order: list[int] = []
        found.append((engine.accumulate_streamed(x, y, None, 13, handed_to(order))[1], order))
    return found


def handed_to(order: list[int]) -> SliceReady:
    """A hand-over callback that records the slices' order."""
    return lambda index, _: order.append(index)


def serial_step(engine: Engine, steps: int = 2) -> list[EncodedGrad]:
    found = []
    for step in range(steps):
        engine.accumulate(*batch(8, seed=10 * step))
        engine.accumulate(*batch(5, seed=10 * step + 1))
        found.append(engine.gradient(13)[0])
    return found


def raw(tensor: torch.Tensor) -> bytes:
    """The bytes a tensor travels as (any dtype, bf16 included)."""
    return bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def assert_same_bytes(streamed: EncodedGrad, serial: EncodedGrad) -> None:
    assert len(streamed.slices) == len(serial.slices)
    for ours, theirs in zip(streamed.slices, serial.slices, strict=True):
        assert (ours.encoding, ours.numel) == (theirs.encoding, theirs.numel)
        assert ours.values.dtype == theirs.values.dtype
        assert raw(ours.values) == raw(theirs.values)
        assert torch.equal(ours.indices, theirs.indices)
    assert streamed.scale == serial.scale
    assert (streamed.feedback_inputs is None) == (serial.feedback_inputs is None)


COMPRESSIONS = {
    "dense": CompressionSpec(),
    "fp16": CompressionSpec(kind="fp16"),
    "topk": CompressionSpec(kind="topk", ratio=0.05),
}


@pytest.mark.parametrize("name", [*sorted(COMPRESSIONS), "topk-momentum"])
def test_streamed_slices_are_the_bytes_of_the_whole_gradient_encoded_after_the_pass(
    name: str,
) -> None:
    compression = COMPRESSIONS[name.split("-")[0]]
    momentum = 0.9 if name == "topk-momentum" else 0.0
    engines = []
    for _ in range(2):
        engine = make_engine(compression, slices=3)
        engine.encoder = SliceEncoder(compression, engine.encoder.bounds, momentum=momentum)
        engines.append(engine)
    streamed, serial = streamed_step(engines[0]), serial_step(engines[1])
    for (ours, order), theirs in zip(streamed, serial, strict=True):
        assert_same_bytes(ours, theirs)
        assert sorted(order) == [0, 1, 2]
        assert order[-1] == 0  # the first layer, reached last, completes the first slice last
    # The gradients were cleared: the next step starts from zero in both.
    assert all(p.grad is None for p in engines[0].model.parameters())


class Odd(nn.Module):
    """Statistics (BatchNorm), a frozen parameter and one outside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(64, 16)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(16)
        self.unused = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.relu(self.norm(self.frozen(x.flatten(1)))))
        return logits


def odd_engine() -> Engine:
    torch.manual_seed(1)
    model = Odd()
    layout = ParamLayout.from_model(model)
    encoder = SliceEncoder(CompressionSpec(), layout.slice_bounds(4))
    return Engine(
        model, CPU, bf16=False, normalizer=Normalizer(None, 1, CPU), layout=layout, encoder=encoder
    )


def test_statistics_frozen_and_unused_parameters_stream_as_they_would_be_sent() -> None:
    ours, theirs = odd_engine(), odd_engine()
    streamed, serial = streamed_step(ours), serial_step(theirs)
    for (encoded, order), expected in zip(streamed, serial, strict=True):
        assert_same_bytes(encoded, expected)
        assert sorted(order) == [0, 1, 2, 3]
    assert isinstance(ours.model, Odd) and ours.model.norm.running_mean is not None
    assert ours.model.norm.running_mean.abs().sum() > 0  # the statistics moved, and travelled


def test_the_last_slice_leaves_before_the_backward_reaches_the_first_layer() -> None:
    engine = make_engine(slices=2)
    first = next(engine.model.parameters())  # the first layer: reached last by backward
    seen: list[tuple[int, bool]] = []
    engine.accumulate_streamed(
        *batch(8, seed=0), None, 8, lambda p, _: seen.append((p, first.grad is None))
    )
    assert seen == [(1, True), (0, False)]


# -- the event loop's side -------------------------------------------------------------------


def part(index: int) -> EncodedSlice:
    return EncodedSlice("dense", torch.full((2,), float(index)), torch.zeros(0), 2)


async def test_slices_handed_from_another_thread_are_sent_in_the_order_they_came() -> None:
    sent: list[tuple[int, str]] = []

    async def send(index: int, encoded: EncodedSlice) -> None:
        sent.append((index, threading.current_thread().name))

    stream = SliceStream(send, 3)
    loop = asyncio.get_running_loop()

    def compute() -> str:
        for index in (2, 0, 1):
            stream.ready(index, part(index))
        return "done"

    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        assert await stream.run(loop.run_in_executor(pool, compute)) == "done"
    assert [index for index, _ in sent] == [2, 0, 1]
    assert {name for _, name in sent} == {threading.main_thread().name}  # on the loop


async def test_a_failed_pass_cancels_the_sends_and_a_failed_send_waits_for_the_pass() -> None:
    async def never(index: int, encoded: EncodedSlice) -> None:
        await asyncio.Event().wait()

    stream = SliceStream(never, 2)
    stream.ready(1, part(1))

    async def failing() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        await stream.run(failing())

    async def broken(index: int, encoded: EncodedSlice) -> None:
        raise ConnectionError("broker gone")

    stream = SliceStream(broken, 2)
    finished: list[str] = []

    async def pass_() -> str:
        stream.ready(1, part(1))
        await asyncio.sleep(0.01)  # the send fails meanwhile
        stream.ready(0, part(0))
        finished.append("pass")
        return "ok"

    with pytest.raises(ConnectionError):
        await stream.run(pass_())
    assert finished == ["pass"]  # the gradients were not left under a running pass
