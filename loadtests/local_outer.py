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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
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


def train_simulated(
    spec: JobSpec,
    build: Callable[[], nn.Module],
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    epochs: Iterable[list[torch.Tensor]],
    *,
    window: int,
    outer_spec: dict[str, Any] | None,
    overlap: int = 0,
    after_epoch: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """The model ``build`` makes (the job's version 0) trained as two trainers of ``spec``
    would: ``epochs`` yields each epoch's global batches (sample ids; trainer r takes the r-th
    micro-batch of each), ``loss(model, ids)`` is the mean loss of a micro-batch; sync
    (``outer_spec`` None) steps ``spec``'s optimizer on the global batch, local mode takes
    ``window`` inner steps per trainer and one outer step of ``outer_spec`` on the
    sample-weighted mean delta, its first ``overlap`` steps (after the first window) carried.
    ``after_epoch(model)``, when given, sees the model at each epoch's end (local mode: the
    version)."""
    model = build()
    layout = ParamLayout.from_model(model)
    version = torch.nn.Parameter(layout.flatten_params(model))  # [N], the published parameters
    micro = spec.training.micro_batch_size
    if outer_spec is None:  # sync: one optimizer over the version, the global batch per step
        optimizer = build_optimizer(spec.training.optimizer, model.parameters())
        for steps in epochs:
            for rows in steps:
                loss(model, rows).backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                model.zero_grad(set_to_none=True)
            if after_epoch is not None:
                after_epoch(model)
        return model
    outer = build_optimizer(OptimizerSpec(**outer_spec), [version])
    replicas = [build() for _ in range(TRAINERS)]
    inners = [build_optimizer(spec.training.optimizer, r.parameters()) for r in replicas]
    for steps in epochs:
        for first in range(0, len(steps), window):
            window_steps = steps[first : first + window]
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
                    loss(replica, part).backward()  # type: ignore[no-untyped-call]
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
        if after_epoch is not None:
            layout.load_flat(model, version.detach())
            after_epoch(model)
    layout.load_flat(model, version.detach())
    return model


def global_batches(
    train_ids: np.ndarray, seed: int, epochs: int, size: int
) -> Iterator[list[torch.Tensor]]:
    """Each epoch's global batches of ``size`` sample ids, in the plan's order."""
    for epoch in range(epochs):
        order = torch.as_tensor(np.asarray(epoch_order(train_ids, seed, epoch)))
        yield [order[i : i + size] for i in range(0, len(order), size)]


def local_accuracy(setting: str, *, seed: int, epochs: int = 5) -> float:
    """Eval accuracy of the digits demo trained with ``setting`` (a key of SETTINGS)."""
    window, inner_spec, outer_spec = SETTINGS[setting]
    data: dict[str, Any] = yaml.safe_load(DEMO_SPEC.read_text())
    data["training"].update(seed=seed, epochs=epochs)
    if inner_spec is not None:
        data["training"]["optimizer"] = inner_spec
    spec = JobSpec.from_dict(data)
    dataset = open_array_dataset(spec.dataset.uri)
    train_ids, eval_ids = split_ids(dataset.num_samples, spec.dataset.eval_fraction, seed)
    shape = dataset.sample_shape
    norm = spec.preprocess.normalize
    assert norm is not None
    mean = torch.tensor(norm.mean).view(1, -1, 1, 1)
    std = torch.tensor(norm.std).view(1, -1, 1, 1)
    images, labels = dataset.read(list(range(dataset.num_samples)))
    x_all = (torch.from_numpy(np.asarray(images)).float() / 255.0 - mean) / std  # [S, C, H, W]
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.int64)

    def build() -> nn.Module:
        return build_job_model(spec, num_classes=dataset.num_classes, sample_shape=shape)

    def loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x_all[rows]), y_all[rows])

    batches = global_batches(train_ids, seed, epochs, spec.training.micro_batch_size * TRAINERS)
    model = train_simulated(spec, build, loss, batches, window=window, outer_spec=outer_spec,
                            overlap=overlap_of(setting))  # fmt: skip
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
