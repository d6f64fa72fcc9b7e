"""The runs of bench_aggregation.py: its settings, the job specs (digits with each compression,
resnet18), one job on the Conveyor stack watched on the gradient plane (step windows, hops,
bytes, stalls) and the measurement of every job and baseline over the repeats."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from loadtests._aggregation_figures import (
    default_warmup,
    mean_contribution_bytes,
    step_bytes,
    step_window,
)
from loadtests._bench_common import ConveyorStack, JobWatcher
from loadtests._bench_procs import thread_cpu_seconds
from loadtests.ddp_baseline import Case, run_baselines
from loadtests.plane_hops import Stamped, median_hops, step_hops
from loadtests.topk_reference import REFERENCE_SEEDS, reference_accuracy

ROOT = Path(__file__).resolve().parent.parent


TRAINERS = 2


SLICES = 2


STACK_SCALE = {"trainer": TRAINERS, "aggregator": SLICES}


JOB_TIMEOUT_S = 600.0


IDLE_SETTLE_S, IDLE_S = 5.0, 5.0
"""Seconds the stack is left alone after it is up (the aggregators warm torch up in a thread
then: measured at once, each showed ~200 ms CPU per second), then seconds its idle CPU use is
measured for, before the first job."""


STALL_S = 60.0
"""A job with no StepClose nor Contribution for this long is stalled: cancelled and reported."""


TOPK_RATIO = 0.01


TARGET_REDUCTION, TARGET_DELTA_POINTS = 50.0, 1.5


COMPRESSIONS: dict[str, dict[str, Any]] = {
    "none": {"kind": "none"},
    "fp16": {"kind": "fp16"},
    "bf16": {"kind": "bf16"},
    "topk": {"kind": "topk", "ratio": TOPK_RATIO, "error_feedback": True},
}


STEP_PARTS = ("data_wait", "h2d", "compute", "grad_send", "param_wait")


ERR = Console(stderr=True)


# -- job specs ----------------------------------------------------------------------------------


def digits_spec(*, epochs: int, compression: str, seed: int = 0) -> dict[str, Any]:
    """examples/digits.yaml (2 trainers, 2 slices, sync) on the CPU with 1 torch thread."""
    from conveyor.training.jobspec import JobSpec

    data = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    data["name"] = f"bench-agg-digits-{compression}"
    data["training"]["epochs"] = epochs
    data["training"]["seed"] = seed
    data["distribution"].update(
        trainers=TRAINERS, aggregator_shards=SLICES, mode="sync",
        compression=COMPRESSIONS[compression],
    )  # fmt: skip
    data["resources"] = {"device": "cpu", "threads": 1}
    return JobSpec.from_dict(data).to_dict()


def with_overlap(spec: dict[str, Any], on: bool) -> dict[str, Any]:
    """``spec`` with ``distribution.overlap_backward`` set: on, slices sent during the last
    backward pass; off (named ``-serial``), every slice after it (the overlap's baseline; the
    same bytes, the same updates). Set either way: the default depends on the model's size."""
    data = copy.deepcopy(spec)
    data["distribution"]["overlap_backward"] = on
    if not on:
        data["name"] = f"{data['name']}-serial"
    return data


def resnet_spec(*, n: int, width: int) -> dict[str, Any]:
    """resnet18 (group norm: no buffers) on synthetic 3x32x32, one epoch, same distribution."""
    from conveyor.training.jobspec import JobSpec

    text = f"""
name: bench-agg-resnet18
model: {{name: resnet18, width: {width}, norm: group}}
dataset: {{uri: "synthetic://?n={n}&shape=3x32x32&classes=10", eval_fraction: 0.1}}
preprocess: {{normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}}}
training:
  epochs: 1
  global_batch_size: 64
  micro_batch_size: 32
  optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
  seed: 0
distribution: {{trainers: {TRAINERS}, aggregator_shards: {SLICES}, mode: sync}}
resources: {{device: cpu, threads: 1}}
"""
    return JobSpec.from_yaml(text).to_dict()


# -- Conveyor ----------------------------------------------------------------------------------


class PlaneWatcher(JobWatcher):
    """A :class:`JobWatcher` that also keeps the job's StepCloses and Contributions."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.closes: list[tuple[int, float, int, list[str]]] = []
        """(version, closed_at, num_samples, contribution ids) in log order."""
        self.contributions: dict[str, tuple[str, int, int]] = {}
        """contribution id -> (worker id, grad_bytes, num_samples)."""
        self.stamps: dict[str, Stamped] = {}
        """contribution id -> its stamps (loadtests.plane_hops)."""
        self.last_activity = time.monotonic()
        """When the last StepClose or Contribution was read (monotonic seconds)."""

    def _heartbeat(self, value: bytes | None) -> None:  # every control-topic record
        from conveyor.platform.messages import Contribution, Heartbeat, StepClose

        message = self._decode(value)
        if isinstance(message, Heartbeat):
            self.heartbeats.append((message.at, dataclasses.asdict(message.state)))
        elif isinstance(message, StepClose):
            ids = [c.contribution_id for c in message.contributions]
            self.closes.append((message.version, message.closed_at, message.num_samples, ids))
            self.last_activity = time.monotonic()
        elif isinstance(message, Contribution):
            self.last_activity = time.monotonic()
            self.contributions.setdefault(
                message.contribution_id,
                (message.worker_id, message.grad_bytes, message.num_samples),
            )
            self.stamps.setdefault(
                message.contribution_id,
                Stamped(
                    base_version=message.base_version,
                    sent_at=message.sent_at,
                    params_published_at=message.params_published_at,
                    params_received_at=message.params_received_at,
                    started_at=message.started_at,
                    computed_at=message.computed_at,
                ),
            )


def stack_cpu(stack: ConveyorStack) -> dict[str, float | None]:
    """CPU seconds so far of every stack process, and of each trainer's main thread (its event
    loop: message decoding, the bus) apart from its other threads (compute, copies)."""
    found = stack.cpu()
    for name, pid in stack.processes():
        if name.startswith("trainer"):
            threads = thread_cpu_seconds(pid)
            found[f"{name}: event loop"] = threads.pop("main", None)
            found[f"{name}: other threads"] = sum(threads.values())
    return found


def stall_diagnosis(watcher: PlaneWatcher, idle_s: float) -> str:
    """What the control topic shows of a job that stopped making progress."""
    closes = sorted(watcher.closes)
    version = closes[-1][0] if closes else 0
    waiting = sorted(
        cid
        for cid, (_, _, samples) in watcher.contributions.items()
        if samples > 0 and not any(cid in c[3] for c in closes)
    )
    return (
        f"no StepClose nor Contribution for {idle_s:.0f} s; last StepClose version {version} "
        f"(contributions {closes[-1][3] if closes else []}); contributions not applied: "
        f"{waiting or 'none'}"
    )


def run_job(stack: ConveyorStack, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit ``spec`` to the running stack, follow it to its end; figures of the run."""
    from conveyor.cli.client import GatewayClient
    from conveyor.platform.config import KafkaSettings

    with GatewayClient(stack.gateway_url) as client:
        client.wait_ready()
        cpu_before = stack_cpu(stack)
        runq_before = stack.runqueue_wait()
        job = client.submit(spec)
    watcher = PlaneWatcher(
        bootstrap=stack.bootstrap,
        topic_prefix=KafkaSettings(bootstrap=stack.bootstrap).topic_prefix,
        job_id=job["id"],
    )
    watcher.start()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    stalled: str | None = None
    try:
        while True:
            try:
                event, _, data = watcher.wait_terminal(2.0)
                break
            except TimeoutError:
                idle_s = time.monotonic() - watcher.last_activity
                if idle_s < STALL_S and time.monotonic() < deadline:
                    continue
            stalled = stall_diagnosis(watcher, idle_s)
            ERR.log(f"[red]job {job['id']} stalled[/red]: {stalled}; cancelling it")
            with GatewayClient(stack.gateway_url) as client:
                client.cancel(job["id"])
            event, _, data = watcher.wait_terminal(60.0)
            break
    finally:
        watcher.stop()
    cpu_after, runq_after = stack_cpu(stack), stack.runqueue_wait()
    if stalled is not None:
        return {"stalled": stalled}
    if event != "completed":
        raise RuntimeError(f"job {job['id']} {event}: {data}")
    summary: dict[str, Any] = data["summary"]
    global_batch = int(spec["training"]["global_batch_size"])
    closes = sorted(watcher.closes)
    applied = [c for c in closes if c[2] > 0]
    warmup = default_warmup(len(applied))
    window = step_window([(c[0], c[1]) for c in applied], warmup)
    grad_bytes = {cid: nbytes for cid, (_, nbytes, _) in watcher.contributions.items()}
    per_step = step_bytes([c[3] for c in applied], grad_bytes)
    steps = len(applied)
    start_at = next((c[1] for c in closes if c[0] >= warmup), None)
    end_at = closes[-1][1] if closes else None
    parts: dict[str, list[float]] = {part: [] for part in STEP_PARTS}
    for at, info in watcher.heartbeats:
        split = info.get("step_time_s")
        if not split or start_at is None or end_at is None or not start_at <= at <= end_at:
            continue
        for part in STEP_PARTS:
            if split.get(part) is not None:
                parts[part].append(float(split[part]))
    # The hops of the window's steps (the warm-up left out, as for the per-step time).
    hops = step_hops({c[0]: (c[1], c[3]) for c in closes if c[0] > warmup}, watcher.stamps)
    cpu = {k: v - (cpu_before.get(k) or 0.0) for k, v in cpu_after.items() if v is not None}
    runq = {k: v - (runq_before.get(k) or 0.0) for k, v in runq_after.items() if v is not None}
    return {
        "per_step_s": window.per_step_s if window else None,
        "median_step_s": window.median_interval_s if window else None,
        "window_steps": window.steps if window else 0,
        "steps": steps,
        "partial_steps": sum(1 for c in applied if c[2] < global_batch),
        "samples_per_step": statistics.fmean(c[2] for c in applied) if applied else None,
        "contribution_bytes": mean_contribution_bytes(
            (nbytes, samples) for _, nbytes, samples in watcher.contributions.values()
        ),
        "step_bytes": statistics.fmean(per_step) if per_step else None,
        "summary_bytes_per_step": summary.get("grad_bytes_per_step"),
        "eval_accuracy": summary.get("eval_accuracy"),
        "summary_steps": summary.get("steps"),
        "rejections": summary.get("rejections"),
        "step_parts_s": {p: statistics.median(v) for p, v in parts.items() if v},
        "hops_s": median_hops(hops),
        "hop_steps": len(hops),
        "cpu_per_step_s": {k: v / steps for k, v in cpu.items()} if steps else {},
        "runq_per_step_s": {k: v / steps for k, v in runq.items()} if steps else {},
    }


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Runs:
    """Every measurement of the run, by system/job, one entry per repeat."""

    baseline: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    """(case, "local" | "ddp") -> runs."""
    jobs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """"small_cnn" (digits dense), "topk", "fp16", "bf16", "resnet18" -> runs."""
    reference: dict[str, list[float]] = field(default_factory=dict)
    """"dense", "topk" -> in-process reference accuracy per seed 0..REFERENCE_SEEDS-1."""
    idle_cpu_per_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds per second of every stack process with no job running."""

    def add_baseline(self, case: str, system: str, result: dict[str, Any]) -> None:
        self.baseline.setdefault((case, system), []).append(result)

    def add_job(self, name: str, result: dict[str, Any]) -> None:
        self.jobs.setdefault(name, []).append(result)

    def values(self, name: str, key: str) -> list[Any]:
        return [run.get(key) for run in self.jobs.get(name, [])]

    def base_values(self, case: str, system: str, key: str) -> list[Any]:
        return [run.get(key) for run in self.baseline.get((case, system), [])]


def measure_baselines(args: argparse.Namespace, cases: list[Case], runs: Runs, repeat: int) -> None:
    """Local and DDP of one repeat (resnet18 only in the first --resnet-repeats)."""
    active = [c for c in cases if c.name == "small_cnn" or repeat < args.resnet_repeats]
    for name, systems in run_baselines(active, TRAINERS).items():
        for system, result in systems.items():
            runs.add_baseline(name, system, result)
            ERR.log(f"repeat {repeat + 1} {name} {system}: "
                    f"{result['per_step_s'] * 1000:.1f} ms/step")  # fmt: skip


def measure(args: argparse.Namespace, cases: list[Case], runs: Runs, load: list[float]) -> None:
    """Baselines with no stack running (its idle processes would take CPU from them): the
    first half of the repeats before the stack starts, the others after it stopped. Then the
    jobs, one after the other on one stack; then the in-process reference."""
    before_stack = (args.repeats + 1) // 2
    for repeat in range(before_stack):
        measure_baselines(args, cases, runs, repeat)
        load.append(os.getloadavg()[0])
    stack = ConveyorStack(preprocessors=1, env={}, use_scale=True, scale=STACK_SCALE)
    started = time.monotonic()
    ERR.log("starting the stack: conveyor up --scale trainer=2 --scale aggregator=2")
    try:
        stack.start()
        ERR.log(f"stack up in {time.monotonic() - started:.0f} s: "
                + ", ".join(name for name, _ in stack.processes()))  # fmt: skip
        time.sleep(IDLE_SETTLE_S)
        before, at = stack_cpu(stack), time.monotonic()
        time.sleep(IDLE_S)
        after, idle_s = stack_cpu(stack), time.monotonic() - at
        runs.idle_cpu_per_s = {
            k: (v - (before.get(k) or 0.0)) / idle_s for k, v in after.items() if v is not None
        }
        for repeat in range(args.repeats):
            for case in cases:
                if case.name != "small_cnn" and repeat >= args.resnet_repeats:
                    continue
                jobs = [(case.name, with_overlap(case.spec, True)),
                        (f"{case.name}_serial", with_overlap(case.spec, False))]  # fmt: skip
                if case.name == "small_cnn":
                    # Dense, top-k and dense without the overlap paired on seed = repeat,
                    # alternating which goes first.
                    dense = digits_spec(epochs=args.digits_epochs, compression="none", seed=repeat)
                    jobs = [("small_cnn", with_overlap(dense, True)),
                            ("small_cnn_serial", with_overlap(dense, False)),
                            ("topk", digits_spec(epochs=args.digits_epochs, compression="topk",
                                                 seed=repeat))]  # fmt: skip
                jobs = jobs if repeat % 2 == 0 else jobs[::-1]
                for name, spec in jobs:
                    began = time.monotonic()
                    result = run_job(stack, spec)
                    runs.add_job(name, result)
                    if "stalled" in result:
                        continue
                    ERR.log(f"repeat {repeat + 1} conveyor {name}: "
                            f"{(result['per_step_s'] or 0) * 1000:.1f} ms/step over "
                            f"{result['window_steps']} steps, eval accuracy "
                            f"{result['eval_accuracy']}, "
                            f"{time.monotonic() - began:.0f} s")  # fmt: skip
            load.append(os.getloadavg()[0])
        for kind in ("fp16", "bf16"):  # bytes are fixed by the layout: one short job each
            result = run_job(stack, digits_spec(epochs=1, compression=kind))
            runs.add_job(kind, result)
            if "stalled" not in result:
                ERR.log(f"conveyor {kind}: {result['contribution_bytes']} bytes/contribution")
    finally:
        stack.stop()
    for repeat in range(before_stack, args.repeats):
        measure_baselines(args, cases, runs, repeat)
        load.append(os.getloadavg()[0])
    if args.no_reference:
        return
    for kind, name in (("none", "dense"), ("topk", "topk")):
        spec = digits_spec(epochs=args.digits_epochs, compression=kind)
        runs.reference[name] = [
            reference_accuracy(spec, seed=seed) for seed in range(REFERENCE_SEEDS)
        ]
        ERR.log(f"reference (in-process algorithm) {name}: "
                + ", ".join(f"{a:.3f}" for a in runs.reference[name]))  # fmt: skip
