"""The trainer's step loop against a scripted control log and params topic (no broker): the
distribution modes. Sync waits for the close and every slice (and recomputes a rejection) or
sends an empty contribution, ssp bounds the contributions outstanding, local windows wait for no
batch past the epoch's whole steps and run overlapped steps before the close.

The test plays the coordinator and the slice owners: it reads what the runner sends
(GradSlices, Contributions) from a fake producer and answers with StepCloses, Rejections and
ParamSlices fed to the runner's log handlers, as its followers would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
import torch
from runner_harness import JOB, ME, Harness, close, harness, ids

from conveyor.platform.messages import (
    Contribution,
    GradSlice,
    Rejection,
    StepClose,
    sample_ids_tensor,
)

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


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


async def test_the_first_step_takes_its_share_of_the_trainers_placed_on_the_job() -> None:
    # No other trainer's heartbeat is on the log yet, but the schedule placed w-b on the job:
    # the first step takes half of the 2 micro-batches, not the whole step beside w-b's half.
    async with harness("sync", placed=(ME, "w-b")) as h:
        h.feed(0, 1, 2, 3)
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [first] = h.contributions()
        assert first.batch_ids == ids(0) and first.num_samples == 2
        h.log(close(1, [first], {ME: 2}))  # the allocation decides from here on
        h.params(1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        assert h.contributions()[1].batch_ids == ids(1, 2)


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


class CountingExecutor(ThreadPoolExecutor):
    """One compute thread that records the name of every call handed to it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.calls: list[str] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self.calls.append(fn.__name__)
        return super().submit(fn, *args, **kwargs)


async def test_a_local_inner_step_rides_in_its_last_micro_batchs_compute_call() -> None:
    # One hand-off to the compute thread per micro-batch: the inner step runs in the call of
    # its last one. A step that got fewer micro-batches than it wanted (the second: batch 2
    # alone, none more within the 0.2 s wait) takes a call of its own.
    async with harness("local", window=2) as h:
        h.runner._compute_executor = compute = CountingExecutor()
        try:
            h.feed(0, 1, 2)
            h.params(0)
            await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        finally:
            compute.shutdown()
        [window] = h.contributions()
        assert window.batch_ids == ids(0, 1, 2) and window.inner_steps == [2, 1]
        assert compute.calls == [
            "load",
            "accumulate",
            "accumulate_and_step",
            "accumulate",
            "inner_step",
            "delta",
        ]


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


MOMENTUM = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def window_slices(h: Harness, contribution: Contribution) -> list[torch.Tensor]:
    sent = [
        m for m in h.producer.of(GradSlice) if m.contribution_id == contribution.contribution_id
    ]
    return [m.values for m in sorted(sent, key=lambda m: m.slice_index)]


async def fresh_window(*batches: int) -> list[torch.Tensor]:
    """The delta a trainer that never ran a window sends for ``batches`` on version 0."""
    async with harness("local", window=2, optimizer=MOMENTUM) as h:
        h.feed(*batches)
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [window] = h.contributions()
        assert window.batch_ids == ids(*batches)
        return window_slices(h, window)


@pytest.mark.parametrize("overlap", [0, 1])
async def test_a_rejected_local_window_leaves_nothing_in_the_inner_optimizer(overlap: int) -> None:
    # With momentum, the window recomputed on version 0 after a rejection sends what a fresh
    # trainer sends for its batches only if the rejected window's steps left no momentum
    # behind (nor did the steps overlapped after it, which are dropped with it).
    async with harness("local", window=2, overlap=overlap, optimizer=MOMENTUM) as h:
        h.feed(*range(4 + 2 * overlap))
        h.params(0)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        [first] = h.contributions()
        assert first.batch_ids == ids(0, 1, 2, 3)
        if overlap:  # batches 4 and 5, while the window is not decided
            await overlapped(h, 1)
        h.log(Rejection(job_id=JOB, contribution_id=first.contribution_id, worker_id=ME,
                        current_version=0, reason="test"))  # fmt: skip
        await h.producer.wait_for(lambda: len(h.contributions()) == 2)
        second = h.contributions()[1]
        assert (second.base_version, second.inner_steps) == (0, [2, 2])
        recomputed = window_slices(h, second)
    batches = (4, 5, 0, 1) if overlap else (0, 1, 2, 3)
    assert second.batch_ids == ids(*batches)
    expected = await fresh_window(*batches)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, expected, strict=True))
