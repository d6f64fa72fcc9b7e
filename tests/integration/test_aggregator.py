"""The aggregator against the real broker, driven by a scripted trainer peer.

Every version's ParamSlices must equal a single-process torch optimizer fed the same summed
gradients (sync with a failover of the coordinator's process; ssp with top-k and Adam), the job
must end with ``completed``, an exported model that loads, and a ledger of exactly-once counts.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from aggregator_peer import Peer
from job_events import job_event
from ledger_check import assert_exactly_once, train_split
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from serving import running

from conveyor.platform.bus import Producer, create_topology, ensure_topics
from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.messages import JobPlanned, Topics
from conveyor.platform.storage import open_store
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.export import load_exported_state
from conveyor.services.aggregator.job import JobContext, prepare_job
from conveyor.services.aggregator.service import AggregatorService
from conveyor.services.checkpointer.config import CheckpointerSettings
from conveyor.services.checkpointer.service import CheckpointerService
from conveyor.training.checkpoint import CheckpointStore, slice_key
from conveyor.training.datasets import Dataset, open_array_dataset
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import JobPlan

SPEC: dict[str, Any] = {
    "name": "digits-agg",
    "model": {"name": "small_cnn", "num_classes": 10, "channels": [8, 16]},
    "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.5},
    "training": {
        "epochs": 2, "global_batch_size": 256, "micro_batch_size": 64, "seed": 11,
        "optimizer": {"name": "sgd", "lr": 0.2, "weight_decay": 1e-4},
        "lr_schedule": {"name": "cosine", "warmup_steps": 2},
    },
    "distribution": {"trainers": 2, "aggregator_shards": 2, "mode": "sync"},
}  # fmt: skip
WORKERS = {"t0": 100.0, "t1": 300.0}


@pytest.fixture
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    """Short session: the embedded broker completes a group join after half of it."""
    return KafkaSettings(
        bootstrap=kafka_bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        session_timeout_s=4.0,
        heartbeat_interval_s=0.5,
    )


async def submit(kafka: KafkaSettings, spec: dict[str, Any]) -> tuple[JobContext, Dataset]:
    """What the gateway and the sharder do: topics, ``submitted``, ``planned``."""
    job_id = f"job{uuid.uuid4().hex[:8]}"
    topics = Topics(kafka.topic_prefix)
    dataset = open_array_dataset(spec["dataset"]["uri"])
    plan = JobPlan.from_spec(job_id, JobSpec.from_dict(spec), dataset.num_samples)
    slices = spec["distribution"]["aggregator_shards"]
    await create_topology(kafka, TopologySettings(jobs_partitions=2))
    await ensure_topics(kafka, topics.job_topic_specs(job_id, batches_partitions=2, slices=slices))
    planned: dict[str, Any] = {
        "num_train": plan.num_train, "num_eval": plan.num_eval,
        "num_classes": dataset.num_classes, "sample_shape": list(dataset.sample_shape),
        "train_batches_per_epoch": plan.train_batches_per_epoch,
        "eval_batches_per_epoch": plan.eval_batches_per_epoch,
        "steps_per_epoch": plan.steps_per_epoch(4), "batches_topic": topics.batches(job_id),
        "control_topic": topics.control(job_id), "batches_partitions": 2,
        "shards_per_epoch": plan.tasks_per_epoch,
    }  # fmt: skip
    async with Producer(kafka) as producer:
        for event, data in (("submitted", {"spec": spec}), ("planned", planned)):
            message = job_event(job_id, event, **data)
            await producer.publish(topics.jobs, message, key=job_id)
    return prepare_job(job_id, spec, JobPlanned(job_id=job_id, **planned)), dataset


@asynccontextmanager
async def aggregator(kafka: KafkaSettings, objects: Path) -> AsyncIterator[AggregatorService]:
    # No trainer leaves in these tests: a member timeout well above a loaded machine's stalls
    # (the peer evaluates on its event loop at each epoch end) keeps both workers in every step.
    service = AggregatorService(
        settings=AggregatorSettings(member_timeout_s=15.0, tick_s=0.05, progress_interval_s=0.2),
        kafka=kafka,
        storage=StorageSettings(uri=f"file://{objects}"),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )
    serving = asyncio.create_task(service.serve())
    service.serving = serving  # type: ignore[attr-defined]
    try:
        yield service
    finally:
        if not serving.done():
            service.request_stop()
        assert await asyncio.wait_for(serving, 60) == 0


def corrupt_slice(objects: Path, job_id: str, *, version: int, slice_index: int) -> None:
    """Bit rot in a committed checkpoint's file: same size, different bytes."""
    path = objects / slice_key(job_id, version, slice_index)
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(4) if data[-4:] != bytes(4) else b"\xff" * 4
    path.write_bytes(bytes(data))


def committed_versions(peer: Peer) -> list[int]:
    """Versions of the ``checkpoint`` (committed) events seen."""
    return [e.details()["version"] for e in peer.event("checkpoint")]


def checkpointer(kafka: KafkaSettings, objects: Path) -> CheckpointerService:
    return CheckpointerService(
        settings=CheckpointerSettings(poll_s=0.05),
        kafka=kafka,
        storage=StorageSettings(uri=f"file://{objects}"),
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )


async def stop(service: AggregatorService) -> None:
    service.request_stop()
    assert await asyncio.wait_for(service.serving, 60) == 0  # type: ignore[attr-defined]


async def slice_owner(
    services: tuple[AggregatorService, ...], job_id: str, slice_index: int
) -> AggregatorService:
    """The service serving ``slice_index`` of the job; none does while the group rebalances
    (e.g. the second aggregator is still joining), so wait for one."""
    async with asyncio.timeout(30):
        while True:
            for service in services:
                job_aggregator = service.job_aggregators.get(job_id)
                if job_aggregator is not None and slice_index in job_aggregator.owners:
                    return service
            await asyncio.sleep(0.02)


def assert_matches_replay(peer: Peer) -> None:
    replay = peer.replay()
    assert set(replay) == set(range(len(peer.closes) + 1))
    for version, expected in replay.items():
        torch.testing.assert_close(peer.flat_params(version), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(replay[0], replay[len(peer.closes)])


def check_outputs(peer: Peer, objects: Path, epochs: int) -> dict[str, Any]:
    """The completed event's summary, the exported model, the ledger, the epoch results."""
    (completed,) = peer.event("completed")
    summary: dict[str, Any] = completed.details()["summary"]
    steps = sum(1 for c in peer.closes.values() if c.num_samples > 0)
    assert summary["steps"] == steps and summary["versions"] == len(peer.closes)
    assert summary["samples"] == epochs * peer.ctx.plan.num_train
    assert summary["epochs"] == epochs
    staleness = [e.staleness for c in peer.closes.values() for e in c.contributions]
    assert summary["max_staleness"] == max(staleness)
    store = open_store(f"file://{objects}")
    model = peer.ctx.build_model()
    model.load_state_dict(load_exported_state(store, peer.job_id), strict=True)
    final = peer.flat_params(len(peer.closes))
    assert torch.equal(peer.ctx.layout.flatten_params(model), final)
    assert summary["checkpoint"].endswith(f"jobs/{peer.job_id}/model.safetensors")
    # Every step's loss, as the contributions reported it, exported beside the model.
    closes = [peer.closes[v] for v in sorted(peer.closes) if peer.closes[v].num_samples > 0]
    expected = [sum(peer.loss_sums[e.contribution_id] for e in c.contributions) / c.num_samples
                for c in closes]  # fmt: skip
    losses = json.loads(store.get_bytes(f"jobs/{peer.job_id}/losses.json"))["step_losses"]
    assert losses == expected and len(losses) == steps
    ledger = json.loads(store.get_bytes(f"jobs/{peer.job_id}/ledger.json"))
    spec = peer.ctx.spec
    train_ids = train_split(peer.ctx.dataset_samples, spec.dataset.eval_fraction,
                            spec.training.seed)  # fmt: skip
    assert_exactly_once(ledger, train_ids, epochs)
    results = {e.details()["epoch"]: e.details() for e in peer.event("epoch_completed")}
    assert sorted(results) == list(range(epochs))
    for epoch, (loss, correct, samples) in peer.eval_sums.items():
        assert samples == peer.ctx.plan.num_eval
        assert results[epoch]["eval_accuracy"] == pytest.approx(correct / samples)
        assert results[epoch]["eval_loss"] == pytest.approx(loss / samples)
        assert results[epoch]["version"] == peer.epoch_end[epoch]
    assert summary["eval_accuracy"] == results[epochs - 1]["eval_accuracy"]
    return summary


FAILOVER_OPTIMIZERS: dict[str, dict[str, Any]] = {
    # Stateless: an optimizer that restarted after the failover would go unnoticed.
    "sgd": {"optimizer": SPEC["training"]["optimizer"]},
    # Stateful: the new owner must rebuild the momentum buffer / Adam moments exactly, from a
    # checkpoint and the log after it (every 2 steps: the failover lands between two), or
    # from version 0 when no checkpoint precedes it.
    "sgd-nesterov": {
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
        "every_steps": 2,
    },
    "adam": {"optimizer": {"name": "adam", "lr": 0.01, "weight_decay": 1e-4}},
    # Checkpoints at versions 1 and 2; v2's slice 0 is corrupted before the failover: the new
    # owner detects it, says so (checkpoint_unusable) and rebuilds from v1 + two versions.
    "adam-corrupt-latest": {
        "optimizer": {"name": "adam", "lr": 0.01},
        "every_steps": 1,
        "corrupt": True,
    },
}


@pytest.mark.parametrize("variant", sorted(FAILOVER_OPTIMIZERS))
async def test_sync_two_slices_with_failover_matches_replay(
    kafka: KafkaSettings, tmp_path: Path, variant: str
) -> None:
    options = FAILOVER_OPTIMIZERS[variant]
    spec = {
        **SPEC,
        "training": {**SPEC["training"], "optimizer": options["optimizer"]},
        "checkpoint": {"every_steps": options.get("every_steps")},
    }
    ctx, dataset = await submit(kafka, spec)
    epochs = ctx.spec.training.epochs
    per_step = ctx.spec.micro_batches_per_step
    stopped_at: int | None = None
    taken_over: set[int] = set()
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(checkpointer(kafka, tmp_path)))
        first = await stack.enter_async_context(aggregator(kafka, tmp_path))
        peer = await stack.enter_async_context(Peer(kafka, ctx, dataset, WORKERS))
        await peer.wait_for(lambda: peer.has_params(0))
        # A second process joins: the group rebalances, each serves one slice.
        second = await stack.enter_async_context(aggregator(kafka, tmp_path))
        evaluating = asyncio.create_task(peer.evaluate_epochs(epochs))
        version, epoch = 0, 0
        queue = peer.train_batches(0)
        while True:
            await peer.wait_for(lambda v=version: peer.has_params(v))  # type: ignore[misc]
            # The corrupt variant fails over at version 2, when v2 is the newest checkpoint
            # there can be (no later StepClose exists before the peer contributes again).
            stop_at = 2 if options.get("corrupt") else 3
            if version == stop_at and stopped_at is None and options.get("every_steps"):
                # The checkpoint of version 2 is committed before the failover, so the new
                # owner restores from it and replays what follows.
                await peer.wait_for(lambda: 2 in committed_versions(peer), 30)
                if options.get("corrupt"):
                    corrupt_slice(tmp_path, ctx.job_id, version=2, slice_index=0)
            if version == stop_at and stopped_at is None:
                # Stop the coordinator's process: its slice and the coordination move over.
                owner = await slice_owner((first, second), ctx.job_id, 0)
                await stop(owner)
                stopped_at, survivor = version, second if owner is first else first
            if stopped_at is not None and version == stopped_at + 3:
                taken_over = set(survivor.job_aggregators[ctx.job_id].owners)
            if epoch in peer.epoch_end:
                epoch += 1
                if epoch == epochs:
                    break
                queue = peer.train_batches(epoch)
            close = peer.closes.get(version)
            allocation = close.allocation if close else dict.fromkeys(WORKERS, per_step // 2)
            sent = []
            for worker in sorted(WORKERS):
                take, queue = queue[: allocation[worker]], queue[allocation[worker] :]
                sent.append((take, await peer.contribute(worker, version, take)))
            await peer.wait_for(lambda v=version: v + 1 in peer.closes)  # type: ignore[misc]
            queue = [b for take, cid in sent if cid in peer.rejections for b in take] + queue
            version += 1
        await evaluating
        await peer.wait_for(lambda: bool(peer.event("completed")), 60)
        # The checkpointer commits the job's last checkpoint (then applies keep_last) on its
        # own clock: "completed" can come first, and stopping it mid-commit skips the rest.
        final = len(peer.closes)
        await peer.wait_for(lambda: final in committed_versions(peer), 60)
    assert stopped_at is not None and len(peer.closes) >= stopped_at + 4
    assert taken_over == {0, 1}  # the survivor serves both slices
    assert_matches_replay(peer)
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path}"), ctx.job_id)
    committed = checkpoints.committed_versions()
    assert final == len(peer.closes)
    assert final in committed  # the job's end, committed before its topics went
    if options.get("every_steps"):
        # keep_last 3 (the default): the last three of every 2 steps and each epoch's end
        assert len(committed) == 3
    manifest, states, skipped = checkpoints.latest_good()
    assert manifest is not None and manifest.version == final and not skipped
    unusable = [e.details() for e in peer.event("checkpoint_unusable")]
    if options.get("corrupt"):
        # Once per process that opened the slice after the corruption (a rebalance may move
        # it more than once).
        assert {(u["version"], u["used_version"]) for u in unusable} == {(2, 1)}, unusable
        assert "slice-0" in unusable[0]["reason"]
    else:
        assert unusable == []
    for index, (first_param, end_param) in enumerate(ctx.bounds):
        assert torch.equal(states[index].values, peer.flat_params(final)[first_param:end_param])
    allocations = [c.allocation for c in peer.closes.values()]
    assert allocations[0] == {"t0": 1, "t1": 3}  # proportional to the heartbeats' throughput
    assert all(sum(a.values()) == per_step for a in allocations)
    assert not peer.rejections
    # 15 train batches per epoch: three full steps and a short one, every epoch
    assert [len(c.batch_ids) for c in peer.closes.values()] == [4, 4, 4, 3] * epochs
    summary = check_outputs(peer, tmp_path, epochs)
    assert summary["max_staleness"] == 0


SSP_SPEC: dict[str, Any] = {
    **SPEC,
    "training": {
        **SPEC["training"], "epochs": 1,
        "optimizer": {"name": "adam", "lr": 0.01, "weight_decay": 1e-4},
        "lr_schedule": {"name": "step", "step_size": 3, "gamma": 0.7},
    },
    "distribution": {
        "trainers": 2, "aggregator_shards": 2, "mode": "ssp", "staleness": 2,
        "compression": {"kind": "topk", "ratio": 0.05, "error_feedback": True},
    },
}  # fmt: skip


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def num_samples(span: ReadableSpan) -> int:
    """An "aggregate" span's ``conveyor.num_samples`` attribute."""
    assert span.attributes is not None
    value = span.attributes["conveyor.num_samples"]
    assert isinstance(value, int), value
    return value


async def ssp_worker(peer: Peer, worker: str, queue: list[str], staleness: int) -> None:
    """Compute on the newest params, at most ``staleness`` contributions unconfirmed."""
    outstanding: dict[str, list[str]] = {}

    def applied(cid: str) -> bool:
        return any(e.contribution_id == cid for c in peer.closes.values() for e in c.contributions)

    per_epoch = peer.ctx.train_batches_per_epoch
    while peer.applied_in_epoch(0) < per_epoch:
        for cid in list(outstanding):
            if cid in peer.rejections:
                queue[:0] = outstanding.pop(cid)  # recompute them on newer params
            elif applied(cid):
                del outstanding[cid]
        if len(outstanding) >= staleness or not queue:
            await asyncio.sleep(0.01)
            continue
        newest = peer.newest_version()
        close = peer.closes.get(newest)
        count = close.allocation.get(worker, 2) if close else 2
        take = queue[:count]
        del queue[:count]
        outstanding[await peer.contribute(worker, newest, take)] = take
        await asyncio.sleep(0)  # the other worker computes on the same version: staleness


async def test_ssp_topk_adam_single_process_matches_replay(
    kafka: KafkaSettings, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    ctx, dataset = await submit(kafka, SSP_SPEC)
    steps_before = metric("conveyor_aggregator_steps_total")
    bytes_before = metric("conveyor_aggregator_grad_bytes_total")
    workers = {"t0": 200.0, "t1": 200.0}
    async with (
        aggregator(kafka, tmp_path),
        Peer(kafka, ctx, dataset, workers) as peer,
    ):
        await peer.wait_for(lambda: peer.has_params(0))
        evaluating = asyncio.create_task(peer.evaluate_epochs(1))
        queue = peer.train_batches(0)
        await asyncio.gather(*(ssp_worker(peer, w, queue, 2) for w in sorted(workers)))
        await evaluating
        await peer.wait_for(lambda: bool(peer.event("completed")), 60)
    assert_matches_replay(peer)
    staleness = [e.staleness for c in peer.closes.values() for e in c.contributions]
    assert all(len(c.contributions) == 1 for c in peer.closes.values())
    assert max(staleness) <= 2 and max(staleness) >= 1
    for rejection in peer.rejections.values():
        assert rejection.reason.startswith("stale") and rejection.current_version >= 3
    summary = check_outputs(peer, tmp_path, 1)
    assert summary["rejections"] == len(peer.rejections)
    dense_bytes = 4 * ctx.layout.numel * len(peer.sent)
    assert summary["grad_bytes_total"] < 0.08 * dense_bytes  # 5% bf16 values + int32 indices
    # metrics: every version applied by both slices, the gradient bytes received
    assert metric("conveyor_aggregator_steps_total") - steps_before == 2 * len(peer.closes)
    assert (
        metric("conveyor_aggregator_grad_bytes_total") - bytes_before >= summary["grad_bytes_total"]
    )
    assert metric("conveyor_aggregator_staleness_count") >= len(peer.closes)
    # spans: an "aggregate" per version and slice, the child of one of the GradSlices' send
    # spans (named after the topic template) and linked to the others, each the parent of its
    # "send <params topic template>"
    finished = spans.get_finished_spans()
    prefix = kafka.topic_prefix
    sends = {s.context.span_id for s in finished if s.name == f"send {prefix}job.{{id}}.grads"}
    aggregates = [s for s in finished if s.name == "aggregate"]
    assert len(aggregates) == 2 * len(peer.closes)
    nonempty = [s for s in aggregates if num_samples(s) > 0]
    assert nonempty and all(s.parent and s.parent.span_id in sends for s in nonempty)
    inputs = {s.parent.span_id for s in nonempty if s.parent}
    inputs |= {link.context.span_id for s in aggregates for link in s.links}
    assert inputs <= sends  # stale (rejected) contributions reach none
    params_sends = [s for s in finished if s.name == f"send {prefix}job.{{id}}.params"]
    parents = {s.parent.span_id for s in params_sends if s.parent}
    assert {s.context.span_id for s in aggregates} <= parents
