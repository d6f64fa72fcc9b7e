"""The in-process reference of Conveyor's gradient-plane algorithm, for bench_aggregation.py.

It trains a job spec in this process exactly as the system would apply it, without the broker
and without the timing-dependent parts (which trainer gets which micro-batch, who joins when):
it tells a system bug from a property of the algorithm, and averages accuracy over many seeds
in seconds each (one seed's top-k delta is mostly noise).

    .venv/bin/python -m loadtests.bench_aggregation --investigate 16
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

REFERENCE_SEEDS = 48
"""Seeds of the reference's accuracy. One seed's delta is mostly noise (its spread over seeds
is ~2 points, dense alone moves ~3 points between seeds on digits): 48 seeds put the standard
error of the mean delta near 0.3 points (8 seeds: ~0.8)."""


def reference_accuracy(spec_dict: dict[str, Any], *, seed: int | None = None) -> float:
    """Eval accuracy after training ``spec_dict`` with Conveyor's algorithm in this process:
    each step's micro-batches dealt round-robin to the spec's trainers, each trainer's
    summed-loss gradient over its micro-batches of the step encoded by its own SliceEncoder
    (top-k residuals and momentum-correction velocities per trainer), the decoded slices
    summed and divided by the step's samples, and the aggregator's optimizer over the flat
    parameters (equal to per-slice optimizers)."""
    from torch.nn import functional as F

    from conveyor.services.trainer.plane.gradients import SliceEncoder
    from conveyor.training.compression import decode_slice
    from conveyor.training.datasets import open_array_dataset
    from conveyor.training.jobspec import JobSpec
    from conveyor.training.optim import aggregator_optimizer, build_optimizer, lr_at
    from conveyor.training.plan import epoch_order, split_ids
    from conveyor.training.slicing import ParamLayout, build_job_model

    data = json.loads(json.dumps(spec_dict))
    if seed is not None:
        data["training"]["seed"] = seed
    spec = JobSpec.from_dict(data)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = open_array_dataset(spec.dataset.uri)
        train_ids, eval_ids = split_ids(
            dataset.num_samples, spec.dataset.eval_fraction, spec.training.seed
        )
        model = build_job_model(
            spec, num_classes=dataset.num_classes, sample_shape=dataset.sample_shape
        )
        layout = ParamLayout.from_model(model)
        flat = torch.nn.Parameter(layout.flatten_params(model).clone())  # [N]
        optimizer = build_optimizer(aggregator_optimizer(spec), [flat])
        bounds = layout.slice_bounds(spec.distribution.aggregator_shards)
        trainers = spec.distribution.trainers
        encoders = [SliceEncoder.for_job(spec, bounds) for _ in range(trainers)]
        norm = spec.preprocess.normalize
        mean = torch.tensor(norm.mean if norm else [0.0]).view(1, -1, 1, 1)
        std = torch.tensor(norm.std if norm else [1.0]).view(1, -1, 1, 1)

        def batch(ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = dataset.read([int(i) for i in ids])
            x_float = (torch.from_numpy(np.asarray(x)).float() / 255.0 - mean) / std
            return x_float, torch.as_tensor(np.asarray(y), dtype=torch.int64)

        micro, per_step = spec.training.micro_batch_size, spec.micro_batches_per_step
        steps_per_epoch = math.ceil(math.ceil(len(train_ids) / micro) / per_step)
        total_steps, step_index = steps_per_epoch * spec.training.epochs, 0
        for epoch in range(spec.training.epochs):
            order = epoch_order(train_ids, spec.training.seed, epoch)
            micro_batches = [order[i : i + micro] for i in range(0, len(order), micro)]
            for first in range(0, len(micro_batches), per_step):
                step = micro_batches[first : first + per_step]
                layout.load_flat(model, flat.detach())
                total = torch.zeros(layout.numel)
                for trainer in range(min(trainers, len(step))):
                    model.zero_grad(set_to_none=True)
                    mine = step[trainer::trainers]
                    for ids in mine:
                        x, y = batch(ids)
                        F.cross_entropy(model(x), y, reduction="sum").backward()  # type: ignore[no-untyped-call]
                    samples = sum(len(ids) for ids in mine)
                    encoded = encoders[trainer].encode(layout.flatten_grads(model), samples)
                    total += torch.cat(
                        [decode_slice(s.encoding, s.values, s.indices, s.numel)
                         for s in encoded.slices]
                    )  # fmt: skip
                flat.grad = total / sum(len(ids) for ids in step)
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(spec.training.lr_schedule, spec.training.optimizer.lr,
                                        step_index, total_steps)  # fmt: skip
                optimizer.step()
                step_index += 1
                flat.grad = None
        layout.load_flat(model, flat.detach())
        model.eval()
        with torch.no_grad():
            x, y = batch(eval_ids)
            return float((model(x).argmax(dim=1) == y).float().mean())
    finally:
        torch.set_num_threads(threads)


def variants(topk: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """The investigated variants: name -> (compression, overrides of ``training``), around
    the ``topk`` compression the benchmark measures."""
    return {
        "dense": ({"kind": "none"}, {}),
        "topk 1% + EF + momentum correction (the default)": (topk, {}),
        "topk 1% + EF, momentum at the aggregator": (
            {**topk, "momentum_correction": False},
            {},
        ),
        "topk 1%, no EF": ({**topk, "error_feedback": False}, {}),
        "topk 5% + EF + momentum correction": ({**topk, "ratio": 0.05}, {}),
        "dense, 20 epochs": ({"kind": "none"}, {"epochs": 20}),
        "topk 1% + EF + momentum correction, 20 epochs": (topk, {"epochs": 20}),
    }


def investigate(
    base: dict[str, Any], topk: dict[str, Any], seeds: int, log: Any = print
) -> dict[str, list[float]]:
    """Reference accuracy of each of :func:`variants` on ``base`` (a job spec dict) for seeds
    0..seeds-1; ``log`` gets a line per variant."""
    found: dict[str, list[float]] = {}
    for name, (compression, overrides) in variants(topk).items():
        spec = json.loads(json.dumps(base))
        spec["distribution"]["compression"] = dict(compression)
        spec["training"].update(overrides)
        found[name] = [reference_accuracy(spec, seed=seed) for seed in range(seeds)]
        log(f"reference {name}: " + ", ".join(f"{a:.3f}" for a in found[name]))
    return found
