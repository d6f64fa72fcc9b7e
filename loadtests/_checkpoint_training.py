"""Part 1 of bench_checkpoint.py: training throughput with and without every-N checkpoints. Its
settings, the job specs (digits, resnet18), one job on the Conveyor stack measured from the
StepCloses the coordinator publishes, and every case over the repeats."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from loadtests._bench_common import ConveyorStack, JobWatcher
from loadtests._checkpoint_figures import close_window, default_warmup, median, stall_excess

ROOT = Path(__file__).resolve().parent.parent


TRAINERS = 2


SLICES = 2


STACK_SCALE = {"trainer": TRAINERS, "aggregator": SLICES}


JOB_TIMEOUT_S = 600.0


IDLE_SETTLE_S = 5.0
"""Seconds the stack is left alone after it is up (the aggregators warm torch up)."""


STALL_STEPS = 3
"""Steps after a checkpointed one that its snapshot and background write may slow down (the
write of tens of MB competes with them for the cores)."""


TARGET_LOSS, TARGET_IO_RATIO = 0.035, 0.8


VARIANTS = ("every_n", "none")


ERR = Console(stderr=True)


# -- part 1: training throughput with and without every-N checkpoints -----------------------------


def digits_spec(*, epochs: int, every_steps: int | None) -> dict[str, Any]:
    """examples/digits.yaml (2 trainers, 2 slices, sync, SGD momentum) on the CPU with 1 torch
    thread, ``epochs`` epochs, ``checkpoint.every_steps`` set or unset."""
    from conveyor.training.jobspec import JobSpec

    data = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    data["name"] = "bench-ckpt-digits"
    data["training"]["epochs"] = epochs
    data["checkpoint"]["every_steps"] = every_steps
    data["resources"] = {"device": "cpu", "threads": 1}
    return JobSpec.from_dict(data).to_dict()


def resnet_spec(*, n: int, width: int, every_steps: int | None) -> dict[str, Any]:
    """resnet18 (group norm) on synthetic 3x32x32, Adam, one epoch, the demo's distribution,
    global batch 16 (2 x 8: a step of a fraction of a second on 2 cores, so that a job holds
    a hundred steps)."""
    from conveyor.training.jobspec import JobSpec

    every = "null" if every_steps is None else every_steps
    text = f"""
name: bench-ckpt-resnet18
model: {{name: resnet18, width: {width}, norm: group}}
dataset: {{uri: "synthetic://?n={n}&shape=3x32x32&classes=10", eval_fraction: 0.1}}
preprocess: {{normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}}}
training:
  epochs: 1
  global_batch_size: 16
  micro_batch_size: 8
  optimizer: {{name: adam, lr: 0.001}}
  seed: 0
distribution: {{trainers: {TRAINERS}, aggregator_shards: {SLICES}, mode: sync}}
checkpoint: {{every_steps: {every}, keep_last: 3}}
resources: {{device: cpu, threads: 1}}
"""
    return JobSpec.from_yaml(text).to_dict()


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    description: str
    specs: dict[str, dict[str, Any]]
    """Variant (``every_n``, ``none``) -> job spec."""


class CloseWatcher(JobWatcher):
    """A :class:`JobWatcher` that also keeps the job's StepCloses."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.closes: list[tuple[int, float, int, str | None]] = []
        """(version, closed_at, num_samples, checkpoint trigger) in log order."""

    def _heartbeat(self, value: bytes | None) -> None:  # every control-topic record
        from conveyor.platform.messages import StepClose

        message = self._decode(value)
        if isinstance(message, StepClose):
            self.closes.append(
                (message.version, message.closed_at, message.num_samples, message.checkpoint)
            )
        else:
            super()._heartbeat(value)


def run_job(stack: ConveyorStack, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit ``spec`` to the running stack and follow it to its end; figures of the run."""
    from conveyor.cli.client import GatewayClient
    from conveyor.platform.config import KafkaSettings

    with GatewayClient(stack.gateway_url) as client:
        client.wait_ready()
        job = client.submit(spec)
    watcher = CloseWatcher(
        bootstrap=stack.bootstrap,
        topic_prefix=KafkaSettings(bootstrap=stack.bootstrap).topic_prefix,
        job_id=job["id"],
    )
    watcher.start()
    try:
        event, _, data = watcher.wait_terminal(JOB_TIMEOUT_S)
        time.sleep(1.0)  # the final checkpoint's commit event follows `completed`
    finally:
        watcher.stop()
    if event != "completed":
        raise RuntimeError(f"job {job['id']} {event}: {data}")
    closes = [(v, at, n) for v, at, n, _ in watcher.closes]
    applied = sorted(c for c in closes if c[2] > 0)
    warmup = default_warmup(len(applied))
    window = close_window(closes, warmup)
    # The window runs from the warm-up's last step to the last step: the checkpoints of the
    # steps in between are written within it (the last one's, the job end's, after it).
    in_window = applied[warmup - 1 :] if len(applied) > warmup else []
    first, last = (in_window[0][0], in_window[-1][0]) if in_window else (0, 0)
    triggers = {v: t for v, _, _, t in watcher.closes if t is not None and first < v < last}
    every_steps = [v for v, t in triggers.items() if t == "every_steps"]
    stalls = stall_excess([(v, at) for v, at, _ in in_window], every_steps, STALL_STEPS)
    commits = [d for name, _, d in watcher.events if name == "checkpoint"]
    failures = [d for name, _, d in watcher.events if name == "checkpoint_failed"]
    summary: dict[str, Any] = data["summary"]
    return {
        "samples_per_second": window.samples_per_second if window else None,
        "window_s": window.seconds if window else None,
        "window_steps": (window.last_step - window.first_step) if window else 0,
        "samples_per_step": (
            window.samples / (window.last_step - window.first_step) if window else None
        ),
        "checkpoints_in_window": len(triggers),
        "every_steps_in_window": len(every_steps),
        "stall_s": median(stalls),
        "stall_share": sum(stalls) / window.seconds if window and stalls else None,
        "commits": len(commits),
        "commit_failures": len(failures),
        "checkpoint_bytes": median([float(d["size_bytes"]) for d in commits]),
        "commit_seconds": median([float(d["seconds"]) for d in commits]),
        "job_samples_per_second": summary.get("samples_per_second"),
        "data_wait_ratio": summary.get("data_wait_ratio"),
        "steps": summary.get("steps"),
        "eval_accuracy": summary.get("eval_accuracy"),
    }


def run_training(
    args: argparse.Namespace, cases: list[Case], load: list[float]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """case -> variant -> one run per repeat; variants in alternating order per repeat."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        case.name: {variant: [] for variant in VARIANTS} for case in cases
    }
    stack = ConveyorStack(preprocessors=1, env={}, use_scale=True, scale=STACK_SCALE)
    started = time.monotonic()
    ERR.log("starting the stack: conveyor up --scale trainer=2 --scale aggregator=2")
    try:
        stack.start()
        ERR.log(f"stack up in {time.monotonic() - started:.0f} s")
        time.sleep(args.settle_s)
        for repeat in range(args.repeats):
            for case in cases:
                order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    began = time.monotonic()
                    result = run_job(stack, case.specs[variant])
                    runs[case.name][variant].append(result)
                    load.append(os.getloadavg()[0])
                    ERR.log(
                        f"repeat {repeat + 1}/{args.repeats} {case.name} {variant}: "
                        f"{result['samples_per_second'] or 0:.1f} samples/s over "
                        f"{result['window_s'] or 0:.1f} s, {result['checkpoints_in_window']} "
                        f"checkpoint(s) in the window, {result['commits']} committed "
                        f"({time.monotonic() - began:.0f} s)"
                    )
    finally:
        stack.stop()
    return runs
