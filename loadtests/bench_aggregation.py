"""Gradient-plane benchmark: Conveyor's aggregation vs local training and DDP (gloo), side by side.

Same model, initial weights (the job's seeded version 0), optimizer, global batch, torch threads
(1 per training process) and machine. Model cases:
    small_cnn  examples/digits.yaml: small_cnn on sklearn digits 1x8x8, global batch 64 (2 x 32);
    resnet18   resnet18 (width --resnet-width, group norm: no buffers) on synthetic 3x32x32,
               global batch 64, one epoch; in the first --resnet-repeats repeats only (default 1).
Systems:
    local     one process: forward/backward of the whole global batch + optimizer.step (the floor);
    ddp       torch.distributed DDP, gloo backend, 2 processes (torch.multiprocessing spawn,
              MASTER_ADDR 127.0.0.1 and a free port), each half the batch, 1 torch thread each;
    conveyor  the real stack (``conveyor up --scale trainer=2 --scale aggregator=2``: broker,
              gateway, sharder, preprocessor, 2 trainers, 2 aggregators), sync jobs with 2
              trainers and 2 parameter slices submitted through the gateway, one after the other.
Overlap: every Conveyor job runs twice on the stack, with ``distribution.overlap_backward`` on
(a step's slices sent while its last backward pass runs; by default only for a gradient of 1 MiB
or more, not the small_cnn's) and as ``<case>_serial`` with it off (every slice after the whole
backward), paired on one seed, alternating which goes first; the
hop table shows both, and the JSON has ``serial_hop_*_ms`` beside ``hop_*_ms`` and
``overlap_compute_grad_send_vs_serial`` (compute + grad_send hops, ours / serial; resnet18's
with a ``resnet18_`` prefix) and ``overlap_step_vs_serial``.
local and ddp run while no stack is up (an idle stack takes ~10% of 2 cores): half of the
repeats before it starts, half after it stopped; ratios are ratios of medians.
Per-step time: local/ddp time --baseline-steps steps after a warm-up (rank 0's wall clock, DDP's
all-reduce included). Conveyor: the StepCloses the coordinator publishes on the job's control
topic (read while the job runs: job topics are deleted when it ends); per-step time = (closed_at
of the last step - closed_at of the last warm-up step) / steps with samples between them
(warm-up: 10% of the job's steps, at least 2). That window is the training phase as the job
lives it: partial steps (a trainer with no batch sends an empty contribution), epoch ends and
evaluation included. The trainers' heartbeats (step_time_s) say where a step's time goes; CPU
seconds per step of every stack process (and of the idle stack per second) say what the cores
were busy with.
Bytes per step, per compression (none, fp16, bf16, topk ratio 0.01 + error feedback): from the
Contributions on the control topic (grad_bytes: the payload of all K slices of one trainer's
step) and the job summary's grad_bytes_per_step (all payload / steps with samples: it moves with
the number of partial steps, so the reduction is taken per non-empty contribution). fp16/bf16:
one 1-epoch job each (their bytes are fixed by the layout).
Accuracy: examples/digits.yaml (5 epochs, 2 trainers, 2 slices, SGD lr 0.1 momentum 0.9), dense
and topk 0.01 with error feedback and momentum correction (the defaults; alternating which runs
first), eval accuracy of the last epoch from the job's summary, paired per repeat; delta =
100 * (dense - topk) points. Beside it, an in-process reference of the same algorithm (2
simulated trainers with the trainer's own SliceEncoder, summed gradients / samples, the
aggregator's optimizer over the flat parameters, no broker): it tells a system bug from a
property of the algorithm (loadtests/topk_reference.py). --investigate SEEDS runs only its
variants over SEEDS seeds (momentum at the aggregator instead of the trainers, no error
feedback, ratio 0.05, 20 epochs).
The last line printed is one JSON object:
    {..., "step_vs_local": r, ..., "step_vs_ddp_gloo": conveyor/ddp per-step time (small_cnn),
     "topk_bytes_reduction": dense / top-k bytes, "topk_accuracy_delta": points lost by top-k
     (the reference's mean over REFERENCE_SEEDS seeds; the system's median over the repeats is
     "system_topk_accuracy_delta": a few runs cannot resolve 1.5 points through seed noise)}

    .venv/bin/python -m loadtests.bench_aggregation            # 3 repeats
    .venv/bin/python -m loadtests.bench_aggregation --quick    # smoke run
    .venv/bin/python -m loadtests.bench_aggregation --quick --no-reference   # the stack only
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from loadtests._bench_common import ConveyorStack, JobWatcher, scale_supported, thread_cpu_seconds
from loadtests.ddp_baseline import Case, run_baselines
from loadtests.plane_hops import HOPS, Stamped, median_hops, step_hops
from loadtests.topk_reference import REFERENCE_SEEDS, investigate, reference_accuracy

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


# -- pure helpers (tests/unit/test_bench_aggregation.py) ----------------------------------------


@dataclass(frozen=True, slots=True)
class StepWindow:
    """Optimizer steps over the part of a run after its warm-up."""

    steps: int
    seconds: float
    median_interval_s: float | None
    """Median time between two consecutive steps of the window."""

    @property
    def per_step_s(self) -> float:
        return self.seconds / self.steps if self.steps else math.nan


def step_window(closes: Sequence[tuple[int, float]], warmup_steps: int) -> StepWindow | None:
    """``closes``: (version, closed_at) of the steps that applied samples (a step of only empty
    contributions changes nothing and is left out by the caller). The window runs from the
    close of the last warm-up step (version ``warmup_steps``, else the first one after it) to
    the last close; its steps are the closes after its start. None when it holds no step."""
    ordered = sorted(closes)
    start = next((i for i, c in enumerate(ordered) if c[0] >= warmup_steps), None)
    if start is None or start == len(ordered) - 1:
        return None
    window = ordered[start:]
    intervals = [b[1] - a[1] for a, b in itertools.pairwise(window)]
    return StepWindow(
        steps=len(window) - 1,
        seconds=window[-1][1] - window[0][1],
        median_interval_s=statistics.median(intervals),
    )


def default_warmup(total_steps: int) -> int:
    """Warm-up steps left out of a Conveyor job's window: 10%, at least 2."""
    return max(2, total_steps // 10)


def mean_contribution_bytes(contributions: Iterable[tuple[int, int]]) -> float | None:
    """Mean ``grad_bytes`` of the contributions with samples, from (grad_bytes, num_samples)
    pairs (an empty contribution sends no slice). None when there is none."""
    sizes = [nbytes for nbytes, samples in contributions if samples > 0]
    return statistics.fmean(sizes) if sizes else None


def step_bytes(closes: Iterable[Sequence[str]], grad_bytes: Mapping[str, int]) -> list[int]:
    """Gradient bytes of each applied step: the sum over the contribution ids it applied."""
    return [sum(grad_bytes.get(cid, 0) for cid in ids) for ids in closes]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None when none is)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def accuracy_deltas(dense: Sequence[float | None], topk: Sequence[float | None]) -> list[float]:
    """Per repeat, eval-accuracy points lost by top-k: ``100 * (dense - topk)``."""
    return [
        100.0 * (d - t) for d, t in zip(dense, topk, strict=True) if d is not None and t is not None
    ]


def max_topk_reduction(ratio_kept: float, value_bytes: int = 2, index_bytes: int = 4) -> float:
    """The most top-k at ``ratio_kept`` can save over fp32: dense 4 bytes per element vs
    ``ratio_kept * (value + index)`` bytes (before rounding k up)."""
    return 4.0 / (ratio_kept * (value_bytes + index_bytes))


def result_json(
    *,
    extras: Mapping[str, float | None],
    step_vs_ddp: float | None,
    bytes_reduction: float | None,
    accuracy_delta: float | None,
) -> dict[str, float | None]:
    """The final JSON object: ``extras`` first, the three headline figures last (rounded)."""

    def rounded(value: float | None) -> float | None:
        return None if value is None or math.isnan(value) else round(value, 4)

    result = {key: rounded(value) for key, value in extras.items()}
    for key in ("step_vs_ddp_gloo", "topk_bytes_reduction", "topk_accuracy_delta"):
        result.pop(key, None)
    result["step_vs_ddp_gloo"] = rounded(step_vs_ddp)
    result["topk_bytes_reduction"] = rounded(bytes_reduction)
    result["topk_accuracy_delta"] = rounded(accuracy_delta)
    return result


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


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def spread(values: Sequence[float], fmt: str = ".2f") -> str:
    if not values:
        return "-"
    middle = format(statistics.median(values), fmt)
    return middle if len(values) == 1 else f"{middle} ({min(values):{fmt}}..{max(values):{fmt}})"


def report(
    args: argparse.Namespace, cases: list[Case], runs: Runs, load: list[float]
) -> dict[str, float | None]:
    out = wide_console()
    extras: dict[str, float | None] = {}
    headline_step_vs_ddp: float | None = None

    steps = Table(
        title="Per-step time, ms: median (min..max) over the repeats "
        f"(small_cnn {args.repeats}, resnet18 {min(args.repeats, args.resnet_repeats)})"
    )
    columns = ("model", "local (1 proc)", "DDP gloo (2 procs)", "Conveyor (2 trainers, 2 slices)",
               "Conveyor / local", "Conveyor / DDP", "DDP / local")  # fmt: skip
    for column in columns:
        steps.add_column(column, justify="left" if column == "model" else "right")
    for case in cases:
        local = runs.base_values(case.name, "local", "per_step_s")
        ddp = runs.base_values(case.name, "ddp", "per_step_s")
        ours = runs.values(case.name, "per_step_s")
        # Ratios of medians: the baselines do not run beside the stack (see measure).
        vs_local, vs_ddp = ratio(median(ours), median(local)), ratio(median(ours), median(ddp))
        steps.add_row(
            f"{case.name}: {case.description}",
            *(spread([v * 1000 for v in values if v is not None], ".1f")
              for values in (local, ddp, ours)),
            times(vs_local), times(vs_ddp), times(ratio(median(ddp), median(local))),
        )  # fmt: skip
        prefix = "" if case.name == "small_cnn" else f"{case.name}_"
        extras[f"{prefix}step_ms_local"] = _scaled(median(local), 1000)
        extras[f"{prefix}step_ms_ddp_gloo"] = _scaled(median(ddp), 1000)
        extras[f"{prefix}step_ms_conveyor"] = _scaled(median(ours), 1000)
        extras[f"{prefix}step_vs_local"] = vs_local
        # Per sample: Conveyor's steps are not all full (a trainer without a batch sends an
        # empty contribution), the baselines' always are.
        full = int(case.spec["training"]["global_batch_size"])
        per_sample = [
            None if t is None or n is None else t / n
            for t, n in zip(ours, runs.values(case.name, "samples_per_step"), strict=True)
        ]
        extras[f"{prefix}sample_time_vs_ddp_gloo"] = ratio(
            median(per_sample), _scaled(median(ddp), 1 / full)
        )
        if case.name == "small_cnn":
            headline_step_vs_ddp = vs_ddp
        else:
            extras[f"{prefix}step_vs_ddp_gloo"] = vs_ddp
    out.print(steps)

    where = Table(title="Conveyor: where a step goes (trainer heartbeats, median ms per step)")
    for column in ("job", "step (window)", "median step", *STEP_PARTS, "samples/step",
                   "steps (partial)", "rejections"):  # fmt: skip
        where.add_column(column, justify="left" if column == "job" else "right")
    for name in [*job_names(cases), "topk", "fp16", "bf16"]:
        if name not in runs.jobs:
            continue
        parts = [p for p in runs.values(name, "step_parts_s") if p]  # a stalled run has none
        where.add_row(
            name,
            ms(median(runs.values(name, "per_step_s"))),
            ms(median(runs.values(name, "median_step_s"))),
            *(ms(median(p.get(part) for p in parts)) for part in STEP_PARTS),
            _num(median(runs.values(name, "samples_per_step")), ".1f"),
            f"{_num(median(runs.values(name, 'steps')), '.0f')} "
            f"({_num(median(runs.values(name, 'partial_steps')), '.0f')})",
            _num(median(runs.values(name, "rejections")), ".0f"),
        )
    out.print(where)

    hop_names = (*HOPS, "plane", "barrier", "step")
    hops = Table(title="Conveyor: hops of a sync step, median ms (loadtests/plane_hops.py: "
                 "StepClose v -> the last trainer's Contribution -> StepClose v+1)")  # fmt: skip
    for column in ("job", "steps", *hop_names):
        hops.add_column(column, justify="left" if column == "job" else "right")
    hop_medians: dict[str, dict[str, float | None]] = {}
    for name in [*job_names(cases), "topk"]:
        found = [h for h in runs.values(name, "hops_s") if h]
        if not found:
            continue
        medians = {hop: median(h.get(hop) for h in found) for hop in hop_names}
        hop_medians[name] = medians
        hops.add_row(name, _num(median(runs.values(name, "hop_steps")), ".0f"),
                     *(ms(medians[hop]) for hop in hop_names))  # fmt: skip
        if name != "topk":
            prefix = "" if name == "small_cnn" else f"{name.removeprefix('small_cnn_')}_"
            for hop in hop_names:
                extras[f"{prefix}hop_{hop}_ms"] = _scaled(medians[hop], 1000)
    out.print(hops)
    for case in cases:  # the overlap against its baseline, the same job without it
        prefix = "" if case.name == "small_cnn" else f"{case.name}_"
        overlapped = hop_medians.get(case.name, {})
        baseline = hop_medians.get(f"{case.name}_serial", {})
        extras[f"{prefix}overlap_compute_grad_send_vs_serial"] = ratio(
            _sum(overlapped.get("compute"), overlapped.get("grad_send")),
            _sum(baseline.get("compute"), baseline.get("grad_send")),
        )
        extras[f"{prefix}overlap_step_vs_serial"] = ratio(
            overlapped.get("step"), baseline.get("step")
        )

    jobs = [name for name in (*job_names(cases), "topk", "fp16", "bf16")
            if name in runs.jobs]  # fmt: skip
    cpu = Table(
        title="Conveyor: CPU ms per step by process (median; waiting for a CPU in brackets)"
    )
    cpu.add_column("process")
    cpu.add_column("idle stack, CPU ms/s", justify="right")
    for name in jobs:
        cpu.add_column(name, justify="right")
    processes = sorted(
        {n for name in jobs for run in runs.values(name, "cpu_per_step_s") for n in run}
    )
    for process in [*processes, "total"]:
        idle = runs.idle_cpu_per_s
        if process == "total":
            cells = [ms(sum(v for k, v in idle.items() if ":" not in k) if idle else None)]
        else:
            cells = [ms(idle.get(process))]
        for name in jobs:
            cpu_runs = runs.values(name, "cpu_per_step_s")
            runq_runs = runs.values(name, "runq_per_step_s")
            if process == "total":  # processes only: their threads are in them already
                used = median(sum(v for k, v in r.items() if ":" not in k) for r in cpu_runs)
                waited = median(sum(r.values()) for r in runq_runs)
            else:
                used = median(r.get(process) for r in cpu_runs)
                waited = median(r.get(process) for r in runq_runs)
            cells.append(f"{ms(used)} ({ms(waited)})" if waited is not None else ms(used))
        cpu.add_row(process, *cells)
    out.print(cpu)

    wire = Table(
        title="Gradient bytes per step (upstream, trainer -> aggregators), small_cnn digits"
    )
    for column in ("compression", "bytes / contribution", "bytes / applied step",
                   "summary grad_bytes_per_step", "dense / this (contribution)",
                   "dense / this (summary)"):  # fmt: skip
        wire.add_column(column, justify="left" if column == "compression" else "right")
    dense_name = "small_cnn"
    dense_contribution = median(runs.values(dense_name, "contribution_bytes"))
    dense_summary = median(runs.values(dense_name, "summary_bytes_per_step"))
    reductions: dict[str, float | None] = {}
    for kind, name in (("none", dense_name), ("fp16", "fp16"), ("bf16", "bf16"), ("topk", "topk")):
        if name not in runs.jobs:
            continue
        contribution = median(runs.values(name, "contribution_bytes"))
        summary = median(runs.values(name, "summary_bytes_per_step"))
        reductions[kind] = ratio(dense_contribution, contribution)
        extras[f"{kind}_bytes_per_step_summary"] = summary
        wire.add_row(
            kind if kind != "topk" else f"topk {TOPK_RATIO:g} + error feedback",
            _num(contribution, ".0f"),
            _num(median(runs.values(name, "step_bytes")), ".0f"),
            _num(summary, ".0f"),
            times(reductions[kind]),
            times(ratio(dense_summary, summary)),
        )
    out.print(wire)
    extras["fp16_bytes_reduction"] = reductions.get("fp16")
    extras["bf16_bytes_reduction"] = reductions.get("bf16")
    extras["topk_bytes_reduction_summary"] = ratio(
        dense_summary, median(runs.values("topk", "summary_bytes_per_step"))
    )

    dense_acc = runs.values("small_cnn", "eval_accuracy")
    topk_acc = runs.values("topk", "eval_accuracy")
    deltas = accuracy_deltas(dense_acc, topk_acc) if len(dense_acc) == len(topk_acc) else []
    accuracy = Table(title=f"Eval accuracy, examples/digits.yaml, {args.digits_epochs} epochs")
    for column in ("", "dense", f"topk {TOPK_RATIO:g} + EF", "delta (points)"):
        accuracy.add_column(column, justify="left" if not column else "right")
    accuracy.add_row(
        f"Conveyor (per repeat: {', '.join(f'{d:.1f}' for d in deltas)})",
        spread([a for a in dense_acc if a is not None], ".4f"),
        spread([a for a in topk_acc if a is not None], ".4f"),
        spread(deltas),
    )
    ref_delta = None
    if runs.reference:
        ref_deltas = accuracy_deltas(runs.reference["dense"], runs.reference["topk"])
        ref_delta = statistics.fmean(ref_deltas)
        ref_error = statistics.stdev(ref_deltas) / math.sqrt(len(ref_deltas))
        extras["reference_topk_accuracy_delta_stderr"] = ref_error
        accuracy.add_row(
            f"in-process reference of the algorithm (no broker), seeds 0..{REFERENCE_SEEDS - 1}: "
            f"mean delta {ref_delta:.2f} +- {ref_error:.2f} (standard error), median "
            f"{statistics.median(ref_deltas):.2f}",
            spread(runs.reference["dense"], ".4f"), spread(runs.reference["topk"], ".4f"),
            spread(ref_deltas),
        )  # fmt: skip
    out.print(accuracy)
    extras["dense_eval_accuracy"] = median(dense_acc)
    extras["topk_eval_accuracy"] = median(topk_acc)
    extras["system_topk_accuracy_delta"] = median(deltas)

    bytes_reduction = reductions.get("topk")
    # The headline is the reference's mean over REFERENCE_SEEDS seeds when it ran: the system's
    # median over a few repeats carries ~1 point of seed noise (both are printed above).
    delta = ref_delta if ref_delta is not None else median(deltas)
    stalls = [(name, run["stalled"]) for name, jobs in runs.jobs.items() for run in jobs
              if "stalled" in run]  # fmt: skip
    extras["stalled_jobs"] = float(len(stalls))
    for name, diagnosis in stalls:
        out.print(
            f"[red]STALLED[/red] {name} job (cancelled, left out of the figures): {diagnosis}"
        )
    cores = os.cpu_count() or 1
    out.print(
        f"Machine: {cores} CPU core(s), torch threads 1 per training process; 1-minute load "
        f"average {min(load):.1f}..{max(load):.1f} (other work shares it: compare ratios).\n"
        "Conveyor: one stack for the whole run (broker + gateway + sharder + preprocessor + "
        f"{TRAINERS} trainers + {SLICES} aggregators = 8 processes on these cores), jobs one "
        "after the other; fp16/bf16: one 1-epoch job each (their bytes are fixed by the layout).\n"
        f"Top-k bytes: bf16 values + int32 indices, so {TOPK_RATIO:g} can save at most "
        f"{max_topk_reduction(TOPK_RATIO):.0f}x (k is rounded up per slice). Only the upstream "
        "gradients are compressed: the parameters come back dense (fp32) every step.\n"
        f"Targets: >= {TARGET_REDUCTION:g}x fewer bytes ({times(bytes_reduction)}), within "
        f"{TARGET_DELTA_POINTS:g} points ({_num(delta, '.2f')} points)."
    )
    return result_json(
        extras=extras,
        step_vs_ddp=headline_step_vs_ddp,
        bytes_reduction=bytes_reduction,
        accuracy_delta=delta,
    )


def job_names(cases: Sequence[Case]) -> list[str]:
    """Each case's job, then the same job without the overlap (``<case>_serial``)."""
    return [name for case in cases for name in (case.name, f"{case.name}_serial")]


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def wide_console() -> Console:
    """stdout, at least 140 columns wide (rich uses 80 when stdout is not a terminal)."""
    return Console(width=max(140, Console().width))


def print_investigation(found: dict[str, list[float]]) -> None:
    table = Table(title="Reference algorithm (in-process), digits, eval accuracy per seed")
    for column in ("variant", "seeds", "mean", "vs dense, points (mean)"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    dense = found.get("dense", [])
    dense20 = found.get("dense, 20 epochs", [])
    for name, values in found.items():
        base = dense20 if "20 epochs" in name else dense
        deltas = accuracy_deltas(base, values) if len(base) == len(values) else []
        table.add_row(
            name,
            ", ".join(f"{v:.3f}" for v in values),
            f"{statistics.fmean(values):.4f}",
            f"{statistics.fmean(deltas):.1f}" if deltas else "-",
        )
    wide_console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 2 epochs, small_cnn")
    parser.add_argument("--models", default="small_cnn,resnet18", help="small_cnn,resnet18")
    parser.add_argument("--digits-epochs", type=int, default=5, help="the demo's 5")
    parser.add_argument("--resnet-width", type=int, default=16)
    parser.add_argument("--resnet-n", type=int, default=960, help="synthetic samples (1 epoch)")
    parser.add_argument(
        "--resnet-repeats", type=int, default=1, help="repeats that include resnet18 (the first N)"
    )
    parser.add_argument("--baseline-steps", type=int, default=100, help="small_cnn timed steps")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave out the in-process top-k reference (minutes of CPU; "
                        "topk_accuracy_delta is then the system's)")  # fmt: skip
    parser.add_argument("--investigate", type=int, default=0, metavar="SEEDS",
                        help="only run the in-process reference variants for SEEDS seeds "
                        "(no stack, no baselines)")  # fmt: skip
    args = parser.parse_args()
    if args.investigate:
        base = digits_spec(epochs=5, compression="none")
        found = investigate(base, COMPRESSIONS["topk"], args.investigate, log=ERR.log)
        print_investigation(found)
        print(json.dumps({f"mean_accuracy: {k}": round(statistics.fmean(v), 4)
                          for k, v in found.items()}))  # fmt: skip
        return
    if args.quick:
        args.repeats, args.digits_epochs, args.models = 1, 2, "small_cnn"
        args.baseline_steps = 40
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if "small_cnn" not in names or not set(names) <= {"small_cnn", "resnet18"}:
        parser.error("--models takes small_cnn (required) and optionally resnet18")
    if min(args.repeats, args.digits_epochs, args.baseline_steps) < 1:
        parser.error("counts must be >= 1")
    if not scale_supported():
        parser.error("this checkout's `conveyor up` has no --scale")

    cases = [
        Case(
            "small_cnn", f"digits 1x8x8, batch 64, {args.digits_epochs} epochs",
            digits_spec(epochs=args.digits_epochs, compression="none"), 10, args.baseline_steps,
        )
    ]  # fmt: skip
    if "resnet18" in names:
        cases.append(
            Case(
                "resnet18",
                f"w{args.resnet_width} group norm, synthetic 3x32x32, batch 64",
                resnet_spec(n=args.resnet_n, width=args.resnet_width),
                2,
                6,
            )
        )
    runs, load = Runs(), [os.getloadavg()[0]]
    began = time.monotonic()
    measure(args, cases, runs, load)
    ERR.log(f"measured in {time.monotonic() - began:.0f} s")
    print(json.dumps(report(args, cases, runs, load)))


if __name__ == "__main__":
    main()
