"""The trainer's step loop against a scripted control log and params topic (no broker): which
batches it computes. Batches of a revoked partition are left to its new owner, redelivered and
already applied ones are skipped, a micro-batch computed twice is reported twice, a fresh job
takes no step before its batches group is joined, a sync step waits out a rebalance, a
trainer starved of batches says where its reads stand.

The test plays the coordinator and the slice owners: it reads what the runner sends
(GradSlices, Contributions) from a fake producer and answers with StepCloses, Rejections and
ParamSlices fed to the runner's log handlers, as its followers would.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from faults import BatchComputedTwice
from runner_harness import JOB, ME, close, harness, ids

from conveyor.platform.messages import Contribution, sample_ids_tensor
from conveyor.services.trainer.data import intake as intake_module

pytestmark = pytest.mark.timeout(60)


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
        assert h.runner.plane.listener.paused  # the plane's readers rest through the join
        h.consumer.joined_group.set()
        h.feed(0, 1)
        await h.producer.wait_for(lambda: len(h.contributions()) == 1)
        assert h.contributions()[0].num_samples == 4  # its first step has the data
        await asyncio.sleep(0.2)
        assert not h.runner.plane.listener.paused  # they fetch while it waits for the close


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


async def test_a_starved_trainer_logs_what_is_left_and_where_its_reads_stand(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A read position below the high-water mark: the batches are on the log, not delivered.
    monkeypatch.setattr(intake_module, "STARVED_WARN_S", 0.3)
    caplog.set_level(logging.WARNING, logger=intake_module.__name__)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no batch for" in r.getMessage()]

    async with harness("sync", empty_wait_s=0.1) as h:
        h.consumer.reads = {0: (3, 5)}
        for version in range(20):
            h.params(version)

            def contributed(n: int = version + 1) -> bool:
                return len(h.contributions()) == n

            await h.producer.wait_for(contributed)
            if warnings():
                break
            assert h.contributions()[-1].batch_ids == []
            h.log(close(version + 1, h.contributions()[-1:], {ME: 2}))
    message = warnings()[0]
    assert "epoch 0 has 10 of 10 train batches left to apply" in message, message
    assert "{0: (3, 5)}" in message and "'queued_batches': 0" in message, message
