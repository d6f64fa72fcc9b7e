"""The baselines of bench_aggregation.py: local training and torch.distributed DDP over gloo.

One ``torch.multiprocessing`` spawn of ``world`` processes (1 torch thread each, own sessions)
times, for each model case, ``timed_steps`` steps after ``warmup_steps``: first rank 0 alone on
the whole global batch (local, the floor), then every rank on its share with DDP's all-reduce.
Same model build, seeded weights, optimizer and data order as the job spec Conveyor trains.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class Case:
    """One model case: the job spec every system trains, and how many steps the baselines time."""

    name: str
    description: str
    spec: dict[str, Any]
    warmup_steps: int
    timed_steps: int


def _timed_steps(
    spec_dict: dict[str, Any], *, warmup: int, timed: int, world: int, rank: int
) -> list[float]:
    """Seconds of each of ``timed`` steps after ``warmup`` steps of the job's model, optimizer
    and data, the global batch split over ``world`` processes (DDP over the default process
    group when world > 1, plain torch otherwise). Batches are prepared beforehand."""
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
    train_ids, _ = split_ids(dataset.num_samples, spec.dataset.eval_fraction, spec.training.seed)
    order = epoch_order(train_ids, spec.training.seed, 0)
    per_rank = spec.training.global_batch_size // world
    steps = warmup + timed
    ids = np.resize(order, steps * spec.training.global_batch_size)
    mine = ids.reshape(steps, world, per_rank)[:, rank]  # [steps, per_rank]
    unique = np.unique(mine)
    images, labels = dataset.read(unique.tolist())  # uint8 [U,C,H,W], [U]
    norm = spec.preprocess.normalize
    mean = torch.tensor(norm.mean if norm else [0.0]).view(1, -1, 1, 1)
    std = torch.tensor(norm.std if norm else [1.0]).view(1, -1, 1, 1)
    x_all = (torch.from_numpy(np.asarray(images)).float() / 255.0 - mean) / std
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    rows = torch.from_numpy(np.searchsorted(unique, mine))  # [steps, per_rank]
    batches = [(x_all[r], y_all[r]) for r in rows]  # [per_rank,C,H,W], [per_rank]
    model = build_job_model(
        spec, num_classes=dataset.num_classes, sample_shape=dataset.sample_shape
    )
    trained: torch.nn.Module = DistributedDataParallel(model) if world > 1 else model
    optimizer = build_optimizer(spec.training.optimizer, list(model.parameters()))
    times: list[float] = []
    for step, (x, y) in enumerate(batches):
        if step == warmup and world > 1:
            dist.barrier()
        started = time.perf_counter()
        loss = F.cross_entropy(trained(x), y)  # mean: DDP averages it over the ranks
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times


def join_gloo(rank: int, world: int, port: int) -> None:
    """Set a spawned baseline process up (own session, 1 torch thread) and join the gloo
    process group of ``world`` ranks on 127.0.0.1:``port``."""
    import torch.distributed as dist

    os.setsid()  # own session, as every Conveyor service (autogroup scheduling treats all alike)
    # small_cnn's first conv has in_channels 1: its weight's strides differ from its gradient's
    # in a size-1 dimension only, which DDP reports on every backward. Harmless (288 elements).
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _spawned_worker(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], out: str
) -> None:
    """For each case: local (rank 0 alone, the others wait in a barrier, which takes no CPU),
    then DDP over gloo (every rank). Rank 0 writes {case: {"local": [s], "ddp": [s]}}."""
    import torch.distributed as dist

    join_gloo(rank, world, port)
    found: dict[str, dict[str, list[float]]] = {}
    for case in cases:
        steps = {"warmup": int(case["warmup_steps"]), "timed": int(case["timed_steps"])}
        if rank == 0:
            local = _timed_steps(case["spec"], world=1, rank=0, **steps)
            found[case["name"]] = {"local": local}
        dist.barrier()
        ddp = _timed_steps(case["spec"], world=world, rank=rank, **steps)
        if rank == 0:
            found[case["name"]]["ddp"] = ddp
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))


def run_baselines(cases: Sequence[Case], world: int) -> dict[str, dict[str, dict[str, float]]]:
    """Local and DDP on every case, in one spawn of ``world`` processes:
    {case: {"local" | "ddp": {"per_step_s", "median_step_s"}}}."""
    from torch.multiprocessing.spawn import spawn

    from conveyor.embedded.broker import free_port

    config = [
        {
            "name": case.name,
            "spec": case.spec,
            "warmup_steps": case.warmup_steps,
            "timed_steps": case.timed_steps,
        }
        for case in cases
    ]
    with tempfile.TemporaryDirectory(prefix="bench-agg-") as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(  # type: ignore[no-untyped-call]
            _spawned_worker,
            args=(world, free_port("127.0.0.1"), config, out),
            nprocs=world,
            join=True,
        )
        found = json.loads(Path(out).read_text())
    return {
        name: {
            system: {"per_step_s": statistics.fmean(s), "median_step_s": statistics.median(s)}
            for system, s in systems.items()
        }
        for name, systems in found.items()
    }
