"""The trainer's step loop against a scripted control log and params topic (no broker).

The test plays the coordinator and the slice owners: it reads what the runner sends
(GradSlices, Contributions) from a fake producer and answers with StepCloses, Rejections and
ParamSlices fed to the runner's log handlers, as its followers would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from faults import BatchComputedTwice
from opentelemetry.context import Context

from conveyor.platform.bus import Received, Tailed
from conveyor.platform.bus.offsets import PartitionOffsets
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    AppliedContribution,
    Batch,
    Contribution,
    GradSlice,
    JobPlanned,
    Message,
    ParamSlice,
    Rejection,
    StepClose,
    Topics,
    sample_ids_tensor,
)
from conveyor.services.trainer.compute.session import prepare_job
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.data.prefetch import DeviceCopier, Prefetcher
from conveyor.services.trainer.reporting.metrics import TrainerMetrics
from conveyor.services.trainer.runner import JobRunner
from conveyor.training.jobview import JobView

pytestmark = pytest.mark.timeout(60)

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
    partitions: frozenset[tuple[str, int]] = frozenset({(TOPICS.batches(JOB), 0)})

    def ack(self, received: Received) -> None:
        self.acked.append(received.offset)

    joined_group: asyncio.Event = field(default_factory=asyncio.Event)

    def assignment(self) -> frozenset[tuple[str, int]]:
        return self.partitions

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
    mode: str, staleness: int = 0, window: int | None = None, overlap: int = 0
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
            "optimizer": {"name": "sgd", "lr": 0.1},
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
) -> AsyncIterator[Harness]:
    """``joined``: the batches consumer has joined its group already."""
    view = JobView(
        job_id=JOB, name="steps", spec=spec(mode, staleness, window, overlap), idempotency_key=None,
        submitted_at=0.0, updated_at=0.0, stage_window=8, state="planned", plan=PLAN,
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


async def test_sync_waits_for_the_close_and_every_slice_then_recomputes_a_rejection() -> None:
    async with harness("sync") as h:
        h.feed(0, 1, 2, 3)
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [first] = h.contributions()
        slices = h.producer.of(GradSlice)
        assert first.contribution_id == f"{ME}:0" and first.base_version == 0
        # Alone (no allocation yet): the whole step's 2 micro-batches.
        assert first.batch_ids == [f"{JOB}:e0:train:00000:b000", f"{JOB}:e0:train:00000:b001"]
        assert first.num_samples == 4 and first.grad_bytes == sum(
            s.values.numel() * 4 for s in slices
        )
        # What it computed on: the batches' sample ids in compute order, and their epoch.
        assert first.sample_ids.tolist() == [0, 1, 2, 3] and first.epoch == 0
        # Every slice went out, each to its own partition, before the Contribution.
        assert [(m.slice_index, p) for _, m, p in h.producer.sent if isinstance(m, GradSlice)] == [
            (0, 0), (1, 1),
        ]  # fmt: skip
        assert isinstance(h.producer.sent[2][1], Contribution)

        await asyncio.sleep(0.4)
        assert len(h.contributions()) == 1  # sync: nothing more before version 1 closes
        h.log(close(1, [first], {ME: 1, "w-b": 1}))
        assert sorted(h.consumer.acked) == [0, 1]  # exactly the batches the close lists
        h.params(1, range(1))  # one slice of version 1 is not enough
        await asyncio.sleep(0.4)
        assert len(h.contributions()) == 1
        h.params(1, range(1, 2))
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        second = h.contributions()[1]
        assert second.base_version == 1 and len(second.batch_ids) == 1  # the allocation: 1
        assert h.runner.loaded_version == 1

        # Rejected: the same batch is recomputed on the (unchanged) current version.
        h.log(Rejection(job_id=JOB, contribution_id=second.contribution_id, worker_id=ME,
                        current_version=1, reason="test"))  # fmt: skip
        await h.producer.wait_for(lambda: len(h.contributions()) == 3)
        third = h.contributions()[2]
        assert third.batch_ids == second.batch_ids and third.base_version == 1
        assert third.contribution_id == f"{ME}:2" and h.runner.figures.rejected == 1
        assert sorted(h.consumer.acked) == [0, 1]  # nothing acked for the rejected one


async def test_sync_sends_an_empty_contribution_without_data() -> None:
    async with harness("sync") as h:
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [empty] = h.contributions()
        assert empty.num_samples == 0 and empty.batch_ids == [] and empty.grad_bytes == 0
        assert empty.sample_ids.numel() == 0 and empty.epoch == 0
        assert h.producer.of(GradSlice) == []  # an empty contribution has no slices
        h.log(close(1, [empty], {ME: 2}))
        h.feed(4, 5)
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        assert h.contributions()[1].num_samples == 4
        assert h.runner.figures.empty_contributions == 1


async def test_ssp_keeps_at_most_staleness_contributions_outstanding() -> None:
    async with harness("ssp", staleness=1) as h:
        h.feed(*range(10))
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        await asyncio.sleep(0.4)
        first, second = h.contributions()
        assert len(h.contributions()) == 2  # 2 outstanding > bound 1: no third step
        assert first.base_version == second.base_version == 0
        h.log(close(1, [first], {}))
        await asyncio.sleep(0.4)
        # Version 1 closed but its parameters are not in: a step on version 0 would arrive
        # with staleness >= 2 (version 1, then the outstanding one): wait instead.
        assert len(h.contributions()) == 2
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 3)
        assert h.contributions()[2].base_version == 1
        h.log(close(2, [second], {}))
        h.params(2)
        await h.producer.wait_for(lambda: len(h.contributions()) == 4)
        assert h.contributions()[3].base_version == 2
        assert sorted(h.consumer.acked) == [0, 1, 2, 3]


async def test_ssp_counts_every_trainers_undecided_contributions() -> None:
    async with harness("ssp", staleness=1) as h:
        h.params(0)
        others = [
            Contribution(
                job_id=JOB, contribution_id=f"w-b:{k}", worker_id="w-b", base_version=0,
                num_samples=2, batch_ids=[f"{JOB}:e0:train:00001:b00{k}"], epoch=0,
                sample_ids=sample_ids_tensor([100 + 2 * k, 101 + 2 * k]), loss_sum=1.0,
                grad_bytes=0, sent_at=time.time(),
            )
            for k in range(2)
        ]  # fmt: skip
        h.log(*others)  # two of another trainer's wait for their decision: 2 > bound 1
        h.feed(0, 1, 2, 3)
        await asyncio.sleep(0.5)
        assert h.contributions() == []
        h.log(close(1, others[:1], {}))
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        assert h.contributions()[0].base_version == 1


async def test_batches_of_a_revoked_partition_are_left_to_its_new_owner() -> None:
    async with harness("sync") as h:
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)  # empty: no data yet
        h.feed(0, 1)
        await asyncio.sleep(0.1)
        h.consumer.partitions = frozenset()  # a rebalance gave partition 0 to another trainer
        h.log(close(1, h.contributions(), {ME: 2}))
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        assert h.contributions()[1].batch_ids == []  # nothing trained twice
        assert h.consumer.acked == []


async def test_redelivered_and_already_applied_batches_are_skipped() -> None:
    async with harness("sync") as h:
        applied = Contribution(
            job_id=JOB, contribution_id="w-b:0", worker_id="w-b", base_version=0, num_samples=2,
            batch_ids=[f"{JOB}:e0:train:00000:b000"], epoch=0, sample_ids=sample_ids_tensor([0, 1]),
            loss_sum=1.0, grad_bytes=0, sent_at=0.0,
        )  # fmt: skip
        h.log(close(1, [applied], {ME: 2}))
        h.feed(0, 1, 1)  # b000 applied by w-b; b001 twice
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [mine] = h.contributions()
        assert mine.batch_ids == [f"{JOB}:e0:train:00000:b001"] and mine.base_version == 1
        assert h.consumer.acked == [0]  # the applied one at once; the copies wait for the log
        h.log(close(2, [mine], {ME: 2}))
        assert sorted(h.consumer.acked) == [0, 1, 2]  # both deliveries of b001
        assert h.runner.figures.duplicates == 2


async def test_a_micro_batch_computed_twice_is_reported_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The contribution's sample ids are what the step computed, not what its batch ids
    imply: a micro-batch run twice (an injected fault) shows twice, its batch id once."""
    fault = BatchComputedTwice(ME)
    fault.install(monkeypatch)
    async with harness("sync") as h:
        h.feed(0, 1)
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [doubled] = h.contributions()
        assert fault.batch_id == f"{JOB}:e0:train:00000:b000" and fault.sample_ids == [0, 1]
        assert doubled.batch_ids == [f"{JOB}:e0:train:00000:b000", f"{JOB}:e0:train:00000:b001"]
        assert doubled.sample_ids.tolist() == [0, 1, 2, 3, 0, 1] and doubled.num_samples == 6


async def test_a_fresh_job_takes_no_step_before_its_batches_group_is_joined() -> None:
    async with harness("sync", joined=False) as h:
        h.params(0)
        await asyncio.sleep(0.5)  # > empty_contribution_wait_s: it would have sent an empty one
        assert h.contributions() == []
        h.consumer.joined_group.set()
        h.feed(0, 1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        assert h.contributions()[0].num_samples == 4  # its first step has the data


def other_trainers_close(version: int, ks: range, allocation: dict[str, int]) -> StepClose:
    """Version ``version`` closed with w-b's contribution of batches ``ks`` (shard 00001)."""
    theirs = Contribution(
        job_id=JOB, contribution_id="w-b:0", worker_id="w-b", base_version=version - 1,
        num_samples=2 * len(ks), batch_ids=[f"{JOB}:e0:train:00001:b{k:03d}" for k in ks],
        epoch=0, sample_ids=sample_ids_tensor([i for k in ks for i in (100 + 2 * k, 101 + 2 * k)]),
        loss_sum=1.0, grad_bytes=0, sent_at=0.0,
    )  # fmt: skip
    return close(version, [theirs], allocation)


async def test_a_local_window_waits_for_no_batch_past_the_epochs_whole_steps() -> None:
    """7 of the epoch's 10 batches are left for 2 trainers taking 1 each per inner step: 3
    whole steps and a remainder that either trainer may hold. Past the 3 steps a step takes
    what has arrived and waits for nothing (a 60 s wait here would time the test out)."""
    async with harness("local", window=8, empty_wait_s=60.0) as h:
        h.log(other_trainers_close(1, range(3), {ME: 1, "w-b": 1}))
        h.feed(0, 1, 2, 3)
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [window] = h.contributions()
        assert window.base_version == 1 and window.inner_steps == [1, 1, 1, 1]
        assert window.batch_ids == [f"{JOB}:e0:train:00000:b{k:03d}" for k in range(4)]


def ids(*ks: int) -> list[str]:
    return [f"{JOB}:e0:train:00000:b{k:03d}" for k in ks]


async def overlapped(h: Harness, steps: int) -> None:
    async with asyncio.timeout(20):
        while h.runner.figures.overlapped_steps < steps:  # noqa: ASYNC110 (a figure: no event)
            await asyncio.sleep(0.01)


async def test_local_overlapped_steps_run_before_the_close_and_finish_on_the_new_version() -> None:
    async with harness("local", window=2, overlap=1) as h:
        h.feed(*range(8))
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [first] = h.contributions()
        assert first.inner_steps == [2, 2] and first.carried_steps == 0
        await overlapped(h, 1)  # batches 4 and 5, while version 1 is not decided
        assert h.runner.loaded_version == 0 and len(h.contributions()) == 1
        h.log(close(1, [first], {ME: 2}))
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        second = h.contributions()[1]
        assert (second.base_version, second.inner_steps, second.carried_steps) == (1, [2, 2], 1)
        assert second.batch_ids == ids(4, 5, 6, 7)
        assert h.runner.figures.overlapped_steps == 1  # the close was in: no second overlap


async def test_local_overlapped_steps_of_a_rejected_window_are_recomputed_from_its_version() -> (
    None
):
    async with harness("local", window=2, overlap=1) as h:
        h.feed(*range(8))
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [first] = h.contributions()
        await overlapped(h, 1)
        h.log(Rejection(job_id=JOB, contribution_id=first.contribution_id, worker_id=ME,
                        current_version=0, reason="test"))  # fmt: skip
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        second = h.contributions()[1]
        # Not moved onto anything: the window starts afresh on version 0 and takes the
        # overlapped batches back first, then the rejected window's.
        assert (second.base_version, second.carried_steps) == (0, 0)
        assert second.batch_ids == ids(4, 5, 0, 1) and second.inner_steps == [2, 2]


async def test_a_sync_step_waits_out_a_rebalance_instead_of_sending_empty_steps() -> None:
    """While the batches group rebalances no batch can come to anyone: an empty contribution
    every empty_contribution_wait_s would make a version without samples each time."""
    async with harness("sync") as h:
        h.feed(0, 1)
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        h.log(close(1, h.contributions(), {ME: 2}))
        h.consumer.settled_group.clear()  # a trainer joins: the group rebalances
        h.params(1)
        await asyncio.sleep(0.6)  # 3 x empty_contribution_wait_s
        assert len(h.contributions()) == 1
        h.feed(2, 3)  # the new assignment delivers
        h.consumer.settled_group.set()
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        second = h.contributions()[1]
        assert second.base_version == 1 and second.batch_ids == ids(2, 3)
        assert h.runner.figures.empty_contributions == 0
