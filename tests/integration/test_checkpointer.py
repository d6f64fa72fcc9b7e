"""The checkpointer and a job's final checkpoint, against the real broker and a file store,
with a real aggregator and the scripted trainer peer (see test_aggregator.py).

A job that ended while no checkpointer ran gets its final checkpoint committed by the next
one that starts (manifest, ``latest``, keep_last, one ``checkpoint`` event), from its slice
files alone; a missing or torn slice file is a logged reason and no commit. A job whose end a
checkpointer saw is committed once: neither that process nor the next one commits it again.
It is committed also when the checkpointer's control reader lags the jobs topic at the end,
and when the job ends while its commit is under way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aggregator_peer import Peer
from serving import running
from test_aggregator import SPEC, WORKERS, aggregator, checkpointer, committed_versions, submit

from conveyor.platform.bus import Tailed, TopicTail
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.messages import CheckpointCommitted, Topics
from conveyor.platform.storage import open_store
from conveyor.services.checkpointer import service as checkpointer_service
from conveyor.services.checkpointer.config import CheckpointerSettings
from conveyor.services.checkpointer.service import CheckpointerService
from conveyor.training.checkpoint import CheckpointStore, Manifest, latest_key, slice_key

KEEP_LAST = 2
ONE_EPOCH: dict[str, Any] = {
    **SPEC,
    "training": {**SPEC["training"], "epochs": 1},
    "checkpoint": {"every_steps": 1, "keep_last": KEEP_LAST},
}
"""15 train batches in steps of 4: v1..v3 (every_steps) and v4, the job's end."""
FINAL = 4


@pytest.fixture
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    """Short session, as in test_aggregator.py: the embedded broker completes a join after
    half of it."""
    return KafkaSettings(
        bootstrap=kafka_bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        session_timeout_s=4.0,
        heartbeat_interval_s=0.5,
    )


async def train(peer: Peer, version: int, until: int, queue: list[str]) -> list[str]:
    """Sync steps from ``version`` to ``until`` (each worker its share of every close's
    allocation); returns the batches left."""
    per_step = peer.ctx.spec.micro_batches_per_step
    for base in range(version, until):

        def has_params(v: int = base) -> bool:
            return peer.has_params(v)

        def closed(v: int = base) -> bool:
            return v + 1 in peer.closes

        await peer.wait_for(has_params)
        close = peer.closes.get(base)
        allocation = close.allocation if close else dict.fromkeys(WORKERS, per_step // 2)
        for worker in sorted(WORKERS):
            take, queue = queue[: allocation[worker]], queue[allocation[worker] :]
            await peer.contribute(worker, base, take)
        await peer.wait_for(closed)
    assert not peer.rejections
    return queue


async def checkpoint_events(kafka: KafkaSettings, job_id: str) -> list[int]:
    """Versions of the job's ``checkpoint`` events on the whole jobs topic as it is now."""
    versions: list[int] = []
    jobs = Topics(kafka.topic_prefix).jobs
    async with TopicTail(kafka, jobs, types=[CheckpointCommitted]) as tail:
        async with asyncio.timeout(30):
            while not tail.caught_up:
                for record in await tail.get_many(0.2):
                    message = record.message
                    if isinstance(message, CheckpointCommitted) and message.job_id == job_id:
                        versions.append(message.version)
    return versions


def latest_version(objects: Path, job_id: str) -> int:
    version: int = json.loads((objects / latest_key(job_id)).read_bytes())["version"]
    return version


async def settled(service: CheckpointerService, job_id: str, timeout_s: float = 30.0) -> None:
    """Until the service's pass over the completed jobs dealt with ``job_id``."""
    async with asyncio.timeout(timeout_s):
        while (job_id, 0) not in service.finals_settled:  # noqa: ASYNC110 - a set: no event
            await asyncio.sleep(0.05)


async def run_job(
    stack: AsyncExitStack, kafka: KafkaSettings, objects: Path
) -> tuple[Peer, CheckpointStore]:
    """A one-epoch job submitted, an aggregator and the peer, the job's params at v0; the
    peer and the job's checkpoints in the file store at ``objects``."""
    ctx, data = await submit(kafka, ONE_EPOCH)
    await stack.enter_async_context(aggregator(kafka, objects))
    peer = await stack.enter_async_context(Peer(kafka, ctx, data, WORKERS))
    await peer.wait_for(lambda: peer.has_params(0))
    return peer, CheckpointStore(open_store(f"file://{objects}"), ctx.job_id)


async def to_the_final_commit(
    stack: AsyncExitStack, kafka: KafkaSettings, objects: Path, service: CheckpointerService
) -> tuple[Peer, CheckpointStore]:
    """:func:`run_job` with ``service`` running from before the first step to the job's end,
    until the final checkpoint's ``checkpoint`` event."""
    peer, checkpoints = await run_job(stack, kafka, objects)
    await stack.enter_async_context(running(service))
    await finish(peer, 0, peer.train_batches(0), asyncio.create_task(peer.evaluate_epochs(1)))
    await peer.wait_for(lambda: FINAL in committed_versions(peer), 30)
    return peer, checkpoints


def checkpointer_without_the_pass(kafka: KafkaSettings, objects: Path) -> CheckpointerService:
    """A checkpointer whose pass over the completed jobs (which commits a final checkpoint from
    the store) is 300 s away: what commits in a test is the job's own task."""
    return CheckpointerService(
        settings=CheckpointerSettings(poll_s=0.05, registry_interval_s=300),
        kafka=kafka,
        storage=StorageSettings(uri=f"file://{objects}"),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )


async def finish(
    peer: Peer, version: int, queue: list[str], evaluating: asyncio.Task[None]
) -> None:
    """Train from ``version`` to the job's end; until ``completed``."""
    await train(peer, version, FINAL, queue)
    await evaluating
    await peer.wait_for(lambda: bool(peer.event("completed")), 60)
    assert len(peer.closes) == FINAL and peer.closes[FINAL].checkpoint == "job_end"
    assert peer.event("completed")[0].details()["summary"]["versions"] == FINAL


async def test_a_job_that_ended_with_no_checkpointer_gets_its_final_checkpoint_on_start(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        peer, checkpoints = await run_job(stack, kafka, tmp_path)
        ctx, job_id = peer.ctx, peer.ctx.job_id
        evaluating = asyncio.create_task(peer.evaluate_epochs(1))
        async with running(checkpointer(kafka, tmp_path)):
            queue = await train(peer, 0, 2, peer.train_batches(0))
            await peer.wait_for(lambda: 2 in committed_versions(peer), 30)
        # The checkpointer is down from here to the job's end.
        await finish(peer, 2, queue, evaluating)
        # The defect as users saw it: the end of the job is not in its checkpoints.
        assert checkpoints.committed_versions() == [2, 1]
        assert latest_version(tmp_path, job_id) == 2
        started = time.time()
        async with running(checkpointer(kafka, tmp_path)):
            await peer.wait_for(lambda: FINAL in committed_versions(peer), 30)
        summary = peer.event("completed")[0].details()["summary"]
        (event,) = [
            e.details() for e in peer.event("checkpoint") if e.details()["version"] == FINAL
        ]
    assert (event["trigger"], event["step"]) == ("job_end", summary["steps"])
    # keep_last 2: v1 deleted, and v3 (never committed) with it as a leftover.
    assert checkpoints.committed_versions() == [FINAL, 2]
    assert [r.version for r in checkpoints.listing()] == [FINAL, 2]
    assert latest_version(tmp_path, job_id) == FINAL
    manifest, states, skipped = checkpoints.latest_good()
    assert manifest is not None and manifest.version == FINAL and not skipped
    assert manifest.created_at >= started
    assert (manifest.trigger, manifest.step) == ("job_end", summary["steps"])
    cursor = manifest.data_cursor
    assert (cursor.epoch, cursor.applied_batches) == (1, [])  # the one epoch ended
    assert cursor.samples_trained == summary["samples"] == ctx.plan.num_train
    for index, (first, end) in enumerate(ctx.bounds):
        assert states[index].values.equal(peer.flat_params(FINAL)[first:end])
    # The next checkpointer finds it committed.
    service = checkpointer(kafka, tmp_path)
    async with running(service):
        await settled(service, job_id)
    assert await checkpoint_events(kafka, job_id) == [1, 2, FINAL]


async def test_a_missing_or_torn_final_slice_file_is_a_reason_and_no_commit(
    kafka: KafkaSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncExitStack() as stack:
        peer, checkpoints = await run_job(stack, kafka, tmp_path)
        job_id = peer.ctx.job_id
        # No checkpointer runs before the job ends.
        await finish(peer, 0, peer.train_batches(0), asyncio.create_task(peer.evaluate_epochs(1)))
    path = tmp_path / slice_key(job_id, FINAL, 1)
    written = path.read_bytes()
    for damage in ("missing", "torn"):
        if damage == "missing":
            path.unlink()
        else:
            path.write_bytes(written[: len(written) // 2])
        caplog.clear()
        with caplog.at_level(logging.WARNING, "conveyor.services.checkpointer.service"):
            service = checkpointer(kafka, tmp_path)
            async with running(service) as serving:
                await settled(service, job_id)
                assert not serving.done() and service.readiness()  # it goes on
        (record,) = [r.getMessage() for r in caplog.records if f"v{FINAL}" in r.getMessage()]
        assert slice_key(job_id, FINAL, 1) in record, record
        assert ("not found" if damage == "missing" else "sha256") in record, record
        assert checkpoints.committed_versions() == []
    assert await checkpoint_events(kafka, job_id) == []
    # Intact again: the next checkpointer commits it; keep_last clears v1..v3's leftovers.
    path.write_bytes(written)
    service = checkpointer(kafka, tmp_path)
    async with running(service):
        await settled(service, job_id)
    assert await checkpoint_events(kafka, job_id) == [FINAL]
    assert [(r.version, r.state, r.latest) for r in checkpoints.listing()] == [
        (FINAL, "committed", True)
    ]


async def test_a_final_checkpoint_committed_at_the_jobs_end_is_not_committed_again(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        service = checkpointer(kafka, tmp_path)
        peer, checkpoints = await to_the_final_commit(stack, kafka, tmp_path, service)
        ctx = peer.ctx
        # Both ways to the final commit were open in this process: its task, and its pass
        # over the completed jobs once the task let the job go.
        await settled(service, ctx.job_id)
    assert await checkpoint_events(kafka, ctx.job_id) == [1, 2, 3, FINAL]
    assert checkpoints.committed_versions() == [FINAL, 3]


async def test_a_control_reader_behind_the_jobs_end_still_commits_the_final_checkpoint(
    kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jobs topic and the control topic are read apart: the checkpointer can see
    ``completed`` before its control reader reached the final checkpoint's announcements
    (the aggregator published them first). Letting the job go then must still commit it,
    from the announcements; the pass over the completed jobs, which would commit it from the
    store, is a long interval away here."""
    service = checkpointer_without_the_pass(kafka, tmp_path)

    def completed_here(job_id: str) -> bool:
        job = service.view.get(job_id)
        return job is not None and job.state == "completed"

    class LaggingTail(TopicTail):
        """A control reader that reads nothing until its process saw the job complete."""

        async def get_many(self, timeout_s: float) -> list[Tailed]:
            if not any(completed_here(job.job_id) for job in service.view.list()):
                await asyncio.sleep(timeout_s)
                return []
            return await super().get_many(timeout_s)

    monkeypatch.setattr(checkpointer_service, "TopicTail", LaggingTail)
    async with AsyncExitStack() as stack:
        peer, checkpoints = await to_the_final_commit(stack, kafka, tmp_path, service)
        job_id = peer.ctx.job_id
        assert completed_here(job_id) and job_id not in service.hosted_jobs
        assert (job_id, 0) not in service.finals_settled  # not by the pass: by the let-go
    assert await checkpoint_events(kafka, job_id) == [1, 2, 3, FINAL]
    assert checkpoints.committed_versions() == [FINAL, 3]
    manifest, _, skipped = checkpoints.latest_good()
    assert manifest is not None and not skipped
    assert (manifest.version, manifest.trigger) == (FINAL, "job_end")
    assert manifest.data_cursor.samples_trained == peer.ctx.plan.num_train


async def test_a_commit_under_way_when_the_job_ends_is_finished_not_cut(
    kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final checkpoint's announcements are read and its commit starts just before the
    checkpointer sees ``completed``: letting the job go must not cancel that commit halfway
    (the manifest written and the version settled, but no ``checkpoint`` event). The pass over
    the completed jobs, which could repair it, is a long interval away here."""
    service = checkpointer_without_the_pass(kafka, tmp_path)
    commit = CheckpointStore.commit
    held: list[int] = []

    def commit_after_the_end(self: CheckpointStore, manifest: Manifest) -> str:
        """The final version's commit (in its worker thread) waits until this process saw
        the job complete, then a little longer, so the let-go comes while it is under way."""
        if manifest.version == FINAL:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                job = service.view.get(manifest.job_id)
                if job is not None and job.state == "completed":
                    break
                time.sleep(0.02)
            held.append(manifest.version)
            time.sleep(0.5)
        return commit(self, manifest)

    monkeypatch.setattr(CheckpointStore, "commit", commit_after_the_end)
    async with AsyncExitStack() as stack:
        peer, checkpoints = await to_the_final_commit(stack, kafka, tmp_path, service)
        job_id = peer.ctx.job_id
        assert held == [FINAL]
        assert (job_id, 0) not in service.finals_settled  # not by the pass: by the task
    assert await checkpoint_events(kafka, job_id) == [1, 2, 3, FINAL]
    assert checkpoints.committed_versions() == [FINAL, 3]
