"""The two systems of bench_pipeline.py, run from the benchmark's process: the scenarios' job
specs, Conveyor end to end (a fresh ``conveyor up`` stack, the job submitted through the
gateway, the trainer's own reports read back from the broker) and the DataLoader baseline
started as a subprocess (``python -m loadtests.bench_pipeline --baseline-config``, which runs
:func:`loadtests._pipeline_baseline.baseline_main`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from conveyor.platform.messages import COORDINATOR_WORKER_ID
from loadtests._bench_common import ConveyorStack, JobWatcher
from loadtests._bench_figures import Progress, WaitPoint, wait_window_after, window_after
from loadtests._bench_procs import thread_cpu_seconds

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
        "max_lead_batches": job_spec.lead_batches,
        "backlog_bound": job_spec.lead_batches + shard_batches - 1,
        "stage_latency_s": trainer_events[-1].get("stage_latency_s", {}) if trainer_events else {},
    }
