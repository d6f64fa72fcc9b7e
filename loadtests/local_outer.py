"""Local mode (DiLoCo-style) on the digits demo, simulated in process: which outer optimizer
fits which inner one.

Two simulated trainers each take H steps of the job's optimizer (inner) on their micro-batch of
each global batch (the demo: 2 x 32), from the current version; the sample-weighted mean of
their parameter deltas is the outer gradient of one outer optimizer step, as the slice owners
apply it. A setting with overlap_steps (tau) takes the first tau inner steps of each window
after the first on the trainer's own parameters as its last window ended, then moves them onto
the new version keeping their progress (``new + (local - sent)``), as the trainers do. No
broker: seconds per setting.

    .venv/bin/python -m loadtests.local_outer --seeds 2

Prints one line per setting (eval accuracy per seed), then a JSON object of the means.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.nn import functional as F

from conveyor.training.datasets import open_array_dataset
from conveyor.training.jobspec import JobSpec, OptimizerSpec
from conveyor.training.optim import build_optimizer
from conveyor.training.plan import epoch_order, split_ids
from conveyor.training.slicing import ParamLayout, build_job_model

DEMO_SPEC = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"
TRAINERS = 2

DEFAULT_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.5, "nesterov": True}
SETTINGS: dict[str, tuple[int, dict[str, Any] | None, dict[str, Any] | None]] = {
    # name: (H, inner optimizer (None: the demo's), outer optimizer (None: sync, no outer))
    "sync": (1, None, None),
    "H8 outer sgd lr 1 (averaging)": (8, None, {"name": "sgd", "lr": 1.0}),
    "H8 outer nesterov lr 0.7 m 0.9 (DiLoCo)": (
        8, None, {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}),
    "H8 outer nesterov lr 0.7 m 0.5 (the default)": (
        8, None, {"name": "sgd", "lr": 0.7, "momentum": 0.5, "nesterov": True}),
    "H8 outer nesterov lr 1 m 0.5": (
        8, None, {"name": "sgd", "lr": 1.0, "momentum": 0.5, "nesterov": True}),
    "H8 inner sgd no momentum, outer nesterov lr 0.7 m 0.9": (
        8, {"name": "sgd", "lr": 0.1},
        {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}),
    "H8 inner adamw 1e-3, outer nesterov lr 0.7 m 0.9": (
        8, {"name": "adamw", "lr": 0.001},
        {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}),
    "H8 default outer, overlap_steps 1": (8, None, DEFAULT_OUTER),
    "H8 default outer, overlap_steps 2": (8, None, DEFAULT_OUTER),
    "H8 default outer, overlap_steps 4": (8, None, DEFAULT_OUTER),
}  # fmt: skip


def overlap_of(setting: str) -> int:
    """The overlap_steps a setting's name ends with (0: none)."""
    head, _, steps = setting.rpartition("overlap_steps ")
    return int(steps) if head else 0


def local_accuracy(setting: str, *, seed: int, epochs: int = 5) -> float:
    """Eval accuracy of the digits demo trained with ``setting`` (a key of SETTINGS)."""
    window, inner_spec, outer_spec = SETTINGS[setting]
    overlap = overlap_of(setting)
    data: dict[str, Any] = yaml.safe_load(DEMO_SPEC.read_text())
    data["training"].update(seed=seed, epochs=epochs)
    if inner_spec is not None:
        data["training"]["optimizer"] = inner_spec
    spec = JobSpec.from_dict(data)
    dataset = open_array_dataset(spec.dataset.uri)
    train_ids, eval_ids = split_ids(dataset.num_samples, spec.dataset.eval_fraction, seed)
    shape = dataset.sample_shape
    model = build_job_model(spec, num_classes=dataset.num_classes, sample_shape=shape)
    layout = ParamLayout.from_model(model)
    norm = spec.preprocess.normalize
    assert norm is not None
    mean = torch.tensor(norm.mean).view(1, -1, 1, 1)
    std = torch.tensor(norm.std).view(1, -1, 1, 1)
    images, labels = dataset.read(list(range(dataset.num_samples)))
    x_all = (torch.from_numpy(np.asarray(images)).float() / 255.0 - mean) / std  # [S, C, H, W]
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.int64)

    version = torch.nn.Parameter(layout.flatten_params(model))  # [N], the published parameters
    outer = None if outer_spec is None else build_optimizer(OptimizerSpec(**outer_spec), [version])
    replicas = [
        build_job_model(spec, num_classes=dataset.num_classes, sample_shape=shape)
        for _ in range(TRAINERS)
    ]
    inners = [build_optimizer(spec.training.optimizer, r.parameters()) for r in replicas]
    if outer is None:  # sync: one optimizer over the version, the global batch per step
        layout.load_flat(model, version.detach())
        inners = [build_optimizer(spec.training.optimizer, model.parameters())]
    micro = spec.training.micro_batch_size
    for epoch in range(epochs):
        order = torch.as_tensor(np.asarray(epoch_order(train_ids, seed, epoch)))
        steps = [order[i : i + micro * TRAINERS] for i in range(0, len(order), micro * TRAINERS)]
        for first in range(0, len(steps), window):
            window_steps = steps[first : first + window]
            if outer is None:
                for rows in window_steps:
                    F.cross_entropy(model(x_all[rows]), y_all[rows]).backward()  # type: ignore[no-untyped-call]
                    inners[0].step()
                    model.zero_grad(set_to_none=True)
                continue
            delta = torch.zeros_like(version)  # [N]
            samples = 0
            for rank, (replica, inner) in enumerate(zip(replicas, inners, strict=True)):
                carried = overlap if first > 0 else 0
                sent = layout.flatten_params(replica)  # [N], as its last window ended
                if not carried:
                    layout.load_flat(replica, version.detach())
                mine = 0
                for index, rows in enumerate(window_steps):
                    if index == carried > 0:  # the new version is in: move onto it
                        moved = version.detach() + (layout.flatten_params(replica) - sent)
                        layout.load_flat(replica, moved)
                    part = rows[rank * micro : (rank + 1) * micro]
                    if len(part) == 0:
                        continue
                    F.cross_entropy(replica(x_all[part]), y_all[part]).backward()  # type: ignore[no-untyped-call]
                    inner.step()
                    replica.zero_grad(set_to_none=True)
                    mine += len(part)
                if carried >= len(window_steps) > 0:  # a short window: every step carried
                    moved = version.detach() + (layout.flatten_params(replica) - sent)
                    layout.load_flat(replica, moved)
                delta += (version.detach() - layout.flatten_params(replica)) * mine
                samples += mine
            version.grad = delta / samples
            outer.step()
    layout.load_flat(model, version.detach() if outer is not None else layout.flatten_params(model))
    rows = torch.as_tensor(np.asarray(eval_ids))
    with torch.no_grad():
        return float((model(x_all[rows]).argmax(1) == y_all[rows]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    means: dict[str, float] = {}
    for setting in SETTINGS:
        found = [local_accuracy(setting, seed=s, epochs=args.epochs) for s in range(args.seeds)]
        means[setting] = statistics.fmean(found)
        print(f"{setting:55} " + " ".join(f"{a:.3f}" for a in found), flush=True)
    print(json.dumps(means))


if __name__ == "__main__":
    main()
