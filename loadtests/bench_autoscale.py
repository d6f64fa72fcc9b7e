"""Autoscaling from a starving start: this autoscaler vs a fixed pool sized for the peak vs a
lag-only policy (a lag threshold polled every 30 s, as KEDA's Kafka scaler does).

Each run is a fresh ``conveyor up`` stack and the same job: a synthetic dataset whose samples
cost CPU to produce (``cost_ms``), preprocessors that work one shard at a time
(``CONVEYOR_PREPROCESSOR_CONCURRENCY=1``, so one process is one core at most) and a trainer
that sleeps per micro-batch (``CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S``: a fixed demand that
costs no CPU), so one preprocessor cannot feed it and ``--peak`` can:

    autoscaler  the stack's autoscaler (local driver), from 1 preprocessor, up to --peak;
    fixed       --peak preprocessors from the start, the autoscaler held at that size;
    lag_only    1 preprocessor, the stack's autoscaler off; this process polls the
                preprocessor group's lag on conveyor.shards every --lag-poll-s (30) and sets
                the pool to ceil(lag / --lag-threshold) within [1, --peak] through the same
                local driver (KEDA's formula: desired = ceil(total lag / lagThreshold)).

Measured from the job's submission: **seconds to fed**, until the trainers' data wait (the
gateway's job progress: their recent exposed data wait / step time) is under 5% and stays
there to the job's end, at least 10 s (None: never; the batches made before the trainer began
keep every pool fed for its first seconds, so that is not counted), and
**preprocessor-seconds**, the preprocessor processes alive (stack.json, sampled every 0.5 s)
integrated from the submission to ``--idle-s`` after the job's end (a pool costs while it
waits for the next job; the autoscaler's cooldown is 60 s).

``--model`` runs the three policies on the fluid model of ``loadtests/autoscale_model.py``
instead (the real policy fold, a simulated pipeline: seconds, no processes), for the sizes a
two-core machine cannot run: a real pool that must outgrow one core beside the trainer.

Each repeat runs the three in a rotated order; figures are medians over repeats. The last
line printed is one JSON object:
{"seconds_to_fed": ..., "seconds_to_fed_lag_only": ..., "preprocessor_seconds_vs_fixed_peak":
<autoscaler / fixed>} (plus the other figures).

    .venv/bin/python -m loadtests.bench_autoscale            # 1 repeat (~15 min)
    .venv/bin/python -m loadtests.bench_autoscale --quick    # a shorter job (~8 min)
    .venv/bin/python -m loadtests.bench_autoscale --repeats 3
    .venv/bin/python -m loadtests.bench_autoscale --model    # the fluid model, in seconds

The job is long enough for the lag-only policy to poll during it (its first poll is 30 s after
the submission): shorter, it would never act, and its figure would say nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests._bench_common import ConveyorStack

FED_RATIO = 0.05
FED_HOLD_S = 10.0
"""Fed = the trainers' data wait stays under FED_RATIO this long (their data-wait window)."""
SAMPLE_S = 0.5
QUICK = {"samples": 40_000, "idle_s": 70.0}
"""What --quick changes (flags given explicitly still win): the lag-only policy still polls
once or twice during the job, and the idle time still outlasts the autoscaler's 60 s cooldown
(its return to the minimum is what saves preprocessor-seconds)."""


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    seconds_to_fed: float | None
    preprocessor_seconds: float
    job_seconds: float
    peak_replicas: int
    decisions: int
    at_peak_after_s: float | None = None
    """When the pool first ran at its peak size, from the submission (real stacks only)."""
    data_wait_at_peak: float | None = None
    """The median data wait the gateway reported from then to the job's end."""


def job_spec(*, n: int, cost_ms: float, epochs: int) -> dict[str, Any]:
    return {
        "name": "bench-autoscale",
        "model": {"name": "mlp", "num_classes": 10},
        "dataset": {"uri": f"synthetic://?n={n}&shape=1x8x8&classes=10&seed=0&cost_ms={cost_ms}",
                    "eval_fraction": 0.05},
        "preprocess": {"normalize": {"mean": [0.5], "std": [0.5]}, "augment": []},
        "training": {"epochs": epochs, "global_batch_size": 64, "micro_batch_size": 32,
                     "optimizer": {"name": "sgd", "lr": 0.05}, "seed": 0},
        "flow": {"shard_size": 64, "max_lead_batches": 64},
        "resources": {"device": "cpu", "threads": 1},
    }  # fmt: skip


class PoolSampler:
    """Counts the preprocessor processes recorded in stack.json every SAMPLE_S seconds."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = state_dir
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from conveyor.embedded.procs import is_alive
        from conveyor.embedded.registry import service_of
        from conveyor.embedded.state import load_state

        while not self._stop.wait(SAMPLE_S):
            state = load_state(self._state_dir)
            if state is None:
                continue
            pool = [s for s in state.services if service_of(s.name) == "preprocessor"]
            alive = sum(1 for s in pool if is_alive(s.process))
            self.samples.append((time.monotonic(), alive))

    def seconds(self, start: float, end: float) -> float:
        """Preprocessor-seconds between ``start`` and ``end`` (monotonic)."""
        inside = [(at, n) for at, n in self.samples if start <= at <= end]
        return sum(SAMPLE_S * n for _, n in inside)


class LagOnlyScaler:
    """KEDA's Kafka scaler, in this process: every ``poll_s``, desired = ceil(lag / threshold)
    within [1, peak], set through the stack's local driver."""

    def __init__(self, stack: ConveyorStack, *, threshold: int, poll_s: float, peak: int) -> None:
        self._stack, self._threshold, self._poll_s, self._peak = stack, threshold, poll_s, peak
        self.decisions = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` off the event loop (it keeps the clients' connections alive);
        False once stopped."""
        return not await asyncio.to_thread(self._stop.wait, seconds)

    def _preprocessor_env(self) -> dict[str, str]:
        """The environment ``conveyor up`` gave the stack's preprocessor (Linux /proc)."""
        pid = next(pid for name, pid in self._stack.processes() if name == "preprocessor")
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        return {key.decode(): value.decode() for key, value in pairs}

    async def _run(self) -> None:
        from conveyor.embedded.supervisor import LocalDriver
        from conveyor.platform.bus.group_lag import GroupLagReader
        from conveyor.platform.config import KafkaSettings
        from conveyor.platform.messages import Topics

        kafka = KafkaSettings(bootstrap=self._stack.bootstrap)
        topics = Topics(kafka.topic_prefix)
        driver = LocalDriver(state_dir=self._stack.state_dir, env=self._preprocessor_env(),
                             own_pid=-1, backoff_s=1, backoff_max_s=1, reset_s=1)  # fmt: skip
        async with GroupLagReader(kafka) as lags:
            while await self._sleep(self._poll_s):
                lag = (await lags.progress(topics.preprocessor_group, topics.shards)).lag
                desired = min(self._peak, max(1, math.ceil(lag / self._threshold)))
                if desired != await driver.replicas():
                    await driver.scale(desired)
                    self.decisions += 1


def fed_after(readings: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Seconds from ``start`` to the reading from which the data wait stays under FED_RATIO to
    the job's ``end``, a stretch of at least FED_HOLD_S (None: the trainers never got there).
    The batches made before the trainer began keep it fed for its first seconds whatever the
    pool, and a pool that shrinks too soon starves it again: neither is fed."""
    fed_at: float | None = None
    for at, wait in readings:
        if wait >= FED_RATIO:
            fed_at = None
        elif fed_at is None:
            fed_at = at
    if fed_at is None or min(end, readings[-1][0]) - fed_at < FED_HOLD_S:
        return None
    return round(fed_at - start, 1)


def run_one(policy: str, args: argparse.Namespace) -> RunResult:
    env = {
        "CONVEYOR_PREPROCESSOR_CONCURRENCY": "1",
        "CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S": str(args.step_delay_s),
        "CONVEYOR_TRAINER_RATE_WINDOW_S": "5",
        "CONVEYOR_AUTOSCALER_MAX_REPLICAS": str(args.peak),
    }
    preprocessors = args.peak if policy == "fixed" else 1
    scale = {"autoscaler": 0} if policy == "lag_only" else {}
    stack = ConveyorStack(preprocessors=preprocessors, env=env, use_scale=True, scale=scale)
    stack.start()
    sampler = PoolSampler(stack.state_dir)
    scaler = (LagOnlyScaler(stack, threshold=args.lag_threshold, poll_s=args.lag_poll_s,
                            peak=args.peak) if policy == "lag_only" else None)  # fmt: skip
    try:
        sampler.start()
        gateway = httpx.Client(base_url=stack.gateway_url, timeout=10)
        spec = job_spec(n=args.samples, cost_ms=args.cost_ms, epochs=args.epochs)
        submitted = time.monotonic()
        job_id = gateway.post("/v1/jobs", json=spec).json()["id"]
        if scaler is not None:
            scaler.start()
        readings: list[tuple[float, float]] = []
        while True:
            job = gateway.get(f"/v1/jobs/{job_id}").json()
            wait = job["progress"]["data_wait_ratio"]
            if wait is not None:
                readings.append((time.monotonic(), wait))
            if job["state"] in ("completed", "failed", "cancelled"):
                break
            if time.monotonic() - submitted > args.timeout_s:
                raise RuntimeError(f"{policy}: job not done after {args.timeout_s} s")
            time.sleep(0.25)
        ended = time.monotonic()
        if job["state"] != "completed":
            raise RuntimeError(f"{policy}: job {job['state']}: {job.get('reason')}")
        time.sleep(args.idle_s)  # the pool while no job runs
        decisions = (scaler.decisions if scaler is not None
                     else gateway.get("/v1/autoscaler").json()["changes"])  # fmt: skip
    finally:
        if scaler is not None:
            scaler.stop()
        sampler.stop()
        stack.stop()
    peak = max((n for _, n in sampler.samples), default=0)
    at_peak = next((at for at, n in sampler.samples if at >= submitted and n == peak), None)
    waits_at_peak = [w for at, w in readings if at_peak is not None and at >= at_peak]
    return RunResult(
        policy=policy,
        seconds_to_fed=fed_after(readings, submitted, ended),
        preprocessor_seconds=round(sampler.seconds(submitted, ended + args.idle_s), 1),
        job_seconds=round(ended - submitted, 1),
        peak_replicas=peak,
        decisions=decisions,
        at_peak_after_s=round(at_peak - submitted, 1) if at_peak is not None else None,
        data_wait_at_peak=round(statistics.median(waits_at_peak), 4) if waits_at_peak else None,
    )


def model_one(policy: str, args: argparse.Namespace) -> RunResult:
    """One policy on the fluid model (demand and rate in samples/s, as in Pipeline)."""
    from loadtests.autoscale_model import Pipeline, simulate

    pipe = Pipeline(demand=args.model_demand, rate=args.model_rate, start_s=args.model_start_s)
    out = simulate(policy, pipe, peak=args.model_peak, idle_s=args.idle_s,
                   threshold=args.lag_threshold, poll_s=args.lag_poll_s)  # fmt: skip
    return RunResult(policy=policy, seconds_to_fed=out.seconds_to_fed,
                     preprocessor_seconds=out.preprocessor_seconds, job_seconds=out.job_seconds,
                     peak_replicas=out.peak_replicas, decisions=out.decisions)  # fmt: skip


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--peak", type=int, default=2, help="the fixed pool; the others' max")
    parser.add_argument("--samples", type=int, default=80_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--cost-ms", type=float, default=2.0, help="CPU per sample")
    parser.add_argument("--step-delay-s", type=float, default=0.035, help="per micro-batch")
    parser.add_argument("--lag-threshold", type=int, default=2, help="shard tasks per replica")
    parser.add_argument("--lag-poll-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--idle-s", type=float, default=90.0, help="counted after the job")
    parser.add_argument("--model-peak", type=int, default=5)
    parser.add_argument("--model-demand", type=float, default=1000.0, help="samples/s")
    parser.add_argument("--model-rate", type=float, default=300.0, help="per preprocessor")
    parser.add_argument("--model-start-s", type=float, default=8.0, help="a replica's start")
    parser.add_argument("--model", action="store_true", help="the fluid model, no processes")
    parser.add_argument("--quick", action="store_true", help=f"shorter: {QUICK}")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    policies = ["autoscaler", "fixed", "lag_only"]
    results: list[RunResult] = []
    for repeat in range(1 if args.model else args.repeats):
        order = policies[repeat % 3 :] + policies[: repeat % 3]
        for policy in order:
            result = model_one(policy, args) if args.model else run_one(policy, args)
            print(json.dumps(dataclasses.asdict(result)), flush=True)
            results.append(result)

    def figures(policy: str) -> list[RunResult]:
        return [r for r in results if r.policy == policy]

    ours, fixed, lag = figures("autoscaler"), figures("fixed"), figures("lag_only")
    ours_ps = _median([r.preprocessor_seconds for r in ours])
    fixed_ps = _median([r.preprocessor_seconds for r in fixed])
    print(json.dumps({
        "seconds_to_fed": _median([r.seconds_to_fed for r in ours]),
        "seconds_to_fed_lag_only": _median([r.seconds_to_fed for r in lag]),
        "seconds_to_fed_fixed_peak": _median([r.seconds_to_fed for r in fixed]),
        "preprocessor_seconds_vs_fixed_peak": (
            round(ours_ps / fixed_ps, 3) if ours_ps is not None and fixed_ps else None
        ),
        "preprocessor_seconds_lag_only_vs_fixed_peak": (
            round(p / fixed_ps, 3) if (p := _median([r.preprocessor_seconds for r in lag]))
            is not None and fixed_ps else None
        ),
        "job_seconds": {name: _median([r.job_seconds for r in figures(name)])
                        for name in policies},
        "repeats": 1 if args.model else args.repeats,
        "mode": "model" if args.model else ("stack-quick" if args.quick else "stack"),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
