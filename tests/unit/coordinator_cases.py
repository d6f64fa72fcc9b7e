"""Builders shared by the coordinator's unit tests (test_coordinator_*.py, and the checkpoint,
resume and epoch-end tests): a job spec and a Coordinator over a small dataset, batch ids,
heartbeats, contributions, and ``echo`` (the log folding the decisions back)."""

from __future__ import annotations

from typing import Any

from heartbeats import heartbeat

from conveyor.platform.messages import Contribution, Heartbeat, sample_ids_tensor
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig, Decisions
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import parse_batch_id

JOB = "job1"


T0 = 1_000.0


SAMPLES = 1_000
"""Samples of the dataset; batch(epoch, index) holds the one sample ``index``."""


def spec(optimizer: dict[str, Any] | None = None, **distribution: Any) -> JobSpec:
    return JobSpec.from_dict({
        "name": "c",
        "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {
            "epochs": 2, "global_batch_size": 4, "micro_batch_size": 1,
            "optimizer": optimizer or {"name": "sgd", "lr": 0.5},
            "lr_schedule": {"name": "step", "step_size": 2, "gamma": 0.5},
        },
        "distribution": {"trainers": 2, **distribution},
    })  # fmt: skip


def coordinator(
    train: int = 8, evals: int = 2, partitions: int | None = None, **distribution: Any
) -> Coordinator:
    config = CoordinatorConfig(
        job_id=JOB,
        spec=spec(**distribution),
        train_batches_per_epoch=train,
        eval_batches_per_epoch=evals,
        dataset_samples=SAMPLES,
        member_timeout_s=10.0,
        batches_partitions=partitions,
    )
    return Coordinator(config)


def batch(epoch: int, index: int, split: str = "train") -> str:
    return f"{JOB}:e{epoch}:{split}:{index // 4:05d}:b{index % 4:03d}"


def beat(worker: str, at: float, sps: float | None = None, **state: Any) -> Heartbeat:
    if sps is not None:
        state["samples_per_second"] = sps
    return heartbeat(JOB, worker, at=at, **state)


_seq = iter(range(1_000_000))


def sample_of(batch_id: str) -> int:
    """The one sample of ``batch(epoch, index)``: ``index``."""
    ref = parse_batch_id(batch_id)
    return ref.shard_index * 4 + ref.position


def contrib(worker: str, base: int, batches: list[str], at: float = T0, cid: str | None = None,
            loss: float = 1.0, samples: list[int] | None = None,
            epoch: int | None = None) -> Contribution:  # fmt: skip
    """A contribution computed on ``batches``: the samples of each (``samples``: what it says
    it computed on instead), of the first batch's epoch (or ``epoch``)."""
    if samples is None:
        samples = [sample_of(b) for b in batches]
    if epoch is None:
        epoch = parse_batch_id(batches[0]).epoch if batches else 0
    return Contribution(
        job_id=JOB,
        contribution_id=cid or f"{worker}:{next(_seq)}",
        worker_id=worker,
        base_version=base,
        num_samples=len(samples),
        batch_ids=batches,
        epoch=epoch,
        sample_ids=sample_ids_tensor(samples),
        loss_sum=loss * len(samples),
        grad_bytes=100,
        sent_at=at,
    )


def echo(c: Coordinator, decisions: Decisions) -> None:
    """What the log does: the published decisions come back and are folded."""
    for rejection in decisions.rejections:
        c.fold(rejection)
    if decisions.close is not None:
        c.fold(decisions.close)
