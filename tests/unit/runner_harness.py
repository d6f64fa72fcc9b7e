"""The harness of the trainer's step-loop tests (test_trainer_runner_*.py): a JobRunner against
a scripted control log and params topic (no broker), with a fake producer that records what the
runner sends and a fake consumer and queue that feed it batches; ``close`` builds the StepClose
the test answers with, as the coordinator would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from aiokafka import TopicPartition
from opentelemetry.context import Context

from conveyor.platform.bus import Received, Tailed
from conveyor.platform.bus.offsets import PartitionOffsets
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    AppliedContribution,
    Batch,
    Contribution,
    JobPlanned,
    Message,
    ParamSlice,
    StepClose,
    Topics,
)
from conveyor.services.trainer.compute.session import prepare_job
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.data.prefetch import DeviceCopier, Prefetcher
from conveyor.services.trainer.reporting.metrics import TrainerMetrics
from conveyor.services.trainer.runner import JobRunner
from conveyor.training.jobview import JobView

JOB = "j1"


ME = "w-a"


TOPICS = Topics("t.")


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Message, int | None]] = []
        self.changed = asyncio.Event()

    async def send(
        self, topic: str, message: Message, *, key: Any = None, partition: int | None = None
    ) -> asyncio.Future[None]:
        self.sent.append((topic, message, partition))
        self.changed.set()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def publish(self, topic: str, message: Message, **kwargs: Any) -> None:
        await self.send(topic, message, **kwargs)

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for _, m, _ in self.sent if isinstance(m, kind)]

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


@dataclass
class FakeConsumer:
    acked: list[int] = field(default_factory=list)
    in_flight: int = 0
    partitions: frozenset[TopicPartition] = frozenset({TopicPartition(TOPICS.batches(JOB), 0)})

    def ack(self, received: Received) -> None:
        self.acked.append(received.offset)

    joined_group: asyncio.Event = field(default_factory=asyncio.Event)

    def assignment(self) -> frozenset[TopicPartition]:
        return self.partitions

    reads: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    """Partition -> (read position, high-water mark) that :meth:`offsets` reports."""

    def offsets(self, topic: str, partition: int) -> tuple[int | None, int | None]:
        return self.reads.get(partition, (None, None))

    async def joined(self) -> None:
        await self.joined_group.wait()

    settled_group: asyncio.Event = field(default_factory=asyncio.Event)
    """Cleared: a rebalance is under way (once joined)."""

    @property
    def rebalancing(self) -> bool:
        return self.joined_group.is_set() and not self.settled_group.is_set()

    async def settled(self) -> None:
        await self.settled_group.wait()


class QueueSource:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Received] = asyncio.Queue()

    async def get(self) -> Received:
        return await self.queue.get()


def batch_record(offset: int, k: int, epoch: int = 0, split: str = "train") -> Received:
    generator = torch.Generator().manual_seed(k)
    batch = Batch(
        job_id=JOB,
        batch_id=f"{JOB}:e{epoch}:{split}:00000:b{k:03d}",
        shard_id=f"{JOB}:e{epoch}:{split}:00000",
        epoch=epoch,
        split=split,
        sample_ids=[2 * k, 2 * k + 1],
        x=torch.randint(0, 256, (2, 1, 8, 8), dtype=torch.uint8, generator=generator),
        y=torch.tensor([k % 10, (k + 1) % 10]),
        timestamps={"sent": 1.0},
    )
    return Received(
        topic=TOPICS.batches(JOB), partition=0, offset=offset, key=None, message=batch,
        headers={}, timestamp_ms=0, size_bytes=0, context=Context(), _offsets=PartitionOffsets(),
    )  # fmt: skip


def spec(
    mode: str,
    staleness: int = 0,
    window: int | None = None,
    overlap: int = 0,
    optimizer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    local = {"sync_every_steps": window} if window is not None else {}
    if overlap:
        local["overlap_steps"] = overlap
    return {
        "name": "steps",
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {
            "epochs": 1, "global_batch_size": 4, "micro_batch_size": 2,
            "optimizer": optimizer or {"name": "sgd", "lr": 0.1},
        },
        "distribution": {"aggregator_shards": 2, "mode": mode, "staleness": staleness, **local},
        "resources": {"device": "cpu"},
    }  # fmt: skip


PLAN = JobPlanned(
    job_id=JOB, num_train=20, num_eval=2, num_classes=10, sample_shape=[1, 8, 8],
    train_batches_per_epoch=10, eval_batches_per_epoch=1, steps_per_epoch=5, shards_per_epoch=2,
    batches_topic=TOPICS.batches(JOB), control_topic=TOPICS.control(JOB), batches_partitions=1,
)  # fmt: skip


@dataclass
class Harness:
    runner: JobRunner
    producer: FakeProducer
    consumer: FakeConsumer
    source: QueueSource
    offset: int = 0

    def feed(self, *ks: int, split: str = "train") -> None:
        for k in ks:
            self.source.queue.put_nowait(batch_record(self.offset, k, split=split))
            self.offset += 1

    def log(self, *messages: Message) -> None:
        """Deliver control messages as the control follower does."""
        self.runner._on_control([_tailed(TOPICS.control(JOB), m) for m in messages])

    def params(self, version: int, slices: range | None = None) -> None:
        """Publish (parts of) version ``version``: the seeded model's values + version."""
        session = self.runner.session
        flat = session.layout.flatten_params(session.model).detach() * 0 + version
        for p in slices if slices is not None else range(session.num_slices):
            start, stop = session.bounds[p]
            part = ParamSlice(
                job_id=JOB, slice_index=p, version=version, values=flat[start:stop].clone(),
                published_at=0.0,
            )  # fmt: skip
            self.runner._on_params([_tailed(TOPICS.params(JOB), part)])

    def contributions(self) -> list[Contribution]:
        return self.producer.of(Contribution)


def _tailed(topic: str, message: Message) -> Tailed:
    return Tailed(topic=topic, partition=0, offset=0, message=message, timestamp_ms=0, size_bytes=0)


@asynccontextmanager
async def harness(
    mode: str,
    staleness: int = 0,
    *,
    window: int | None = None,
    overlap: int = 0,
    empty_wait_s: float = 0.2,
    joined: bool = True,
    placed: tuple[str, ...] = (ME,),
    optimizer: dict[str, Any] | None = None,
) -> AsyncIterator[Harness]:
    """``joined``: the batches consumer has joined its group already; ``placed``: the
    trainers the schedule puts on the job; ``optimizer``: the job's (SGD lr 0.1 if None)."""
    view = JobView(
        job_id=JOB, name="steps", spec=spec(mode, staleness, window, overlap, optimizer),
        idempotency_key=None, submitted_at=0.0, updated_at=0.0, stage_window=8, state="planned",
        plan=PLAN,
    )  # fmt: skip
    settings = TrainerSettings(worker_id=ME, empty_contribution_wait_s=empty_wait_s)
    session = prepare_job(view, settings, TOPICS)
    producer, consumer, source = FakeProducer(), FakeConsumer(), QueueSource()
    if joined:
        consumer.joined_group.set()
        consumer.settled_group.set()
    compute, copy = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    runner = JobRunner(
        session,
        settings=settings,
        kafka=KafkaSettings(topic_prefix="t."),
        producer=producer,  # type: ignore[arg-type]
        metrics=TrainerMetrics(),
        compute_executor=compute,
        copy_executor=copy,
        placed_trainers=lambda: placed,
    )
    prefetch = Prefetcher(
        source, DeviceCopier(torch.device("cpu")), job_id=JOB, depth=4, consumer_group="g",
        reject=runner.intake.reject,
    )  # fmt: skip
    runner.intake.attach(consumer, prefetch)  # type: ignore[arg-type]
    tasks = [asyncio.create_task(prefetch.run()), asyncio.create_task(runner._train())]
    try:
        yield Harness(runner, producer, consumer, source)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        compute.shutdown()
        copy.shutdown()


def close(version: int, contributions: list[Contribution], allocation: dict[str, int]) -> StepClose:
    return StepClose(
        job_id=JOB,
        version=version,
        contributions=[
            AppliedContribution(
                contribution_id=c.contribution_id,
                worker_id=c.worker_id,
                base_version=c.base_version,
                num_samples=c.num_samples,
                staleness=0,
            )
            for c in contributions
        ],
        batch_ids=[b for c in contributions for b in c.batch_ids],
        num_samples=sum(c.num_samples for c in contributions),
        epoch=0,
        lr=0.1,
        allocation=allocation,
        closed_at=0.0,
    )


def ids(*ks: int) -> list[str]:
    return [f"{JOB}:e0:train:00000:b{k:03d}" for k in ks]
