"""The trainer's last pass and its gradient's send, with and without the overlap, side by side.

What ``distribution.overlap_backward`` changes, measured alone (the whole stack's hops are in
``bench_aggregation``, where 11 processes on the same cores drown a few milliseconds): one
process, a real embedded broker (Tansu) and the trainer's own parts: its
:class:`~conveyor.services.trainer.compute.engine.Engine` on a compute thread, its
:class:`~conveyor.services.trainer.plane.gradients.SliceEncoder`, GradSlices through the
project's :class:`~conveyor.platform.bus.Producer` to a topic of K partitions. One step is the
last micro-batch's forward/backward plus its slices sent and every ack received (the
Contribution after it is the same either way and left out):

    serial   accumulate, then gradient (flatten + encode K slices), then send the K slices;
    overlap  accumulate_streamed: each slice encoded and sent as the backward completes it.

Cases: small_cnn [16, 32, 64] on 1x8x8 (the digits demo's model, K = 2) and resnet18 (width
16, group norm) on 3x32x32 (K = 2 and 4), a micro-batch of 32, 1 torch thread. The two modes
alternate step by step after a warm-up; medians over the steps. The last line is one JSON
object: ``{"overlap_vs_serial": overlap / serial step time, "serial_ms": ..., "overlap_ms": ...}``
for small_cnn (the headline), then the same keys prefixed ``<case>_`` for the others (below 1:
the overlap is faster).

    .venv/bin/python -m loadtests.bench_overlap            # 60 steps a mode and case
    .venv/bin/python -m loadtests.bench_overlap --steps 20 # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from conveyor.embedded.broker import EmbeddedBroker
from conveyor.platform.bus import Producer
from conveyor.platform.bus.admin import ensure_topics
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import GradSlice
from conveyor.platform.messages.topics import TopicSpec
from conveyor.services.trainer.compute.engine import Engine, Normalizer
from conveyor.services.trainer.plane.gradients import SliceEncoder
from conveyor.services.trainer.plane.streaming import SliceStream
from conveyor.training.compression import EncodedSlice
from conveyor.training.jobspec import CompressionSpec
from conveyor.training.models import build_model
from conveyor.training.slicing import ParamLayout

CPU = torch.device("cpu")
MICRO_BATCH = 32


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    model: str
    options: dict[str, object]
    shape: tuple[int, int, int]
    slices: int


CASES = (
    Case("small_cnn", "small_cnn", {"channels": [16, 32, 64]}, (1, 8, 8), 2),
    Case("resnet18_k2", "resnet18", {"width": 16, "norm": "group"}, (3, 32, 32), 2),
    Case("resnet18_k4", "resnet18", {"width": 16, "norm": "group"}, (3, 32, 32), 4),
)


def make_engine(case: Case) -> Engine:
    torch.manual_seed(0)
    channels, height, width = case.shape
    model = build_model(
        case.model,
        in_channels=channels,
        num_classes=10,
        image_size=(height, width),
        **case.options,
    )
    layout = ParamLayout.from_model(model)
    encoder = SliceEncoder(CompressionSpec(), layout.slice_bounds(case.slices))
    normalizer = Normalizer(None, channels, CPU)
    return Engine(model, CPU, bf16=False, normalizer=normalizer, layout=layout, encoder=encoder)


class Bench:
    """One case's two modes on one producer and topic."""

    def __init__(self, case: Case, producer: Producer, topic: str, pool: ThreadPoolExecutor):
        self.case, self.producer, self.topic, self.pool = case, producer, topic, pool
        self.engine = make_engine(case)
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 256, (MICRO_BATCH, *case.shape), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        self.y = torch.randint(0, 10, (MICRO_BATCH,), generator=generator)
        self.sequence = 0

    async def _send(
        self, acks: list[asyncio.Future[object]], index: int, part: EncodedSlice
    ) -> None:
        message = GradSlice(
            job_id="bench", contribution_id=f"w:{self.sequence}", worker_id="w", base_version=0,
            slice_index=index, numel=part.numel, encoding=part.encoding, values=part.values,
            indices=part.indices, sent_at=time.time(),
        )  # fmt: skip
        acks.append(await self.producer.send(self.topic, message, partition=index))

    async def serial(self) -> float:
        loop, started = asyncio.get_running_loop(), time.perf_counter()
        await loop.run_in_executor(self.pool, self.engine.accumulate, self.x, self.y)
        encoded, _ = await loop.run_in_executor(self.pool, self.engine.gradient, MICRO_BATCH)
        acks: list[asyncio.Future[object]] = []
        for index, part in enumerate(encoded.slices):
            await self._send(acks, index, part)
        await asyncio.gather(*acks)
        self.sequence += 1
        return time.perf_counter() - started

    async def overlap(self) -> float:
        loop, started = asyncio.get_running_loop(), time.perf_counter()
        acks: list[asyncio.Future[object]] = []
        stream = SliceStream(lambda i, p: self._send(acks, i, p), self.case.slices)
        compute = loop.run_in_executor(
            self.pool, self.engine.accumulate_streamed, self.x, self.y, None, MICRO_BATCH,
            stream.ready,
        )  # fmt: skip
        await stream.run(compute)
        await asyncio.gather(*acks)
        self.sequence += 1
        return time.perf_counter() - started


async def run_case(case: Case, kafka: KafkaSettings, steps: int) -> dict[str, float]:
    topic = f"{kafka.topic_prefix}grads.{case.name}"
    await ensure_topics(kafka, [TopicSpec(topic, partitions=case.slices)])
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        async with Producer(kafka) as producer:
            bench = Bench(case, producer, topic, pool)
            for _ in range(5):  # warm-up: kernels, connections, the topic's leaders
                await bench.serial()
                await bench.overlap()
            times: dict[str, list[float]] = {"serial": [], "overlap": []}
            for step in range(steps):
                order = ("serial", "overlap") if step % 2 == 0 else ("overlap", "serial")
                for mode in order:
                    times[mode].append(await getattr(bench, mode)())
    serial, overlap = (statistics.median(times[m]) for m in ("serial", "overlap"))
    return {"serial_ms": serial * 1000, "overlap_ms": overlap * 1000, "ratio": overlap / serial}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per mode and case")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(1)
    found: dict[str, float] = {}
    load = [os.getloadavg()[0]]
    with EmbeddedBroker() as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:8]}.")
        for case in CASES:
            result = asyncio.run(run_case(case, kafka, args.steps))
            load.append(os.getloadavg()[0])
            print(f"{case.name} (K={case.slices}): serial {result['serial_ms']:.2f} ms, "
                  f"overlap {result['overlap_ms']:.2f} ms, overlap / serial "
                  f"{result['ratio']:.3f}")  # fmt: skip
            # The headline (unprefixed) is the first case, the digits demo's model.
            prefix = "" if case is CASES[0] else f"{case.name}_"
            found[f"{prefix}overlap_vs_serial"] = round(result["ratio"], 4)
            found[f"{prefix}serial_ms"] = round(result["serial_ms"], 3)
            found[f"{prefix}overlap_ms"] = round(result["overlap_ms"], 3)
    print(f"{os.cpu_count()} CPU core(s), 1 torch thread; 1-minute load average "
          f"{min(load):.1f}..{max(load):.1f} (other work shares the cores: "
          "compare ratios)")  # fmt: skip
    print(json.dumps(found))


if __name__ == "__main__":
    main()
