"""Local mode (DiLoCo-style) on a ResNet, simulated in process: which H and outer optimizer
fit a convolutional network of ~0.7M parameters on real handwriting.

The job: resnet18 (width 16, group norm, as ``loadtests.bench_time_to_accuracy``'s resnet18
case) on distorted digits (``loadtests.distorted_digits``: held-out writers, random affine and
elastic distortion; 16x16, 10,000 samples of which 2,000 eval), inner SGD lr 0.05 momentum 0.9,
global batch 64 of 2 x 32. Two simulated trainers train it in sync mode and in local mode at
several H and outer optimizers, as ``loadtests.local_outer`` does for the digits demo (same
simulation, no broker). Reported per setting and seed: eval accuracy after each epoch, so
both the final accuracy and how soon a setting gets there show.

    .venv/bin/python -m loadtests.local_outer_resnet --procs 2   # ~30 min on 2 cores

Prints one line per run (accuracy after each epoch), then one line per setting (the mean
per epoch), then a JSON object: each setting's mean final accuracy and the first epoch its
mean reached ``--target``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
from typing import Any

DEFAULT_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.5, "nesterov": True}
AVERAGING = {"name": "sgd", "lr": 1.0}
DILOCO = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
SETTINGS: dict[str, tuple[int, dict[str, Any] | None]] = {
    # name: (H, outer optimizer (None: sync, no outer))
    "sync": (1, None),
    "H4 default outer": (4, DEFAULT_OUTER),
    "H8 default outer": (8, DEFAULT_OUTER),
    "H16 default outer": (16, DEFAULT_OUTER),
    "H32 default outer": (32, DEFAULT_OUTER),
    "H64 default outer": (64, DEFAULT_OUTER),
    "H8 averaging": (8, AVERAGING),
    "H16 averaging": (16, AVERAGING),
    "H32 averaging": (32, AVERAGING),
    "H8 DiLoCo outer": (8, DILOCO),
}


def job_spec(seed: int, epochs: int) -> dict[str, Any]:
    """The job (the dataset is passed as arrays: the uri is a label)."""
    return {
        "name": "local-outer-resnet",
        "model": {"name": "resnet18", "width": 16, "norm": "group"},
        "dataset": {"uri": "npz://distorted-digits", "eval_fraction": 0.2},
        "preprocess": {"normalize": {"mean": [0.5], "std": [0.5]}},
        "training": {"epochs": epochs, "global_batch_size": 64, "micro_batch_size": 32,
                     "seed": seed, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
        "distribution": {"trainers": 2, "aggregator_shards": 2, "mode": "sync"},
    }  # fmt: skip


def run_one(task: tuple[str, int, argparse.Namespace]) -> tuple[str, int, list[float]]:
    """(setting, seed, eval accuracy after each epoch) of one simulated job."""
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional as F

    from conveyor.training.jobspec import JobSpec
    from conveyor.training.plan import split_ids
    from conveyor.training.slicing import build_job_model
    from loadtests.distorted_digits import distorted_digits
    from loadtests.local_outer import TRAINERS, global_batches, train_simulated

    setting, seed, args = task
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    window, outer = SETTINGS[setting]
    spec = JobSpec.from_dict(job_spec(seed, args.epochs))
    images, labels = distorted_digits(args.samples, size=args.size, seed=seed, eval_fraction=0.2)
    x_all = (torch.from_numpy(images).float()[:, None] / 255.0 - 0.5) / 0.5  # [S, 1, H, W]
    y_all = torch.from_numpy(labels)
    train_ids, eval_ids = split_ids(len(labels), spec.dataset.eval_fraction, seed)
    eval_rows = torch.as_tensor(np.asarray(eval_ids))

    def build() -> nn.Module:
        return build_job_model(spec, num_classes=10, sample_shape=(1, args.size, args.size))

    def loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x_all[rows]), y_all[rows])

    found: list[float] = []

    def evaluate(model: nn.Module) -> None:
        hits = 0
        with torch.no_grad():
            for rows in torch.split(eval_rows, 500):
                hits += int((model(x_all[rows]).argmax(1) == y_all[rows]).sum())
        found.append(hits / len(eval_rows))

    batches = global_batches(
        train_ids, seed, args.epochs, spec.training.micro_batch_size * TRAINERS
    )
    train_simulated(spec, build, loss, batches, window=window, outer_spec=outer,
                    after_epoch=evaluate)  # fmt: skip
    return setting, seed, found


def first_epoch_at(curve: list[float], target: float) -> int | None:
    """The first epoch (1-based) whose accuracy is at least ``target``; None if none is."""
    return next((epoch for epoch, value in enumerate(curve, 1) if value >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--target", type=float, default=0.85, help="accuracy to report reaching")
    parser.add_argument("--procs", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    tasks = [(name, seed, args) for seed in seeds for name in names]
    curves: dict[str, list[list[float]]] = {name: [] for name in names}
    with multiprocessing.get_context("spawn").Pool(args.procs) as pool:
        for name, seed, curve in pool.imap_unordered(run_one, tasks):
            curves[name].append(curve)
            print(f"{name:20s} seed {seed}: " + " ".join(f"{a:.3f}" for a in curve), flush=True)
    line: dict[str, Any] = {}
    for name, runs in curves.items():
        mean = [statistics.fmean(epoch) for epoch in zip(*runs, strict=True)]
        print(f"{name:20s} mean by epoch: " + " ".join(f"{a:.3f}" for a in mean))
        line[name] = round(mean[-1], 4)
        line[f"{name} epoch to {args.target}"] = first_epoch_at(mean, args.target)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
