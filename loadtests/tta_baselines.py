"""The baselines of bench_time_to_accuracy.py: plain single-process PyTorch and DDP over gloo,
trained for the job's epochs with an evaluation at each epoch's end.

One ``torch.multiprocessing`` spawn of ``world`` processes (1 torch thread each) runs, for each
case, rank 0 alone on the whole global batch (plain), then every rank on its share with DDP's
all-reduce. Same model build, seeded weights, optimizer, learning rate, split and per-epoch
sample order as the job spec Conveyor trains; the samples are read and normalised before the
clock starts (the baselines get their data for free: the comparison is of training systems).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loadtests.ddp_baseline import join_gloo


def _train(spec_dict: dict[str, Any], *, world: int, rank: int) -> dict[str, Any]:
    """Train the job's epochs; {"epochs": [{"elapsed_s", "eval_accuracy"}], "samples"}.
    ``elapsed_s`` counts from the start of training to the end of each epoch's evaluation."""
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel

    from conveyor.training.datasets import open_array_dataset
    from conveyor.training.jobspec import JobSpec
    from conveyor.training.optim import build_optimizer
    from conveyor.training.plan import epoch_order, split_ids
    from conveyor.training.slicing import build_job_model

    spec = JobSpec.from_dict(spec_dict)
    dataset = open_array_dataset(spec.dataset.uri)
    train_ids, eval_ids = split_ids(
        dataset.num_samples, spec.dataset.eval_fraction, spec.training.seed
    )
    images, labels = dataset.read(list(range(dataset.num_samples)))  # uint8 [S,C,H,W], [S]
    norm = spec.preprocess.normalize
    mean = torch.tensor(norm.mean if norm else [0.0]).view(1, -1, 1, 1)
    std = torch.tensor(norm.std if norm else [1.0]).view(1, -1, 1, 1)
    x_all = (torch.from_numpy(np.asarray(images)).float() / 255.0 - mean) / std
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    eval_rows = torch.as_tensor(np.asarray(eval_ids), dtype=torch.int64)
    model = build_job_model(
        spec, num_classes=dataset.num_classes, sample_shape=dataset.sample_shape
    )
    trained: torch.nn.Module = DistributedDataParallel(model) if world > 1 else model
    optimizer = build_optimizer(spec.training.optimizer, list(model.parameters()))
    batch = spec.training.global_batch_size
    epochs: list[dict[str, float]] = []
    samples = 0
    if world > 1:
        dist.barrier()
    started = time.perf_counter()
    for epoch in range(spec.training.epochs):
        order = torch.as_tensor(np.asarray(epoch_order(train_ids, spec.training.seed, epoch)))
        model.train()
        for first in range(0, len(order), batch):
            rows = order[first : first + batch]
            mine = rows[rank::world]  # this rank's share of the global batch
            loss = F.cross_entropy(trained(x_all[mine]), y_all[mine])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            samples += len(rows)
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(x_all[part]).argmax(1) == y_all[part]).sum())
                for part in torch.split(eval_rows, 256)
            )
        epochs.append(
            {
                "elapsed_s": time.perf_counter() - started,
                "eval_accuracy": correct / max(1, len(eval_rows)),
            }
        )
    return {"epochs": epochs, "samples": samples // world * world}


def _spawned_worker(
    rank: int, world: int, port: int, specs: dict[str, dict[str, Any]], out: str
) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, port)
    found: dict[str, dict[str, Any]] = {}
    for name, spec in specs.items():
        if rank == 0:
            found[name] = {"plain": _train(spec, world=1, rank=0)}
        dist.barrier()
        ddp = _train(spec, world=world, rank=rank)
        if rank == 0:
            found[name]["ddp"] = ddp
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))


def run_baselines(specs: dict[str, dict[str, Any]], world: int) -> dict[str, dict[str, Any]]:
    """Plain and DDP on every case spec, in one spawn of ``world`` processes:
    {case: {"plain" | "ddp": {"epochs": [...], "samples"}}}."""
    from torch.multiprocessing.spawn import spawn

    from conveyor.embedded.broker import free_port

    with tempfile.TemporaryDirectory(prefix="bench-tta-") as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(  # type: ignore[no-untyped-call]
            _spawned_worker,
            args=(world, free_port("127.0.0.1"), specs, out),
            nprocs=world,
            join=True,
        )
        found: dict[str, dict[str, Any]] = json.loads(Path(out).read_text())
    return found
