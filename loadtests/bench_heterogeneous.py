"""Heterogeneous trainers: throughput-weighted allocation vs an equal split, ssp vs sync.

Two trainers train one job; one of them is slowed down with the simulation knob
CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S (extra seconds per micro-batch, inside its timed
compute), set so that its per-micro-batch compute is about 3x the other's: the delay is
2 x the fast trainer's compute time per micro-batch, measured in a short calibration job on
the stack (alone, in this process, a micro-batch computes several times faster than beside
the services on a small machine; --delay-s skips the calibration). The actual ratio of every
run is measured from the trainers' heartbeats (their compute throughput, what the coordinator
allocates by) and printed.

Runs, each on a fresh ``conveyor up`` stack (broker, gateway, sharder, preprocessor,
aggregator, the fast trainer) plus the slow trainer as an extra process, the same job
otherwise (the synthetic job of bench_pipeline.py without its cpu_cost augmentation, so that
the trainers, not the preprocessor, are the bottleneck):
    adaptive/sync  distribution.allocation adaptive (micro-batches per step and the routing
                   of batches to the trainers' partitions follow the measured throughput)
    equal/sync     allocation equal (each trainer takes half of every step; batches are not
                   routed, each trainer owns half of the partitions)
    adaptive/ssp   adaptive, bounded staleness 2
samples/s = the whole job's, from the coordinator's summary (samples trained / time from the
first step begun to the last applied step). Each repeat runs the three in a rotated order;
figures are medians over repeats. The last line printed is one JSON object:
{"adaptive_vs_equal": <sync adaptive / sync equal samples/s>,
 "ssp_vs_sync": <ssp adaptive / sync adaptive samples/s>}

    .venv/bin/python -m loadtests.bench_heterogeneous             # 2 repeats
    .venv/bin/python -m loadtests.bench_heterogeneous --quick     # 1 repeat, a smaller job
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from loadtests._bench_common import ConveyorStack, JobWatcher, scale_supported

JOB_TIMEOUT_S = 600.0
SLOW_WORKER_ID = "trainer-slow"
RUNS = (("adaptive", "sync"), ("equal", "sync"), ("adaptive", "ssp"))
"""(distribution.allocation, distribution.mode) of each run of a repeat."""
TRAINER_ENV = {"CONVEYOR_TRAINER_HEARTBEAT_INTERVAL_S": "1.0"}


def job_spec(*, n: int, epochs: int, allocation: str, mode: str, threads: int) -> dict[str, Any]:
    """The synthetic job of bench_pipeline.py (without cpu_cost), with two trainers. A short
    lead in small shards: each release carries the routing of its moment (with a lead of most
    of the job, nearly every batch would be released, unrouted, before any throughput is
    known); still more than ssp holds in flight (2 trainers x staleness 2 contributions of
    their share of 4 micro-batches, not applied yet), so that ssp is not starved by it."""
    from conveyor.training.jobspec import JobSpec

    text = f"""
name: bench-heterogeneous
model: {{name: small_cnn, num_classes: 10}}
dataset: {{uri: "synthetic://?n={n}&shape=3x32x32&classes=10", eval_fraction: 0.1}}
preprocess:
  normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}
  augment:
    - {{name: random_crop, padding: 4}}
    - {{name: hflip, p: 0.5}}
training:
  epochs: {epochs}
  global_batch_size: 256
  micro_batch_size: 64
  optimizer: {{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005}}
  precision: fp32
  seed: 1
distribution:
  trainers: 2
  aggregator_shards: 1
  mode: {mode}
  staleness: 2
  allocation: {allocation}
resources: {{device: cpu, threads: {threads}}}
flow: {{max_lead_batches: 24, shard_size: 128}}
"""
    return JobSpec.from_yaml(text).to_dict()


def micro_batch_seconds(spec: dict[str, Any], repeats: int = 12) -> float:
    """Forward/backward time of one micro-batch of ``spec``'s model, here (CPU, the job's
    thread count; the summed loss, as the trainer computes it): the fastest of ``repeats``,
    the estimate other load on the machine disturbs least."""
    from torch.nn import functional as F

    from conveyor.training.jobspec import JobSpec
    from conveyor.training.models import build_model

    job = JobSpec.from_dict(spec)
    if job.resources.threads is not None:
        torch.set_num_threads(job.resources.threads)
    options = {k: v for k, v in job.model.options.items() if k not in ("num_classes",)}
    model = build_model(
        job.model.name, in_channels=3, num_classes=10, image_size=(32, 32), **options
    )
    x = torch.rand(job.training.micro_batch_size, 3, 32, 32)  # [B,C,H,W]
    y = torch.randint(0, 10, (job.training.micro_batch_size,))
    times = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()  # type: ignore[no-untyped-call]
        loss.item()
        times.append(time.perf_counter() - started)
    return min(times[3:])


class Watcher(JobWatcher):
    """A :class:`JobWatcher` that also keeps which trainer sent each heartbeat."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.beats: list[tuple[str, float, dict[str, Any]]] = []

    def _heartbeat(self, value: bytes | None) -> None:
        from conveyor.platform.messages import Heartbeat

        message = self._decode(value)
        if isinstance(message, Heartbeat):
            self.beats.append((message.worker_id, message.at, dataclasses.asdict(message.state)))


def compute_rate(watcher: Watcher, worker_id: str) -> float | None:
    """Median compute throughput (samples per compute second) a trainer reported."""
    rates = [
        float(info["samples_per_second"])
        for worker, _, info in watcher.beats
        if worker == worker_id and (info.get("samples_per_second") or 0) > 0
    ]
    return statistics.median(rates) if rates else None


def run_job(spec: dict[str, Any], delay_s: float, use_scale: bool) -> dict[str, Any]:
    """A fresh stack + the slow trainer; submit ``spec``; follow it to its end."""
    from conveyor.cli.client import GatewayClient
    from conveyor.platform.config import KafkaSettings

    stack = ConveyorStack(preprocessors=1, env=TRAINER_ENV, use_scale=use_scale)
    watcher: Watcher | None = None
    try:
        stack.start()
        stack.start_service(
            SLOW_WORKER_ID,
            "trainer",
            env={
                "CONVEYOR_TRAINER_WORKER_ID": SLOW_WORKER_ID,
                "CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S": f"{delay_s:.6f}",
            },
        )
        with GatewayClient(stack.gateway_url) as client:
            client.wait_ready()
            job = client.submit(spec)
        watcher = Watcher(
            bootstrap=stack.bootstrap,
            topic_prefix=KafkaSettings(bootstrap=stack.bootstrap).topic_prefix,
            job_id=job["id"],
        )
        watcher.start()
        event, _, data = watcher.wait_terminal(JOB_TIMEOUT_S)
        if event != "completed":
            raise RuntimeError(f"job {job['id']} {event}: {data}")
    finally:
        if watcher is not None:
            watcher.stop()
        stack.stop()

    summary = data["summary"]
    trained: dict[str, int] = {}
    waits: dict[str, float] = {}  # each trainer's exposed data wait over the whole job
    for name, _, progress in watcher.events:
        worker = progress.get("worker_id")
        if name == "progress" and worker not in (None, "coordinator"):
            trained[str(worker)] = int(progress.get("samples_trained") or 0)
            if progress.get("data_wait_ratio_job") is not None:
                waits[str(worker)] = float(progress["data_wait_ratio_job"])
    fast_ids = [w for w in trained if w != SLOW_WORKER_ID]
    fast_id = fast_ids[0] if fast_ids else None
    fast_rate = compute_rate(watcher, fast_id) if fast_id else None
    slow_rate = compute_rate(watcher, SLOW_WORKER_ID)
    return {
        "samples_per_second": float(summary["samples_per_second"]),
        "samples": int(summary["samples"]),
        "steps": int(summary["steps"]),
        "eval_accuracy": summary.get("eval_accuracy"),
        "rejections": summary.get("rejections"),
        "data_wait_ratio": statistics.mean(waits.values()) if waits else None,
        "max_staleness": summary.get("max_staleness"),
        "fast_samples": trained.get(fast_id, 0) if fast_id else 0,
        "slow_samples": trained.get(SLOW_WORKER_ID, 0),
        "compute_ratio": fast_rate / slow_rate if fast_rate and slow_rate else None,
        "fast_micro_batch_s": None,  # filled by the caller (it knows the micro-batch size)
        "fast_rate": fast_rate,
        "slow_rate": slow_rate,
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def ratio_of(numerators: list[dict[str, Any]], denominators: list[dict[str, Any]]) -> float | None:
    """Median over repeats of the per-repeat ratio of samples/s."""
    ratios = [
        a["samples_per_second"] / b["samples_per_second"]
        for a, b in zip(numerators, denominators, strict=False)
        if b["samples_per_second"] > 0
    ]
    return statistics.median(ratios) if ratios else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 repeat, a smaller job")
    parser.add_argument("--n", type=int, default=4096, help="synthetic samples")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer")
    parser.add_argument(
        "--delay-s",
        type=float,
        help="slow trainer's extra seconds per micro-batch (default: 2x the measured "
        "forward/backward time of one micro-batch, for ~3x the compute)",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.n = 1, 2048
    if min(args.repeats, args.n, args.epochs, args.threads) < 1:
        parser.error("counts must be >= 1")

    err = Console(stderr=True)
    specs = {
        (allocation, mode): job_spec(
            n=args.n, epochs=args.epochs, allocation=allocation, mode=mode, threads=args.threads
        )
        for allocation, mode in RUNS
    }
    micro = int(specs[RUNS[0]]["training"]["micro_batch_size"])
    use_scale = scale_supported()
    alone_s = micro_batch_seconds(specs[RUNS[0]])
    in_stack_s: float | None = None
    if args.delay_s is not None:
        delay_s = args.delay_s
    else:
        # Alone, this process has a core to itself; in the stack, the fast trainer shares the
        # cores with every service: measure it there, in a short job, and slow the other
        # trainer by twice that.
        calibration = job_spec(
            n=1024, epochs=1, allocation="adaptive", mode="sync", threads=args.threads
        )
        result = run_job(calibration, 2.0 * alone_s, use_scale)
        if result["fast_rate"]:
            in_stack_s = micro / result["fast_rate"]
        delay_s = 2.0 * (in_stack_s or alone_s)
    err.log(
        f"one micro-batch ({micro} samples) computes in {alone_s * 1000:.0f} ms alone, "
        f"{fmt(in_stack_s and in_stack_s * 1000, '.0f')} ms in the stack (calibration job); "
        f"slow trainer delay {delay_s * 1000:.0f} ms per micro-batch"
    )
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in RUNS}
    load = [os.getloadavg()[0]]
    for repeat in range(args.repeats):
        order = RUNS[repeat % len(RUNS) :] + RUNS[: repeat % len(RUNS)]
        for key in order:
            started = time.monotonic()
            result = run_job(specs[key], delay_s, use_scale)
            if result["fast_rate"]:
                result["fast_micro_batch_s"] = micro / result["fast_rate"]
            runs[key].append(result)
            load.append(os.getloadavg()[0])
            err.log(
                f"repeat {repeat + 1}/{args.repeats} {key[0]}/{key[1]}: "
                f"{result['samples_per_second']:.0f} samples/s, trained fast/slow "
                f"{result['fast_samples']}/{result['slow_samples']}, compute ratio "
                f"{fmt(result['compute_ratio'], '.2f')} "
                f"({time.monotonic() - started:.0f} s incl. start-up)"
            )

    table = Table(
        title=f"Two trainers, one slowed (delay {delay_s * 1000:.0f} ms per micro-batch): "
        f"synthetic n={args.n} 3x32x32, small_cnn, {args.epochs} epochs, global batch 256 = "
        f"4 x {micro} - medians of {args.repeats} repeat(s)"
    )
    columns = (
        "allocation/mode", "samples/s (job)", "trained fast/slow", "fast : slow samples",
        "compute ratio (measured)", "data wait", "steps", "rejections", "max staleness",
        "eval acc",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "allocation/mode" else "right")
    for key in RUNS:
        done = runs[key]
        fast, slow = median_of(done, "fast_samples"), median_of(done, "slow_samples")
        table.add_row(
            f"{key[0]}/{key[1]}",
            fmt(median_of(done, "samples_per_second"), ".1f"),
            f"{fmt(fast, '.0f')}/{fmt(slow, '.0f')}",
            fmt(fast / slow if fast is not None and slow else None, ".2f"),
            fmt(median_of(done, "compute_ratio"), ".2f"),
            fmt(median_of(done, "data_wait_ratio"), ".1%"),
            fmt(median_of(done, "steps"), ".0f"),
            fmt(median_of(done, "rejections"), ".0f"),
            fmt(median_of(done, "max_staleness"), ".0f"),
            fmt(median_of(done, "eval_accuracy"), ".3f"),
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    adaptive_vs_equal = ratio_of(runs[("adaptive", "sync")], runs[("equal", "sync")])
    ssp_vs_sync = ratio_of(runs[("adaptive", "ssp")], runs[("adaptive", "sync")])
    fast_mb = median_of([r for rs in runs.values() for r in rs], "fast_micro_batch_s")
    console.print(
        f"adaptive / equal (sync): {fmt(adaptive_vs_equal, '.3f')}; "
        f"ssp / sync (adaptive): {fmt(ssp_vs_sync, '.3f')}.\n"
        f"Compute ratio = the fast trainer's compute throughput / the slow one's, from their "
        f"heartbeats (target 3; the fast one's micro-batch took {fmt(fast_mb, '.3f')} s in "
        f"the runs, {fmt(in_stack_s, '.3f')} s in the calibration job, {alone_s:.3f} s "
        f"alone; the stack shares {os.cpu_count()} core(s)). Data wait = exposed data wait / "
        "(wait + busy) over the whole job, mean of the two trainers. 1-minute "
        f"load average {min(load):.1f}..{max(load):.1f} (other work shares the machine: "
        "compare ratios, not absolute rates)."
    )
    print(
        json.dumps(
            {
                "adaptive_vs_equal": round(adaptive_vs_equal, 4) if adaptive_vs_equal else None,
                "ssp_vs_sync": round(ssp_vs_sync, 4) if ssp_vs_sync else None,
            }
        )
    )


if __name__ == "__main__":
    main()
