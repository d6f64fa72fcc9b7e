"""Bounded staleness and SGD momentum, simulated in process on the digits demo.

Delayed-gradient SGD as the aggregator runs it in ssp mode: each step applies one trainer's
share of the global batch, its gradient computed on the parameters of ``d`` versions back
(``d`` drawn from ``delays`` per step, as two trainers within staleness 2 produce), then one
:class:`~conveyor.training.optim.SliceOptimizer` step. It compares ways of applying stale
gradients (docs/architecture.md, departure 13) without the broker, in seconds per seed:

    .venv/bin/python -m loadtests.ssp_momentum --seeds 3

Prints one line per rule (eval accuracy per seed), then a JSON object of the mean accuracies.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.nn import functional as F

from conveyor.training.datasets import open_array_dataset
from conveyor.training.jobspec import JobSpec
from conveyor.training.optim import SliceOptimizer, staleness_momentum
from conveyor.training.plan import epoch_order, split_ids
from conveyor.training.slicing import ParamLayout, build_job_model

DEMO_SPEC = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"

RULES = ("sync", "ssp undamped", "ssp lr x share", "ssp lr / (1 + d)", "ssp momentum / (1 + d)")
"""``sync``: the global batch per step, no staleness (the reference). The ssp rules: what the
aggregator does with a ``d``-versions-old gradient of one trainer's share."""


def ssp_accuracy(
    rule: str, *, seed: int, epochs: int = 5, delays: tuple[int, ...] = (1, 2)
) -> float:
    """Eval accuracy of the digits demo trained under ``rule`` (one of :data:`RULES`)."""
    data: dict[str, Any] = yaml.safe_load(DEMO_SPEC.read_text())
    data["training"].update(seed=seed, epochs=epochs)
    spec = JobSpec.from_dict(data)
    training = spec.training
    dataset = open_array_dataset(spec.dataset.uri)
    train_ids, eval_ids = split_ids(dataset.num_samples, spec.dataset.eval_fraction, seed)
    model = build_job_model(
        spec, num_classes=dataset.num_classes, sample_shape=dataset.sample_shape
    )
    layout = ParamLayout.from_model(model)
    optimizer = SliceOptimizer(training.optimizer, layout.flatten_params(model))
    norm = spec.preprocess.normalize
    assert norm is not None
    mean = torch.tensor(norm.mean).view(1, -1, 1, 1)
    std = torch.tensor(norm.std).view(1, -1, 1, 1)

    def batch(ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = dataset.read([int(i) for i in ids])
        x_float = (torch.from_numpy(np.asarray(x)).float() / 255.0 - mean) / std  # [B, C, H, W]
        return x_float, torch.as_tensor(np.asarray(y), dtype=torch.int64)

    sync = rule == "sync"
    micro = training.micro_batch_size
    per_step = spec.micro_batches_per_step if sync else spec.micro_batches_per_step // 2
    history = [optimizer.values.clone()]  # the last versions, newest last
    rng = random.Random(seed)
    for epoch in range(epochs):
        order = epoch_order(train_ids, seed, epoch)
        micro_batches = [order[i : i + micro] for i in range(0, len(order), micro)]
        for first in range(0, len(micro_batches), per_step):
            staleness = 0 if sync else rng.choice(delays)
            layout.load_flat(model, history[max(0, len(history) - 1 - staleness)])
            model.zero_grad(set_to_none=True)
            samples = 0
            for ids in micro_batches[first : first + per_step]:
                x, y = batch(ids)
                F.cross_entropy(model(x), y, reduction="sum").backward()  # type: ignore[no-untyped-call]
                samples += len(ids)
            lr, momentum = training.optimizer.lr, None
            if rule == "ssp lr x share":
                lr *= samples / training.global_batch_size
            elif rule == "ssp lr / (1 + d)":
                lr /= 1 + staleness
            elif rule == "ssp momentum / (1 + d)":
                momentum = staleness_momentum(training.optimizer.momentum, staleness)
            optimizer.step(layout.flatten_grads(model) / samples, lr, momentum)
            history = [*history[-max(delays) :], optimizer.values.clone()]
    layout.load_flat(model, optimizer.values)
    model.eval()
    with torch.no_grad():
        x, y = batch(eval_ids)
        return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    means: dict[str, float] = {}
    for rule in RULES:
        accuracies = [ssp_accuracy(rule, seed=s, epochs=args.epochs) for s in range(args.seeds)]
        means[rule] = round(statistics.fmean(accuracies), 4)
        print(f"{rule:24s} " + " ".join(f"{a:.3f}" for a in accuracies), flush=True)
    print(json.dumps(means))


if __name__ == "__main__":
    main()
