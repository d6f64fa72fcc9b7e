"""The in-process simulation behind local mode's guidance (``loadtests.local_outer``,
``loadtests.local_outer_gpt`` and ``loadtests.local_outer_resnet``): its local mode reduces to
sync where the algorithm does, and differs where it must."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conveyor.training.jobspec import JobSpec
from loadtests.local_outer import global_batches, train_simulated
from loadtests.local_outer_gpt import unigram_entropy
from loadtests.local_outer_resnet import first_epoch_at

X = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))  # [S, 3]
Y = X @ torch.tensor([1.0, -2.0, 0.5]) + 0.1  # [S]


def spec(momentum: float) -> JobSpec:
    return JobSpec.from_dict({
        "name": "linear",
        "model": {"name": "mlp"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {"epochs": 2, "global_batch_size": 8, "micro_batch_size": 4,
                     "optimizer": {"name": "sgd", "lr": 0.05, "momentum": momentum}},
    })  # fmt: skip


def build() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(3, 1)


def loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    error: torch.Tensor = model(X[rows]).squeeze(1) - Y[rows]  # [B]
    return (error**2).mean()


def trained(momentum: float, window: int, outer: dict[str, object] | None) -> torch.Tensor:
    batches = global_batches(np.arange(40), seed=0, epochs=2, size=8)
    model = train_simulated(spec(momentum), build, loss, batches, window=window, outer_spec=outer)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_local_mode_with_one_inner_step_and_plain_averaging_is_sync(momentum: float) -> None:
    # SGD with momentum is linear in the gradients, so the mean of the trainers' inner steps
    # (each with its own buffer) is the step of one buffer on the mean gradient.
    sync = trained(momentum, 1, None)
    local = trained(momentum, 1, {"name": "sgd", "lr": 1.0})
    assert torch.allclose(local, sync, atol=1e-5)
    start = torch.cat([p.detach().flatten() for p in build().parameters()])
    assert not torch.allclose(sync, start, atol=0.1)  # it trained


def test_longer_windows_move_away_from_sync() -> None:
    sync = trained(0.9, 1, None)
    local = trained(0.9, 4, {"name": "sgd", "lr": 1.0})
    assert not torch.allclose(local, sync, atol=1e-3)


def test_unigram_entropy_is_in_nats() -> None:
    assert unigram_entropy(np.array([0, 0, 1, 1], dtype=np.uint16)) == pytest.approx(math.log(2))
    assert unigram_entropy(np.array([7, 7, 7], dtype=np.uint16)) == 0.0


@pytest.mark.parametrize("window", [1, 4])
def test_each_epochs_end_is_seen_with_the_parameters_it_ended_on(window: int) -> None:
    seen: list[torch.Tensor] = []

    def after_epoch(model: nn.Module) -> None:
        seen.append(torch.cat([p.detach().flatten() for p in model.parameters()]))

    batches = global_batches(np.arange(40), seed=0, epochs=2, size=8)
    outer = None if window == 1 else {"name": "sgd", "lr": 1.0}
    model = train_simulated(spec(0.9), build, loss, batches, window=window, outer_spec=outer,
                            after_epoch=after_epoch)  # fmt: skip
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert len(seen) == 2
    assert torch.equal(seen[1], final)  # the last epoch's end is the trained model
    assert not torch.allclose(seen[0], final, atol=1e-3)  # the first is on the way there


def test_the_first_epoch_at_a_target_counts_from_one() -> None:
    assert first_epoch_at([0.5, 0.86, 0.9], 0.85) == 2
    assert first_epoch_at([0.9], 0.85) == 1
    assert first_epoch_at([0.5, 0.6], 0.85) is None
