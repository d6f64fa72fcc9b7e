"""Pipeline benchmark: Conveyor end to end vs an in-process torch DataLoader, side by side.

Same model, preprocessing, optimizer, batch sizes, torch threads (--threads, default 1: with
other processes on a small machine, intra-op threads only contend) and machine. Scenarios:
    synthetic  synthetic://?n=N&shape=3x32x32 with augment [random_crop, hflip, cpu_cost{ms}]
               and small_cnn (a CPU-heavy augmentation, like examples/synthetic.yaml; on 2
               cores one preprocessing process at 1 ms a sample is about as fast as the trainer);
    light      the same job with cpu_cost --light-cost-ms (0.25 ms): preprocessing has room to
               spare and the trainer's steps are the bottleneck, so every millisecond a sync
               step spends on the gradient plane (through the broker and the aggregator) shows;
    digits     examples/digits.yaml (its epochs raised by --digits-epochs so that the
               measured window lasts seconds, not a fraction of one).
The synthetic jobs have 8192 samples by default (--n): the sharder releases up to
max_lead_batches (64 micro-batches, 4096 samples) before the trainer starts, and a job not much
longer than that lead would measure the start-up backlog draining, not the pipeline.
Each repeat runs both systems, in alternating order:
    conveyor    a fresh ``conveyor up`` stack (broker + gateway, sharder, --preprocessors
                preprocessor(s), trainer processes), the job submitted through the gateway;
                throughput and data wait come from the trainer's own reports on the broker
                (progress events, heartbeats), the backlog from the batches topic's end offsets
                against the consumed count of the trainer's progress events;
    dataloader  one process (a subprocess of this script): the same dataset, split, per-epoch
                order and augmentation (conveyor.services.preprocessor.augment, keyed by
                seed/epoch/sample id,
                so both see the same pixels), uint8 micro-batches from a DataLoader with
                --workers persistent workers (numpy arrays through the worker pipe by default:
                torch's per-tensor fd hand-over costs milliseconds per batch here), normalised
                in the loop, the same model and optimizer, each epoch's eval batches after its
                train batches (Conveyor augments and evaluates them too).
Both are measured the same way over the steps after the warm-up (--warmup-steps, default 10% of
the job's steps): samples/s = samples trained / wall time of that window; data wait = time the
step loop was blocked on its next batch / wall time of the window. The trainer's own summary
figures (samples / (wait + compute) over the whole job, which leaves out the step loop's other
time) are shown beside them. Every process runs in its own session, so that autogroup
scheduling treats both systems alike on a machine loaded by other work.
ratio = median over repeats of conveyor/dataloader samples/s, both taken in the same repeat.
Also reported: peak RSS (VmHWM) and CPU seconds of every process, and CPU seconds of all
processes per sample trained, Conveyor / DataLoader, which other load on the machine disturbs
far less than wall-clock rates do.
The last line printed is one JSON object,
{"pipeline_vs_dataloader": r, "data_wait_ratio": w, "baseline_data_wait_ratio": b,
 "cpu_per_sample_vs_dataloader": c, "digits_...": ...},
for the first scenario (synthetic by default), with light_* and digits_* keys for the others.

    .venv/bin/python -m loadtests.bench_pipeline            # 3 repeats, both scenarios
    .venv/bin/python -m loadtests.bench_pipeline --quick    # 1 repeat, smaller jobs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rich.console import Console
from rich.table import Table

from conveyor.platform.messages import COORDINATOR_WORKER_ID
from loadtests._bench_common import (
    ConveyorStack,
    JobWatcher,
    Progress,
    WaitPoint,
    child_pids,
    cpu_seconds,
    mib,
    pct,
    proc_memory,
    runqueue_wait_seconds,
    scale_supported,
    thread_cpu_seconds,
    wait_window_after,
    window_after,
)

ROOT = Path(__file__).resolve().parent.parent
TRAINER_ENV = {
    # Heartbeats carry the trainer's cumulative wait and compute times: one a second (default:
    # every 3 s) dates the data-wait window finely enough. They go to the job's control topic,
    # which no service reads yet. Progress events keep their default interval (0.5 s).
    "CONVEYOR_TRAINER_HEARTBEAT_INTERVAL_S": "1.0",
}
JOB_TIMEOUT_S = 600.0


# -- scenarios -----------------------------------------------------------------------------------


def synthetic_spec(*, n: int, epochs: int, cost_ms: float, threads: int) -> dict[str, Any]:
    """The CPU-heavy synthetic job (examples/synthetic.yaml with one trainer)."""
    from conveyor.training.jobspec import JobSpec

    text = f"""
name: bench-synthetic
model: {{name: small_cnn, num_classes: 10}}
dataset: {{uri: "synthetic://?n={n}&shape=3x32x32&classes=10", eval_fraction: 0.1}}
preprocess:
  normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}
  augment:
    - {{name: random_crop, padding: 4}}
    - {{name: hflip, p: 0.5}}
    - {{name: cpu_cost, ms: {cost_ms}}}
training:
  epochs: {epochs}
  global_batch_size: 256
  micro_batch_size: 64
  optimizer: {{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005}}
  precision: fp32
  seed: 1
distribution: {{trainers: 1, aggregator_shards: 1, mode: sync, compression: {{kind: none}}}}
checkpoint: {{every_steps: 100, keep_last: 2}}
resources: {{device: auto, threads: {threads}}}
flow: {{max_lead_batches: 64}}
"""
    return JobSpec.from_yaml(text).to_dict()


def digits_spec(*, epochs: int, threads: int) -> dict[str, Any]:
    """examples/digits.yaml with ``epochs`` and the torch thread count set."""
    from conveyor.training.jobspec import JobSpec

    data = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    data["training"]["epochs"] = epochs
    data["resources"] = {**data.get("resources", {}), "threads": threads}
    return JobSpec.from_dict(data).to_dict()


def total_steps(spec: dict[str, Any]) -> int:
    """Optimizer steps of the whole job (the dataset is opened to count its samples)."""
    from conveyor.training.datasets import open_dataset
    from conveyor.training.jobspec import JobSpec

    job = JobSpec.from_dict(spec)
    samples = open_dataset(job.dataset.uri).num_samples
    train = samples - int(samples * job.dataset.eval_fraction)
    micro_batches = math.ceil(train / job.training.micro_batch_size)
    return job.training.epochs * math.ceil(micro_batches / job.micro_batches_per_step)


# -- the DataLoader baseline (runs in its own process) -------------------------------------------

TRAIN, EVAL = 0, 1


class ReleaseOrder(torch.utils.data.Sampler[list[tuple[int, int, int]]]):
    """Micro-batches of one epoch in Conveyor's release order: the train ids permuted by
    ``default_rng([seed, epoch])``, then the eval ids. Each index is (epoch, split, sample id),
    so persistent workers learn the epoch (the augmentation key) from the index itself."""

    def __init__(self, train_ids: np.ndarray, eval_ids: np.ndarray, micro: int, seed: int):
        self.train_ids, self.eval_ids = train_ids, eval_ids
        self.micro, self.seed, self.epoch = micro, seed, 0

    def _chunks(self, ids: np.ndarray, split: int) -> Iterator[list[tuple[int, int, int]]]:
        for start in range(0, len(ids), self.micro):
            yield [(self.epoch, split, int(i)) for i in ids[start : start + self.micro]]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        from conveyor.training.plan import epoch_order

        yield from self._chunks(epoch_order(self.train_ids, self.seed, self.epoch), TRAIN)
        yield from self._chunks(self.eval_ids, EVAL)

    def __len__(self) -> int:
        return -(-len(self.train_ids) // self.micro) + -(-len(self.eval_ids) // self.micro)


@dataclass(slots=True)
class HostBatch:
    """One collated micro-batch as a DataLoader worker hands it over.

    ``x`` uint8 [B,C,H,W] and ``y`` int64 [B] are numpy arrays (pickled through the worker's
    pipe) or tensors (torch's shared-memory hand-over). The DataLoader's pin-memory thread
    calls :meth:`pin_memory`, which makes pinned tensors of either.
    """

    x: np.ndarray | torch.Tensor
    y: np.ndarray | torch.Tensor
    epoch: int
    split: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) as tensors; numpy arrays are wrapped without a copy."""
        x, y = self.x, self.y
        return (
            torch.from_numpy(x) if isinstance(x, np.ndarray) else x,
            torch.from_numpy(y) if isinstance(y, np.ndarray) else y,
        )

    def pin_memory(self) -> HostBatch:
        x, y = self.tensors()
        return HostBatch(x.pin_memory(), y.pin_memory(), self.epoch, self.split)


class AugmentedImages(torch.utils.data.Dataset[HostBatch]):
    """A conveyor dataset read a micro-batch at a time (``__getitems__``), decoded (image files,
    to ``channels``) and augmented like the preprocessor does, returned collated as a
    :class:`HostBatch`."""

    def __init__(
        self,
        dataset: Any,
        augmenter: Any,
        seed: int,
        *,
        numpy_transport: bool,
        channels: int,
        reduce: bool = True,
    ) -> None:
        self.dataset, self.augmenter, self.seed = dataset, augmenter, seed
        self.numpy_transport, self.channels, self.reduce = numpy_transport, channels, reduce

    def __len__(self) -> int:
        return int(self.dataset.num_samples)

    def __getitem__(self, index: tuple[int, int, int]) -> HostBatch:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[tuple[int, int, int]]) -> HostBatch:
        epoch, split = indices[0][0], indices[0][1]
        ids = [index[2] for index in indices]
        from conveyor.training.datasets import EncodedDataset, EncodedImage

        if isinstance(self.dataset, EncodedDataset):
            encoded, _bad = self.dataset.read_encoded(ids)  # the benchmark's files are sound
            images = [EncodedImage.parse(s.data, channels=self.channels) for s in encoded]
            y = np.array([sample.label for sample in encoded], dtype=np.int64)  # [B]
            x = self.augmenter.apply_encoded(
                images, ids, seed=self.seed, epoch=epoch, reduce=self.reduce
            ).x  # [B,C,H,W]
        else:
            x, y = self.dataset.read(ids)  # [B,C,H,W] uint8, [B] int64
            x = self.augmenter.apply(x, ids, seed=self.seed, epoch=epoch)
        x = np.ascontiguousarray(x)
        batch = HostBatch(x, y, epoch, split)
        if self.numpy_transport:
            return batch
        x_tensor, y_tensor = batch.tensors()
        return HostBatch(x_tensor, y_tensor, epoch, split)


def as_is(batch: Any) -> Any:
    """collate_fn: ``__getitems__`` already collated the batch."""
    return batch


def own_session(_: int) -> None:
    """worker_init_fn: put the worker in its own session, as every Conveyor service process is
    (``conveyor up`` starts them with ``start_new_session``). With autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) the kernel shares CPU fairly between sessions,
    so on a machine loaded by other work a process in its own session gets its own share."""
    os.setsid()


def baseline_main(config: dict[str, Any]) -> dict[str, Any]:
    """Train the job in this process with a DataLoader; returns the measurements."""
    from torch.nn import functional as F

    from conveyor.services.preprocessor.work import augmenter_for
    from conveyor.services.trainer.compute.engine import resolve_device
    from conveyor.training.datasets import open_dataset, output_shape
    from conveyor.training.jobspec import JobSpec
    from conveyor.training.models import build_model
    from conveyor.training.optim import build_optimizer
    from conveyor.training.plan import split_ids

    # CPU from here on, like the Conveyor trainer's from the job's submission: the job's set-up
    # (model, optimizer: its first construction imports torch._dynamo) counts for both.
    cpu_at_start = cpu_seconds(os.getpid()) or 0.0
    runq_at_start = runqueue_wait_seconds(os.getpid()) or 0.0
    spec_dict = config["spec"]
    spec = JobSpec.from_dict(spec_dict)
    training, workers = spec.training, int(config["workers"])
    if spec.resources.threads is not None:
        torch.set_num_threads(spec.resources.threads)
    device = resolve_device(spec.resources.device)
    dataset = open_dataset(spec.dataset.uri)
    preprocess = spec.preprocess
    channels, height, width = output_shape(
        dataset, image_size=preprocess.image_size, channels=preprocess.channels
    )
    train_ids, eval_ids = split_ids(dataset.num_samples, spec.dataset.eval_fraction, training.seed)
    order = ReleaseOrder(train_ids, eval_ids, training.micro_batch_size, training.seed)
    loader = torch.utils.data.DataLoader(
        AugmentedImages(
            dataset,
            augmenter_for(spec_dict["preprocess"]),
            training.seed,
            numpy_transport=config["transport"] == "numpy",
            channels=channels,
            reduce=config["decode"] == "reduced",
        ),
        batch_sampler=order,
        num_workers=workers,
        collate_fn=as_is,
        worker_init_fn=own_session,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=int(config["prefetch_factor"]) if workers > 0 else None,
    )
    torch.manual_seed(training.seed)
    options = {
        k: v for k, v in spec.model.options.items() if k not in ("num_classes", "in_channels")
    }
    model = build_model(
        spec.model.name,
        in_channels=channels,
        num_classes=dataset.num_classes,
        image_size=(height, width),
        **options,
    ).to(device)
    optimizer = build_optimizer(training.optimizer, list(model.parameters()))
    norm = spec.preprocess.normalize
    mean = torch.tensor(norm.mean if norm else [0.0], device=device).view(1, -1, 1, 1)
    std = torch.tensor(norm.std if norm else [1.0], device=device).view(1, -1, 1, 1)
    train_batches = -(-len(train_ids) // training.micro_batch_size)
    per_step = spec.micro_batches_per_step

    started = time.perf_counter()
    progress = [Progress(at_s=started, step=0, samples=0)]
    waits = [WaitPoint(at_s=started, step=0, wait_s=0.0, busy_s=0.0)]
    step = samples = 0
    wait_s = 0.0
    eval_correct = eval_samples = 0
    memory: dict[str, Any] = {}
    cpu: dict[str, float | None] = {}
    runq: dict[str, float | None] = {}
    for epoch in range(training.epochs):
        order.epoch = epoch
        model.train()
        micro = step_samples = trained = 0
        eval_correct = eval_samples = 0
        batches = iter(loader)
        while True:
            waited = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            x, y = batch.tensors()
            wait_s += time.perf_counter() - waited
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if batch.split == EVAL:  # after every train batch of the epoch, as in Conveyor
                model.eval()
                with torch.no_grad():
                    logits = model((x.float() / 255.0 - mean) / std)
                eval_correct += int((logits.argmax(dim=1) == y).sum())
                eval_samples += int(y.shape[0])
                continue
            logits = model((x.float() / 255.0 - mean) / std)  # [B,num_classes]
            loss = F.cross_entropy(logits, y, reduction="sum")
            loss.backward()  # type: ignore[no-untyped-call]
            loss.item()  # one device sync per micro-batch, as the trainer does
            micro, trained, step_samples = micro + 1, trained + 1, step_samples + int(y.shape[0])
            if micro == per_step or trained == train_batches:
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(1.0 / step_samples)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step, samples = step + 1, samples + step_samples
                micro = step_samples = 0
                now = time.perf_counter()
                progress.append(Progress(at_s=now, step=step, samples=samples))
                waits.append(WaitPoint(at_s=now, step=step, wait_s=wait_s, busy_s=now - started))
        if epoch == training.epochs - 1:
            # The persistent workers are still alive here: read their memory and CPU now.
            for index, pid in enumerate(child_pids(os.getpid()), start=1):
                memory[f"worker-{index}"] = proc_memory(pid)
                cpu[f"worker-{index}"] = cpu_seconds(pid)
                runq[f"worker-{index}"] = runqueue_wait_seconds(pid)
    total_s = time.perf_counter() - started
    memory["trainer"] = proc_memory(os.getpid())
    cpu["trainer"] = (cpu_seconds(os.getpid()) or 0.0) - cpu_at_start
    runq["trainer"] = (runqueue_wait_seconds(os.getpid()) or 0.0) - runq_at_start
    window = window_after(progress, int(config["warmup_steps"]))
    wait_window = wait_window_after(waits, int(config["warmup_steps"]))
    return {
        "samples_per_second": window.samples_per_second if window else None,
        "window_s": window.seconds if window else None,
        "data_wait_ratio": wait_window.wait_per_wall if wait_window else None,
        "trainer_wait_ratio": wait_window.wait_per_busy if wait_window else None,
        "accounted_share": wait_window.busy_per_wall if wait_window else None,
        "job_samples_per_second": samples / total_s,
        "job_data_wait_ratio": wait_s / total_s,
        "steps": step,
        "samples": samples,
        "eval_accuracy": eval_correct / eval_samples if eval_samples else None,
        "peak_rss_bytes": {k: v.peak_rss_bytes for k, v in memory.items() if v is not None},
        "cpu_s": cpu,
        "runq_s": runq,
    }


def run_baseline(
    spec: dict[str, Any], args: argparse.Namespace, warmup: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """The DataLoader baseline in a fresh process (its own peak RSS, no state from earlier
    runs); its result is the last line of its output."""
    config = {
        "spec": spec,
        "workers": args.workers,
        "prefetch_factor": args.prefetch_factor,
        "warmup_steps": warmup,
        "transport": args.baseline_transport,
        "decode": args.baseline_decode,
    }
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_pipeline", "--baseline-config", json.dumps(config)],
        cwd=ROOT,  # `loadtests` is importable from the repository root, installed or not
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
        start_new_session=True,  # see own_session
        env={**os.environ, **(env or {})},
    )
    if result.returncode != 0:
        raise RuntimeError(f"baseline failed ({result.returncode}): {result.stderr[-3000:]}")
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


# -- Conveyor ----------------------------------------------------------------------------------


def trainer_threads(pid: int) -> dict[str, float | None]:
    """CPU seconds of the trainer's main thread (its event loop) and of all its other threads
    (the compute thread, the copy thread, worker threads); Python 3.11 does not give threads
    OS-visible names, so the compute thread cannot be told apart by name."""
    threads = thread_cpu_seconds(pid)
    main = threads.pop("main", None)
    return {"trainer: event loop": main, "trainer: other threads": sum(threads.values())}


def run_conveyor(
    spec: dict[str, Any],
    args: argparse.Namespace,
    warmup: int,
    use_scale: bool,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start a fresh stack (``env`` added to its services' environment), submit ``spec``
    through the gateway, follow it to its end."""
    from conveyor.cli.client import GatewayClient
    from conveyor.platform.config import KafkaSettings
    from conveyor.training.jobspec import JobSpec

    stack = ConveyorStack(
        preprocessors=args.preprocessors, env={**TRAINER_ENV, **(env or {})}, use_scale=use_scale
    )
    watcher: JobWatcher | None = None
    try:
        stack.start()
        with GatewayClient(stack.gateway_url) as client:
            client.wait_ready()
            trainer_pid = dict(stack.processes())["trainer"]
            cpu_before = {**stack.cpu(), **trainer_threads(trainer_pid)}
            runq_before = stack.runqueue_wait()
            job = client.submit(spec)
        watcher = JobWatcher(
            bootstrap=stack.bootstrap,
            topic_prefix=KafkaSettings(bootstrap=stack.bootstrap).topic_prefix,
            job_id=job["id"],
        )
        watcher.start()
        event, _, data = watcher.wait_terminal(JOB_TIMEOUT_S)
        cpu_after = {**stack.cpu(), **trainer_threads(trainer_pid)}
        runq_after = stack.runqueue_wait()
        memory = stack.memory()
        if event != "completed":
            raise RuntimeError(f"job {job['id']} {event}: {data}")
        if watcher.undecodable:
            Console(stderr=True).log(f"warning: {watcher.undecodable} record(s) not decodable")
    finally:
        if watcher is not None:
            watcher.stop()
        stack.stop()

    progress_events = [(at, d) for name, at, d in watcher.events if name == "progress"]
    # The job's totals (optimizer steps = parameter versions, samples applied) come from the
    # coordinator's reports; the trainer's own reports carry its stage latencies.
    progress = [
        Progress(at, int(d["step"]), int(d["samples_trained"]))
        for at, d in progress_events
        if d.get("worker_id") == COORDINATOR_WORKER_ID
    ]
    trainer_events = [d for _, d in progress_events if d.get("worker_id") != COORDINATOR_WORKER_ID]
    waits = []
    for at, info in watcher.heartbeats:
        if "step_time_s" not in info or info.get("version") is None:
            continue  # a leaving trainer's last beat, or one before it joined the job
        version = int(info["version"])
        split = info["step_time_s"]  # mean seconds per step of each part, recent window
        steps, busy = max(1, version), sum(split.values())
        waits.append(WaitPoint(at, version, split["data_wait"] * steps, busy * steps))
    window = window_after(progress, warmup)
    wait_window = wait_window_after(waits, warmup)
    job_spec = JobSpec.from_dict(spec)
    shard_batches = math.ceil(job_spec.shard_size / job_spec.training.micro_batch_size)
    summary = data["summary"]
    return {
        "samples_per_second": window.samples_per_second if window else None,
        "window_s": window.seconds if window else None,
        "data_wait_ratio": wait_window.wait_per_wall if wait_window else None,
        "trainer_wait_ratio": wait_window.wait_per_busy if wait_window else None,
        "accounted_share": wait_window.busy_per_wall if wait_window else None,
        "job_samples_per_second": summary["samples_per_second"],
        "job_data_wait_ratio": summary["data_wait_ratio"],
        "steps": summary["steps"],
        "samples": summary["samples"],
        "eval_accuracy": summary["eval_accuracy"],
        "peak_rss_bytes": {k: v.peak_rss_bytes for k, v in memory.items() if v is not None},
        "cpu_s": {  # a thread started during the job (the compute thread) had 0 before
            k: after - (cpu_before.get(k) or 0.0)
            for k, after in cpu_after.items()
            if after is not None
        },
        "runq_s": {
            k: after - (runq_before.get(k) or 0.0)
            for k, after in runq_after.items()
            if after is not None
        },
        "backlog_max": max((s.backlog for s in watcher.backlog), default=None),
        "backlog_samples": len(watcher.backlog),
        "max_lead_batches": job_spec.flow.max_lead_batches,
        "backlog_bound": job_spec.flow.max_lead_batches + shard_batches - 1,
        "stage_latency_s": trainer_events[-1].get("stage_latency_s", {}) if trainer_events else {},
    }


# -- the comparison ------------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def per_process_median(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = sorted({name for run in runs for name in run[key]})
    return {
        name: statistics.median([run[key][name] for run in runs if run[key].get(name) is not None])
        for name in names
    }


def per_process_max(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = sorted({name for run in runs for name in run[key]})
    return {name: max(run[key].get(name, 0) for run in runs) for name in names}


@dataclass
class Scenario:
    name: str
    description: str
    spec: dict[str, Any]
    warmup_steps: int
    env: dict[str, str] = field(default_factory=dict)
    """Added to both systems' environment (e.g. the stack's dataset roots)."""
    runs: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"dataloader": [], "conveyor": []}
    )

    def ratios(self) -> list[float]:
        return [
            c["samples_per_second"] / d["samples_per_second"]
            for c, d in zip(self.runs["conveyor"], self.runs["dataloader"], strict=True)
            if c["samples_per_second"] and d["samples_per_second"]
        ]

    def cpu_ratios(self) -> list[float]:
        """Per repeat: Conveyor's CPU seconds per sample / the DataLoader's (all processes)."""
        return [
            cpu_per_sample(c) / cpu_per_sample(d)
            for c, d in zip(self.runs["conveyor"], self.runs["dataloader"], strict=True)
            if cpu_per_sample(d) > 0
        ]


def cpu_per_sample(run: dict[str, Any]) -> float:
    """CPU seconds of every process of a run (threads not counted twice) per sample trained."""
    total = sum(seconds for name, seconds in run["cpu_s"].items() if ":" not in name)
    return total / run["samples"] if run["samples"] else 0.0


def bench_scenario(
    scenario: Scenario, args: argparse.Namespace, use_scale: bool, load: list[float]
) -> None:
    """Run both systems ``args.repeats`` times, alternating which goes first; ``load`` gets
    the 1-minute load average after each run."""
    err = Console(stderr=True)
    for repeat in range(args.repeats):
        order = ["conveyor", "dataloader"] if repeat % 2 == 0 else ["dataloader", "conveyor"]
        for system in order:
            started = time.monotonic()
            if system == "conveyor":
                result = run_conveyor(
                    scenario.spec, args, scenario.warmup_steps, use_scale, scenario.env
                )
            else:
                result = run_baseline(scenario.spec, args, scenario.warmup_steps, scenario.env)
            scenario.runs[system].append(result)
            load.append(os.getloadavg()[0])
            err.log(
                f"{scenario.name} repeat {repeat + 1}/{args.repeats} {system}: "
                f"{result['samples_per_second'] or 0:.0f} samples/s, "
                f"data wait {pct(result['data_wait_ratio'])} "
                f"({time.monotonic() - started:.0f} s incl. start-up)"
            )


def print_scenario(scenario: Scenario, args: argparse.Namespace) -> None:
    runs_d, runs_c = scenario.runs["dataloader"], scenario.runs["conveyor"]
    ratios = scenario.ratios()
    table = Table(
        title=f"{scenario.name}: {scenario.description} - medians of {args.repeats} repeat(s)"
    )
    for column in ("", "DataLoader", "Conveyor", "Conveyor / DataLoader"):
        table.add_column(column, justify="right" if column else "left")

    def number(key: str, fmt: str) -> tuple[str, str]:
        values = (median_of(runs_d, key), median_of(runs_c, key))
        return tuple("-" if v is None else format(v, fmt) for v in values)  # type: ignore[return-value]

    ratio_text = (
        f"{statistics.median(ratios):.3f} ({min(ratios):.2f}..{max(ratios):.2f})" if ratios else "-"
    )
    table.add_row(
        f"samples/s (after {scenario.warmup_steps} warm-up steps)",
        *number("samples_per_second", ".0f"),
        ratio_text,
    )
    wait_d, wait_c = median_of(runs_d, "data_wait_ratio"), median_of(runs_c, "data_wait_ratio")
    table.add_row("data wait / step time", pct(wait_d), pct(wait_c), "")
    table.add_row(
        "  same, / (wait + compute) as the trainer counts",
        pct(median_of(runs_d, "trainer_wait_ratio")),
        pct(median_of(runs_c, "trainer_wait_ratio")),
        "",
    )
    table.add_row(
        "(wait + compute) / wall time of the window",
        pct(median_of(runs_d, "accounted_share")),
        pct(median_of(runs_c, "accounted_share")),
        "",
    )
    table.add_row(
        "whole-job samples/s (trainer summary for Conveyor)",
        *number("job_samples_per_second", ".0f"),
        "",
    )
    table.add_row(
        "whole-job data wait (trainer summary for Conveyor)",
        pct(median_of(runs_d, "job_data_wait_ratio")),
        pct(median_of(runs_c, "job_data_wait_ratio")),
        "",
    )
    cpu_ratios = scenario.cpu_ratios()
    table.add_row(
        "CPU s per 1000 samples, all processes, whole job",
        *(
            f"{statistics.median([cpu_per_sample(r) for r in runs]) * 1000:.2f}" if runs else "-"
            for runs in (runs_d, runs_c)
        ),
        f"{statistics.median(cpu_ratios):.3f} ({min(cpu_ratios):.2f}..{max(cpu_ratios):.2f})"
        if cpu_ratios
        else "-",
    )
    table.add_row("measured window (s)", *number("window_s", ".1f"), "")
    table.add_row("eval accuracy, last epoch", *number("eval_accuracy", ".3f"), "")
    backlog = median_of(runs_c, "backlog_max")
    bound = runs_c[0]["backlog_bound"] if runs_c else None
    lead = runs_c[0]["max_lead_batches"] if runs_c else None
    table.add_row(
        "batch backlog: max produced - consumed",
        "-",
        f"{backlog:.0f} (bound {bound}: max_lead_batches {lead} + shard - 1)"
        if backlog is not None
        else "-",
        "",
    )
    Console().print(table)

    processes = Table(title=f"{scenario.name}: processes over {args.repeats} repeat(s)")
    columns = ("system", "process", "peak RSS (MiB), max", "CPU s", "waiting for a CPU, s")
    for column in columns:
        processes.add_column(column, justify="left" if column in ("system", "process") else "right")
    for system, runs in (("DataLoader", runs_d), ("Conveyor", runs_c)):
        peaks = per_process_max(runs, "peak_rss_bytes")
        cpu = per_process_median(runs, "cpu_s")
        runq = per_process_median(runs, "runq_s")
        for name in sorted(set(peaks) | set(cpu), key=_process_order):
            processes.add_row(
                system,
                name,
                mib(peaks.get(name)),
                _seconds(cpu.get(name)),
                _seconds(runq.get(name)),
            )
        processes.add_row(
            system,
            "total",
            mib(sum(peaks.values())),
            _seconds(sum(v for k, v in cpu.items() if ":" not in k)),
            _seconds(sum(runq.values())),
            end_section=True,
        )
    Console().print(processes)
    stages = per_process_median(runs_c, "stage_latency_s") if runs_c else {}
    if stages:
        Console().print(
            "Conveyor stage latency p50 (ms): "
            + ", ".join(f"{k} {v * 1000:.1f}" for k, v in stages.items())
        )


def _process_order(name: str) -> tuple[int, str]:
    order = ["trainer", "worker", "broker", "gateway", "sharder", "preprocessor"]
    rank = next((i for i, prefix in enumerate(order) if name.startswith(prefix)), len(order))
    return rank, name


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def footer(args: argparse.Namespace, use_scale: bool, load: list[float]) -> str:
    cores = os.cpu_count() or 1
    how = "conveyor up --scale" if use_scale else "extra `conveyor service preprocessor` processes"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return (
        f"Machine: {cores} CPU core(s), device {device}, torch threads {args.threads} in both "
        f"trainers; 1-minute load average {min(load):.1f}..{max(load):.1f} during the runs "
        "(other work shares the machine: compare ratios, not absolute rates).\n"
        f"DataLoader: 1 training process + {args.workers} worker process(es) "
        f"(prefetch_factor {args.prefetch_factor}, persistent, workers return "
        f"{args.baseline_transport} batches; image files decoded {args.baseline_decode}).\n"
        f"Conveyor: broker + gateway + sharder + {args.preprocessors} preprocessor(s) "
        f"({how}) + trainer = {4 + args.preprocessors} processes on the same cores, a fresh "
        "stack per run; trainer heartbeats every 1 s (default 3 s) to date the wait window.\n"
        "Every process runs in its own session (Conveyor's services are started that way; "
        "the baseline and its workers are put in their own), so the kernel's autogroup "
        "scheduling gives each the same share of a loaded machine.\n"
        "Peak RSS is VmHWM; shared pages (libraries, a forked worker's pages still shared with "
        "its parent) count in every process, so totals over-state. CPU s (median) and waiting "
        "for a CPU (runnable, not running: /proc schedstat; median): from the job's submission "
        "(Conveyor) or set-up (DataLoader) to its end.\n"
        "Data wait = time the step loop was blocked on its next batch / wall time of the window "
        "(Conveyor: from trainer heartbeats; window from its progress events). CPU per sample "
        "column: Conveyor / DataLoader, above 1 = Conveyor spends more CPU on each sample."
    )


def add_system_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the two systems a side-by-side run compares (what ``run_conveyor``,
    ``run_baseline``, ``bench_scenario`` and ``footer`` read), shared with bench_decode."""
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--workers", type=int, default=max(1, min(4, cores - 1)), help="DataLoader workers"
    )
    parser.add_argument("--preprocessors", type=int, help="Conveyor preprocessor processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both trainers")
    parser.add_argument("--prefetch-factor", type=int, default=4)
    parser.add_argument(
        "--baseline-transport",
        choices=("numpy", "tensor"),
        default="numpy",
        help="what DataLoader workers return: numpy arrays (pickled through the worker's pipe; "
        "the faster here) or tensors (torch's shared-memory hand-over, one fd per tensor)",
    )
    parser.add_argument(
        "--baseline-decode",
        choices=("reduced", "full"),
        default="reduced",
        help="how DataLoader workers decode image files: as the preprocessors do (a JPEG at the "
        "DCT scale its crop needs; the same pixels) or whole before cropping (torchvision's "
        "RandomResizedCrop on a PIL image)",
    )
    parser.add_argument("--warmup-steps", type=int, help="default: 10%% of the job's steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-config", help=argparse.SUPPRESS)
    parser.add_argument(
        "--scenarios", default="synthetic,light,digits", help="any of synthetic,light,digits"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, a smaller job")
    parser.add_argument("--n", type=int, default=8192, help="synthetic samples")
    parser.add_argument("--epochs", type=int, default=2, help="synthetic epochs")
    parser.add_argument("--cost-ms", type=float, default=1.0, help="cpu_cost per sample (ms)")
    parser.add_argument(
        "--light-cost-ms", type=float, default=0.25, help="cpu_cost per sample of `light` (ms)"
    )
    parser.add_argument("--digits-epochs", type=int, default=12)
    add_system_arguments(parser)
    args = parser.parse_args()
    if args.baseline_config:
        print(json.dumps(baseline_main(json.loads(args.baseline_config))))
        return
    if args.quick:
        args.repeats, args.n, args.digits_epochs = 1, 2048, 4
    if args.preprocessors is None:
        args.preprocessors = args.workers
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    if not names or not set(names) <= {"synthetic", "light", "digits"}:
        parser.error("--scenarios takes any of synthetic, light, digits")
    if min(args.repeats, args.n, args.epochs, args.digits_epochs, args.threads) < 1:
        parser.error("counts must be >= 1")

    use_scale = scale_supported()
    scenarios = []
    for name in names:
        if name in ("synthetic", "light"):
            cost_ms = args.cost_ms if name == "synthetic" else args.light_cost_ms
            spec = synthetic_spec(
                n=args.n, epochs=args.epochs, cost_ms=cost_ms, threads=args.threads
            )
            description = (
                f"synthetic n={args.n} 3x32x32, random_crop+hflip+cpu_cost {cost_ms:g} ms, "
                f"small_cnn, {args.epochs} epochs"
            )
        else:
            spec = digits_spec(epochs=args.digits_epochs, threads=args.threads)
            description = f"examples/digits.yaml, {args.digits_epochs} epochs"
        warmup = args.warmup_steps
        if warmup is None:
            warmup = max(2, total_steps(spec) // 10)
        scenarios.append(Scenario(name, description, spec, warmup))

    load = [os.getloadavg()[0]]
    for scenario in scenarios:
        bench_scenario(scenario, args, use_scale, load)
    for scenario in scenarios:
        print_scenario(scenario, args)
    Console().print(footer(args, use_scale, load))

    result: dict[str, float | None] = {}
    for scenario in scenarios:
        ratios = scenario.ratios()
        prefix = "" if scenario is scenarios[0] else f"{scenario.name}_"
        result[f"{prefix}pipeline_vs_dataloader"] = (
            round(statistics.median(ratios), 4) if ratios else None
        )
        cpu_ratios = scenario.cpu_ratios()
        result[f"{prefix}cpu_per_sample_vs_dataloader"] = (
            round(statistics.median(cpu_ratios), 4) if cpu_ratios else None
        )
        for key, system in (
            ("data_wait_ratio", "conveyor"),
            ("baseline_data_wait_ratio", "dataloader"),
        ):
            value = median_of(scenario.runs[system], "data_wait_ratio")
            result[f"{prefix}{key}"] = round(value, 4) if value is not None else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
