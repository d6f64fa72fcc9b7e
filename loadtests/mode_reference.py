"""In-process references of Conveyor's training modes on arrays, for bench_mode_accuracy.py.

A job spec is trained in this process with the update rules the gradient plane applies, and
without the broker, so that accuracy can be averaged over seeds in seconds (on a GPU) and a
system bug told from a property of the algorithm:

- ``plain``: one torch SGD over ``model.parameters()``, the global batch per step;
- ``sync`` (and top-k/fp16 compression): each step's micro-batches dealt round-robin to the
  trainers, each trainer's summed-loss gradient encoded by its own ``SliceEncoder`` (top-k
  residuals and momentum-correction velocities per trainer), the decoded slices summed and
  divided by the step's samples, one ``SliceOptimizer`` step of the aggregator's optimizer;
- ``ssp``: an event simulation of trainers of relative ``speeds`` (+-10% per contribution):
  each computes its share of a global batch on the newest version when it starts; each
  contribution closes its own version in arrival order, with the coordinator's momentum rule
  for a gradient ``d`` versions old (:func:`~conveyor.training.optim.staleness_momentum`); one
  staler than ``distribution.staleness`` is rejected and its batches computed again.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from conveyor.services.trainer.plane.gradients import SliceEncoder
from conveyor.training.compression import EncodedSlice, decode_slice
from conveyor.training.jobspec import JobSpec
from conveyor.training.optim import SliceOptimizer, aggregator_optimizer, lr_at, staleness_momentum
from conveyor.training.plan import epoch_order, split_ids
from conveyor.training.slicing import ParamLayout, build_job_model

LossSum = Callable[[np.ndarray], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Arrays:
    """A dataset in memory: x uint8 [N, C, H, W], y int64 [N]."""

    x: np.ndarray
    y: np.ndarray


def reference_accuracy(
    spec_dict: dict[str, Any],
    data: Arrays,
    *,
    plain: bool = False,
    speeds: tuple[float, ...] | None = None,
    device: str = "cpu",
) -> float:
    """Eval accuracy after ``spec_dict``'s epochs in its mode and compression (``plain``: one
    torch optimizer instead). ``speeds``: ssp trainers' relative speeds (default: equal, one
    per ``distribution.trainers``)."""
    spec = JobSpec.from_dict(json.loads(json.dumps(spec_dict)))
    training = spec.training
    train_ids, eval_ids = split_ids(len(data.y), spec.dataset.eval_fraction, training.seed)
    model = build_job_model(
        spec, num_classes=int(data.y.max()) + 1, sample_shape=data.x.shape[1:]
    ).to(device)
    norm = spec.preprocess.normalize
    mean = torch.tensor(norm.mean if norm else [0.0], device=device).view(1, -1, 1, 1)
    std = torch.tensor(norm.std if norm else [1.0], device=device).view(1, -1, 1, 1)
    x_all, y_all = torch.from_numpy(data.x).to(device), torch.from_numpy(data.y).to(device)

    def loss_sum(ids: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(ids).to(device)
        x = (x_all[index].float() / 255.0 - mean) / std  # [B, C, H, W]
        return F.cross_entropy(model(x), y_all[index], reduction="sum")

    micro = training.micro_batch_size
    batches = [
        order[i : i + micro]
        for epoch in range(training.epochs)
        for order in [epoch_order(train_ids, training.seed, epoch)]
        for i in range(0, len(order), micro)
    ]  # every epoch's micro-batches, in order
    if plain:
        _train_plain(spec, model, loss_sum, batches)
    else:
        layout = ParamLayout.from_model(model)
        owner = SliceOptimizer(aggregator_optimizer(spec), layout.flatten_params(model))
        if spec.distribution.mode == "ssp":
            trainers = speeds or (1.0,) * spec.distribution.trainers
            _train_ssp(spec, model, layout, loss_sum, owner, batches, trainers)
        else:
            _train_sync(spec, model, layout, loss_sum, owner, batches)
        layout.load_flat(model, owner.values)
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(eval_ids), 512):
            index = torch.from_numpy(eval_ids[start : start + 512]).to(device)
            x = (x_all[index].float() / 255.0 - mean) / std
            correct += int((model(x).argmax(dim=1) == y_all[index]).sum())
    return correct / len(eval_ids)


def _lr(spec: JobSpec, step: int, batches: int) -> float:
    training = spec.training
    total = math.ceil(batches / spec.micro_batches_per_step)
    return lr_at(training.lr_schedule, training.optimizer.lr, step, total)


def _train_plain(spec: JobSpec, model: nn.Module, loss_sum: LossSum, batches: list[Any]) -> None:
    optimizer_spec = spec.training.optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=optimizer_spec.lr,
                                momentum=optimizer_spec.momentum,
                                nesterov=optimizer_spec.nesterov)  # fmt: skip
    per_step = spec.micro_batches_per_step
    for step, first in enumerate(range(0, len(batches), per_step)):
        mine = batches[first : first + per_step]
        optimizer.zero_grad(set_to_none=True)
        total = sum((loss_sum(ids) for ids in mine), torch.zeros(()))
        (total / sum(map(len, mine))).backward()  # type: ignore[no-untyped-call]
        for group in optimizer.param_groups:
            group["lr"] = _lr(spec, step, len(batches))
        optimizer.step()


def _train_sync(
    spec: JobSpec, model: nn.Module, layout: ParamLayout, loss_sum: LossSum,
    owner: SliceOptimizer, batches: list[Any],
) -> None:  # fmt: skip
    trainers, per_step = spec.distribution.trainers, spec.micro_batches_per_step
    bounds = layout.slice_bounds(spec.distribution.aggregator_shards)
    encoders = [SliceEncoder.for_job(spec, bounds) for _ in range(trainers)]
    for step, first in enumerate(range(0, len(batches), per_step)):
        mine = batches[first : first + per_step]
        layout.load_flat(model, owner.values)
        total = torch.zeros(layout.numel)
        for trainer in range(min(trainers, len(mine))):
            grad, samples = _gradient(model, layout, loss_sum, mine[trainer::trainers])
            total += _decoded(encoders[trainer].encode(grad, samples).slices)
        owner.step(total / sum(map(len, mine)), _lr(spec, step, len(batches)))


def _train_ssp(
    spec: JobSpec, model: nn.Module, layout: ParamLayout, loss_sum: LossSum,
    owner: SliceOptimizer, batches: list[Any], speeds: tuple[float, ...],
) -> None:  # fmt: skip
    per_step, bound = spec.micro_batches_per_step, spec.distribution.staleness
    share = max(1, per_step // len(speeds))  # the allocation with equal throughputs
    momentum = aggregator_optimizer(spec).momentum
    bounds = layout.slice_bounds(spec.distribution.aggregator_shards)
    encoders = [SliceEncoder.for_job(spec, bounds) for _ in speeds]
    rng = random.Random(spec.training.seed)
    history = {0: owner.values.clone()}  # version -> parameters, the last bound + 1
    version = applied = taken = 0
    running: list[tuple[float, int, int, int]] = []  # (finish time, trainer, base, first)

    def start(now: float, trainer: int, first: int) -> None:
        finish = now + rng.uniform(0.9, 1.1) / speeds[trainer]
        heapq.heappush(running, (finish, trainer, version, first))

    for trainer in range(len(speeds)):
        start(0.0, trainer, taken)
        taken += share
    while running:
        now, trainer, base, first = heapq.heappop(running)
        mine = batches[first : first + share]
        if not mine:
            continue
        staleness = version - base
        if staleness > bound:  # rejected: the same batches again on the newest version
            start(now, trainer, first)
            continue
        layout.load_flat(model, history[base])
        grad, samples = _gradient(model, layout, loss_sum, mine)
        total = _decoded(encoders[trainer].encode(grad, samples).slices)
        step_momentum = staleness_momentum(momentum, staleness) if staleness else None
        lr = _lr(spec, applied // per_step, len(batches))
        owner.step(total / samples, lr, step_momentum if momentum else None)
        applied += len(mine)
        version += 1
        history[version] = owner.values.clone()
        history.pop(version - bound - 1, None)
        start(now, trainer, taken)
        taken += share


def _gradient(
    model: nn.Module, layout: ParamLayout, loss_sum: LossSum, batches: list[np.ndarray]
) -> tuple[torch.Tensor, int]:
    """(the flat gradient [N] of the summed loss over ``batches``, their samples)."""
    model.zero_grad(set_to_none=True)
    for ids in batches:
        loss_sum(ids).backward()  # type: ignore[no-untyped-call]
    return layout.flatten_grads(model), sum(map(len, batches))


def _decoded(slices: list[EncodedSlice]) -> torch.Tensor:
    return torch.cat([decode_slice(s.encoding, s.values, s.indices, s.numel) for s in slices])
