"""What ``distribution.deterministic`` costs: the same one-trainer job with and without it,
side by side on one stack.

One real stack (``conveyor up --scale preprocessor=2``: two preprocessors, so batches reach the
trainer out of plan order and a deterministic step waits for the ones it needs), jobs one after
the other. Each repeat runs the job twice, in alternating order:
    deterministic  ``distribution.deterministic: true`` (steps taken whole, in plan order, a
                   torch seed per micro-batch);
    default        the same spec without it (steps take the batches as they arrive).
The job: examples/digits.yaml with one trainer and one slice, --epochs epochs (default 4: 92
steps). Throughput: samples/s over the StepCloses after the warm-up, as bench_checkpoint
measures it (:func:`loadtests.bench_checkpoint.run_job`); ratio = deterministic / default in
the same repeat, median over the repeats. The exposed data wait (the summary's
``data_wait_ratio``) is shown beside it: waiting for the next batch in plan order is where the
cost comes from.

The last line printed is one JSON object:
    {"deterministic_throughput_ratio": median ratio, "deterministic_samples_per_second": ...,
     "default_samples_per_second": ..., "deterministic_data_wait_ratio": ...,
     "default_data_wait_ratio": ..., "repeats": N}

    .venv/bin/python -m loadtests.bench_deterministic             # 3 repeats, ~3 minutes here
    .venv/bin/python -m loadtests.bench_deterministic --quick     # smoke run: 1 repeat, 1 epoch
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from loadtests._bench_common import ConveyorStack
from loadtests.bench_checkpoint import ratios, run_job

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("deterministic", "default")
PREPROCESSORS = 2
ERR = Console(stderr=True)


def job_spec(*, epochs: int, deterministic: bool) -> dict[str, Any]:
    """examples/digits.yaml on one trainer and one slice, ``epochs`` epochs, no every-N
    checkpoints (both variants take the epoch-end ones)."""
    spec: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    spec = copy.deepcopy(spec)
    spec["name"] = f"bench-{'deterministic' if deterministic else 'default'}"
    spec["training"]["epochs"] = epochs
    spec["distribution"] = {"trainers": 1, "aggregator_shards": 1,
                            "deterministic": deterministic}  # fmt: skip
    spec.pop("checkpoint", None)
    return spec


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 epoch (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.epochs = 1, 1
    if min(args.repeats, args.epochs) < 1:
        parser.error("counts must be >= 1")
    specs = {v: job_spec(epochs=args.epochs, deterministic=v == "deterministic")
             for v in VARIANTS}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    stack = ConveyorStack(preprocessors=PREPROCESSORS, env={}, use_scale=True)
    load = [os.getloadavg()[0]]
    try:
        stack.start()
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                result = run_job(stack, specs[variant])
                runs[variant].append(result)
                load.append(os.getloadavg()[0])
                ERR.log(f"repeat {repeat + 1}/{args.repeats} {variant}: "
                        f"{result['samples_per_second'] or 0:.1f} samples/s")  # fmt: skip
    finally:
        stack.stop()
    rates = {v: [r["samples_per_second"] or 0.0 for r in runs[v]] for v in VARIANTS}
    waits = {v: [r["data_wait_ratio"] or 0.0 for r in runs[v]] for v in VARIANTS}
    found = ratios(rates["deterministic"], rates["default"])
    print(f"deterministic / default samples/s per repeat: {[round(r, 3) for r in found]}; "
          f"load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores")  # fmt: skip
    print(json.dumps({
        "deterministic_throughput_ratio": median(found),
        "deterministic_samples_per_second": median(rates["deterministic"]),
        "default_samples_per_second": median(rates["default"]),
        "deterministic_data_wait_ratio": median(waits["deterministic"]),
        "default_data_wait_ratio": median(waits["default"]),
        "repeats": args.repeats,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
