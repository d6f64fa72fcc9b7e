"""Accuracy of every training mode on a harder real-image task, against sync and plain torch.

The task (``loadtests/distorted_digits.py``): scikit-learn's handwritten digits upsampled to
``--size`` pixels under random affine and elastic distortion with pixel noise, eval images from
held-out writers; ``--samples`` samples, 20% eval. Model small_cnn, global batch 64 of
micro-batches of 32, SGD lr 0.1 momentum 0.9 (constant, or with
``--schedule cosine`` decayed to 0 over the job), 2 trainers, 2 slices, ``--epochs`` epochs.
Systems, each trained in process by the reference of its update rule
(``loadtests/mode_reference.py``; the same seeds, data, initial weights and sample order):

    plain            one torch SGD over the model, the global batch per step
    sync             the gradient plane's sync step (2 trainers' summed gradients, one step)
    ssp              bounded staleness s = 2, two equal trainers
    ssp_slow         bounded staleness s = 2, one trainer at 0.6x the other's speed
    topk             top-k 1% with error feedback and DGC momentum correction (the default)
    topk_no_mc       top-k 1% with error feedback, momentum at the aggregator

    .venv/bin/python -m loadtests.bench_mode_accuracy --seeds 3             # CPU: ~1 h
    .venv/bin/python -m loadtests.bench_mode_accuracy --device cuda --procs 12
    .venv/bin/python -m loadtests.bench_mode_accuracy --schedule cosine --systems sync,ssp

Prints each system's accuracy per seed and mean; the last line is one JSON object of mean
accuracies and of deltas in points against sync (sync minus the mode):
    {"sync", "plain", "ssp", "ssp_slow", "topk", "topk_no_mc",
     "ssp_delta_vs_sync", "ssp_slow_delta_vs_sync", "topk_delta_vs_sync", ...}
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
from typing import Any

SYSTEMS: dict[str, dict[str, Any]] = {
    "plain": {"plain": True},
    "sync": {},
    "ssp": {"mode": "ssp", "speeds": (1.0, 1.0)},
    "ssp_slow": {"mode": "ssp", "speeds": (1.0, 0.6)},
    "topk": {"compression": {"kind": "topk", "ratio": 0.01}},
    "topk_no_mc": {"compression": {"kind": "topk", "ratio": 0.01, "momentum_correction": False}},
}


def job_spec(
    seed: int, epochs: int, system: str, schedule: str = "constant", lr: float = 0.1
) -> dict[str, Any]:
    """The job spec of ``system`` (the dataset is passed as arrays: the uri is a label), with
    the learning-rate ``schedule`` (``constant`` or ``cosine`` to 0 over the job) from
    ``lr``."""
    options = SYSTEMS[system]
    distribution: dict[str, Any] = {"trainers": 2, "aggregator_shards": 2, "mode": "sync"}
    if options.get("mode") == "ssp":
        distribution.update(mode="ssp", staleness=2)
    if "compression" in options:
        distribution["compression"] = dict(options["compression"])
    return {
        "name": f"modes-{system}",
        "model": {"name": "small_cnn"},
        "dataset": {"uri": "npz://distorted-digits", "eval_fraction": 0.2},
        "preprocess": {"normalize": {"mean": [0.5], "std": [0.5]}},
        "training": {"epochs": epochs, "global_batch_size": 64, "micro_batch_size": 32,
                     "seed": seed, "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9},
                     "lr_schedule": {"name": schedule}},
        "distribution": distribution,
    }  # fmt: skip


def run_one(task: tuple[str, int, argparse.Namespace]) -> tuple[str, int, float]:
    """(system, seed, eval accuracy) of one training run."""
    import torch

    from loadtests.distorted_digits import distorted_digits
    from loadtests.mode_reference import Arrays, reference_accuracy

    system, seed, args = task
    torch.set_num_threads(1)
    x, y = distorted_digits(args.samples, size=args.size, seed=seed, eval_fraction=0.2)
    options = SYSTEMS[system]
    accuracy = reference_accuracy(
        job_spec(seed, args.epochs, system, args.schedule, args.lr), Arrays(x[:, None], y),
        plain=bool(options.get("plain")), speeds=options.get("speeds"), device=args.device,
    )  # fmt: skip
    return system, seed, accuracy


def summary(found: dict[str, list[float]]) -> dict[str, float]:
    """Mean accuracy per system and each mode's delta against sync, in points."""
    means = {system: round(statistics.fmean(values), 4) for system, values in found.items()}
    line: dict[str, float] = dict(means)
    for system in means:
        if system not in ("sync", "plain") and "sync" in means:
            line[f"{system}_delta_vs_sync"] = round(100 * (means["sync"] - means[system]), 2)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--procs", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--schedule", choices=("constant", "cosine"), default="constant",
        help="learning rate over the job: constant, or cosine decay to 0",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (peak)")
    args = parser.parse_args()
    tasks = [(s, seed, args) for seed in range(args.seeds) for s in args.systems.split(",")]
    found: dict[str, list[float]] = {s: [] for s in args.systems.split(",")}
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.procs) as pool:
        for system, seed, accuracy in pool.imap_unordered(run_one, tasks):
            found[system].append(accuracy)
            print(f"{system:12s} seed {seed}: {accuracy:.4f}", flush=True)
    for system, values in found.items():
        print(f"{system:12s} " + " ".join(f"{a:.4f}" for a in values)
              + f"  mean {statistics.fmean(values):.4f}")  # fmt: skip
    print(json.dumps(summary(found)))


if __name__ == "__main__":
    main()
