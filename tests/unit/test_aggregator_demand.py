"""When an aggregator reads the grads topic: only while the control log announces a slice it
lacks (grads_wanted)."""

from __future__ import annotations

import torch

from conveyor.platform.messages import (
    AppliedContribution,
    Contribution,
    GradSlice,
    Rejection,
    StepClose,
    sample_ids_tensor,
)
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig
from conveyor.services.aggregator.demand import grads_wanted
from conveyor.services.aggregator.slice_owner import SliceOwner
from conveyor.training.compression import encode_slice
from conveyor.training.jobspec import JobSpec, OptimizerSpec

JOB = "j"


def coordinator() -> Coordinator:
    spec = JobSpec.from_dict({
        "name": "d", "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {"epochs": 1, "global_batch_size": 4, "micro_batch_size": 2,
                     "optimizer": {"name": "sgd", "lr": 0.1}},
        "distribution": {"trainers": 2, "aggregator_shards": 2},
    })  # fmt: skip
    return Coordinator(
        CoordinatorConfig(
            job_id=JOB, spec=spec, train_batches_per_epoch=8, eval_batches_per_epoch=0,
            dataset_samples=100, member_timeout_s=10.0, batches_partitions=None,
        )
    )  # fmt: skip


def owner(index: int) -> SliceOwner[str]:
    return SliceOwner(
        slice_index=index,
        values=torch.zeros(4),
        version=0,
        optimizer=OptimizerSpec(name="sgd", lr=0.1),
    )


def contribution(cid: str, samples: int) -> Contribution:
    return Contribution(
        job_id=JOB, contribution_id=cid, worker_id=cid.split(":")[0], base_version=0,
        num_samples=samples, batch_ids=[f"b-{cid}"] if samples else [], epoch=0,
        sample_ids=sample_ids_tensor(list(range(samples))), loss_sum=1.0, grad_bytes=16,
        sent_at=0.0,
    )  # fmt: skip


def grad(cid: str, index: int) -> GradSlice:
    enc = encode_slice(torch.ones(4), "dense", k=4)
    return GradSlice(
        job_id=JOB, contribution_id=cid, worker_id=cid.split(":")[0], base_version=0,
        slice_index=index, numel=4, encoding=enc.encoding, values=enc.values,
        indices=enc.indices, sent_at=0.0,
    )  # fmt: skip


def close(version: int, *entries: tuple[str, int]) -> StepClose:
    return StepClose(
        job_id=JOB, version=version, batch_ids=[], num_samples=sum(n for _, n in entries),
        contributions=[AppliedContribution(contribution_id=c, worker_id="w", base_version=0,
                                           num_samples=n, staleness=0) for c, n in entries],
        epoch=0, lr=0.1, allocation={}, closed_at=0.0,
    )  # fmt: skip


def test_nothing_announced_nothing_wanted() -> None:
    owners = {0: owner(0), 1: owner(1)}
    assert not grads_wanted(coordinator(), owners, owned={0, 1}, opening=False)


def test_an_owned_partition_without_its_owner_or_an_opening_one_is_read() -> None:
    owners = {0: owner(0)}
    assert grads_wanted(coordinator(), owners, owned={0, 1}, opening=False)
    assert grads_wanted(coordinator(), owners, owned={0}, opening=True)


def test_a_contribution_is_wanted_until_every_owner_holds_its_slice() -> None:
    c = coordinator()
    owners = {0: owner(0), 1: owner(1)}
    c.fold(contribution("a:1", 2))
    assert grads_wanted(c, owners, owned={0, 1}, opening=False)
    owners[0].add(grad("a:1", 0), "r0")
    assert grads_wanted(c, owners, owned={0, 1}, opening=False)  # slice 1 still missing
    owners[1].add(grad("a:1", 1), "r1")
    assert not grads_wanted(c, owners, owned={0, 1}, opening=False)


def test_an_empty_or_rejected_contribution_has_nothing_to_read() -> None:
    c = coordinator()
    owners = {0: owner(0)}
    c.fold(contribution("a:1", 0))
    assert not grads_wanted(c, owners, owned={0}, opening=False)
    c.fold(contribution("b:1", 2))
    assert grads_wanted(c, owners, owned={0}, opening=False)
    c.fold(
        Rejection(
            job_id=JOB, contribution_id="b:1", worker_id="b", current_version=3, reason="stale"
        )
    )
    assert not grads_wanted(c, owners, owned={0}, opening=False)


def test_the_next_close_is_wanted_until_its_slices_are_held() -> None:
    c = coordinator()
    owners = {0: owner(0)}
    c.fold(close(1, ("a:1", 2)))  # its contribution was never folded here (a late joiner)
    assert grads_wanted(c, owners, owned={0}, opening=False)
    owners[0].add(grad("a:1", 0), "r0")
    assert not grads_wanted(c, owners, owned={0}, opening=False)
    owners[0].apply(c.closes[1])
    assert owners[0].version == 1
    assert not grads_wanted(c, owners, owned={0}, opening=False)
