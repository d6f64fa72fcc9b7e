"""A slice owner: buffering by contribution, applying StepCloses in order, dropping the dead."""

from __future__ import annotations

import pytest
import torch

from conveyor.platform.messages import AppliedContribution, GradSlice, StepClose
from conveyor.services.aggregator.slice_owner import SliceOwner
from conveyor.training.compression import encode_slice
from conveyor.training.jobspec import OptimizerSpec

SGD = OptimizerSpec(name="sgd", lr=0.1)


def grad_slice(cid: str, base: int, dense: torch.Tensor, encoding: str = "dense") -> GradSlice:
    enc = encode_slice(dense, encoding, k=2)  # type: ignore[arg-type]
    return GradSlice(job_id="j", contribution_id=cid, worker_id=cid.split(":")[0],
                     base_version=base, slice_index=1, numel=4, encoding=enc.encoding,
                     values=enc.values, indices=enc.indices, sent_at=0.0)  # fmt: skip


def close(version: int, entries: list[tuple[str, int]], lr: float = 0.5) -> StepClose:
    contributions = [
        AppliedContribution(contribution_id=c, worker_id="w", base_version=0, num_samples=n,
                            staleness=0)
        for c, n in entries
    ]  # fmt: skip
    return StepClose(
        job_id="j", version=version, batch_ids=[], contributions=contributions,
        num_samples=sum(n for _, n in entries), epoch=0, lr=lr, allocation={}, closed_at=0.0,
    )  # fmt: skip


def test_applies_the_mean_gradient_once_all_slices_are_held() -> None:
    owner: SliceOwner[str] = SliceOwner(slice_index=1, values=torch.ones(4), version=0,
                                        optimizer=SGD)  # fmt: skip
    owner.add(grad_slice("a:0", 0, torch.tensor([1.0, 2.0, 3.0, 4.0])), "rec-a")
    step = close(1, [("a:0", 2), ("b:0", 2), ("c:0", 0)])  # c is empty: no slice
    assert owner.missing(step) == ["b:0"]
    owner.add(grad_slice("b:0", 0, torch.tensor([0.0, 0.0, 8.0, -4.0]), "topk"), "rec-b")
    owner.add(grad_slice("b:0", 0, torch.tensor([0.0, 0.0, 8.0, -4.0]), "topk"), "rec-b2")
    assert owner.missing(step) == [] and owner.buffered == 2
    with pytest.raises(ValueError):
        owner.apply(close(2, []))  # not the next version
    records = owner.apply(step)
    assert records == ["rec-a", "rec-b", "rec-b2"]  # duplicates are acknowledged too
    # sum = [1, 2, 11, 0] over 4 samples, lr 0.5
    expected = torch.ones(4) - 0.5 * torch.tensor([1.0, 2.0, 11.0, 0.0]) / 4
    torch.testing.assert_close(owner.values, expected)
    assert owner.version == 1 and owner.buffered == 0


def test_an_empty_step_changes_nothing_but_the_version() -> None:
    owner: SliceOwner[str] = SliceOwner(slice_index=1, values=torch.ones(4), version=3,
                                        optimizer=SGD)  # fmt: skip
    assert owner.apply(close(4, [("a:0", 0)])) == []
    assert owner.version == 4 and torch.equal(owner.values, torch.ones(4))


def test_dead_slices_are_dropped_and_wrong_slices_refused() -> None:
    owner: SliceOwner[str] = SliceOwner(slice_index=1, values=torch.zeros(4), version=5,
                                        optimizer=SGD)  # fmt: skip
    owner.add(grad_slice("a:0", 2, torch.ones(4)), "old")
    owner.add(grad_slice("a:1", 3, torch.ones(4)), "within")
    owner.add(grad_slice("a:2", 5, torch.ones(4)), "current")
    assert owner.drop_dead(staleness_bound=2) == ["old"]  # base 2 < 5 - 2
    assert owner.drop_dead(staleness_bound=0) == ["within"]
    assert owner.buffered == 1
    other = grad_slice("b:0", 5, torch.ones(4))
    other.slice_index = 0
    with pytest.raises(ValueError, match="this owner holds slice 1"):
        owner.add(other, "x")


def test_statistics_take_the_sample_weighted_mean_instead_of_a_step() -> None:
    """Elements 2..4 are running statistics: trainers sent them times their sample counts."""
    momentum = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.1)
    owner: SliceOwner[str] = SliceOwner(slice_index=1, values=torch.ones(4), version=0,
                                        optimizer=momentum, statistics=[(2, 4)])  # fmt: skip
    owner.add(grad_slice("a:0", 0, torch.tensor([1.0, 1.0, 0.5 * 3, 2.0 * 3])), "a")
    owner.add(grad_slice("b:0", 0, torch.tensor([1.0, 1.0, 1.5 * 1, 6.0 * 1])), "b")
    owner.apply(close(1, [("a:0", 3), ("b:0", 1)]))
    # statistics: (0.5 * 3 + 1.5) / 4 = 0.75, (2 * 3 + 6) / 4 = 3
    torch.testing.assert_close(owner.values[2:], torch.tensor([0.75, 3.0]))
    # parameters: one SGD step at the close's lr 0.5 on grad 2 / 4 plus weight decay 0.1 x 1
    torch.testing.assert_close(owner.values[:2], torch.full((2,), 1 - 0.5 * (0.5 + 0.1)))
    owner.apply(close(2, [("c:0", 0)]))  # a step without samples keeps them
    torch.testing.assert_close(owner.values[2:], torch.tensor([0.75, 3.0]))
    with pytest.raises(ValueError, match="outside a slice"):
        SliceOwner(slice_index=1, values=torch.ones(4), version=0, optimizer=SGD,
                   statistics=[(3, 5)])  # fmt: skip
