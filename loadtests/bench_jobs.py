"""Several jobs at once: the scheduler's pool sharing against running the jobs one after another.

One ``conveyor up`` stack with a pool of ``--trainers`` trainers (3), each slowed to a
simulated accelerator (CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S, so that the trainers and not
the shared preprocessor are the bottleneck, as on a GPU cluster). Each round submits
``--jobs`` (6) small synthetic jobs at once, in one of two ways:

    shared   every job asks 1 trainer (``distribution.trainers: 1``): the scheduler runs
             as many at once as the pool has trainers, the rest wait in the queue
    fifo     every job asks the whole pool (``trainers: N``): one job at a time, in
             submission order, with every trainer on it (what the stack did before the
             scheduler: every trainer joined the oldest job)

Makespan = last completion - first submission; completion time of a job = its completion -
its submission (the jobs topic's times, as the gateway shows them: ``submitted_at`` and the
``updated_at`` of the completed job). Rounds alternate the two ways on the same stack; figures
are medians over ``--repeats`` rounds of each. The last line printed is one JSON object:
{"makespan_vs_fifo": <shared / fifo makespan>,
 "mean_completion_vs_fifo": <shared / fifo mean completion time>}  (below 1: shared is faster)

    .venv/bin/python -m loadtests.bench_jobs               # 2 repeats
    .venv/bin/python -m loadtests.bench_jobs --quick       # 1 repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

from rich.console import Console
from rich.table import Table

from conveyor.cli.client import TERMINAL_STATES, GatewayClient
from loadtests._bench_common import ConveyorStack

JOB_TIMEOUT_S = 900.0
STEP_DELAY_S = 0.02
"""Simulated accelerator time per micro-batch (the trainers' share of a step)."""
WAYS = ("shared", "fifo")


def job_spec(name: str, *, n: int, epochs: int, trainers: int) -> dict[str, Any]:
    """A small synthetic job (1x8x8 images, small_cnn, one torch thread per trainer)."""
    return {
        "name": name,
        "model": {"name": "small_cnn", "num_classes": 10},
        "dataset": {
            "uri": f"synthetic://?n={n}&shape=1x8x8&classes=10&seed=1",
            "eval_fraction": 0.2,
        },
        "training": {
            "epochs": epochs,
            "global_batch_size": 64,
            "micro_batch_size": 32,
            "optimizer": {"name": "adam", "lr": 0.004},
            "seed": 0,
        },
        "distribution": {"trainers": trainers, "aggregator_shards": 1},
        "resources": {"device": "cpu", "threads": 1},
    }


def run_round(
    gateway: GatewayClient, *, way: str, jobs: int, trainers: int, n: int, epochs: int
) -> dict[str, float]:
    """Submit ``jobs`` jobs at once; wait for all; their makespan and mean completion time."""
    asked = 1 if way == "shared" else trainers
    tag = uuid.uuid4().hex[:6]
    ids = [
        gateway.submit(job_spec(f"bench-{way}-{tag}-{i}", n=n, epochs=epochs, trainers=asked))["id"]
        for i in range(jobs)
    ]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{way}: {len(ids) - len(done)} jobs unfinished after timeout")
        for job_id in ids:
            if job_id not in done:
                job = gateway.job(job_id)
                if job["state"] in TERMINAL_STATES:
                    if job["state"] != "completed":
                        raise RuntimeError(f"{way}: job {job_id} {job['state']}: {job['reason']}")
                    done[job_id] = job
        time.sleep(0.2)
    submitted = min(job["submitted_at"] for job in done.values())
    completions = [job["updated_at"] - job["submitted_at"] for job in done.values()]
    return {
        "makespan_s": max(job["updated_at"] for job in done.values()) - submitted,
        "mean_completion_s": statistics.fmean(completions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--trainers", type=int, default=3, help="trainers in the pool")
    parser.add_argument("--n", type=int, default=640, help="synthetic samples per job")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    if min(args.repeats, args.jobs, args.trainers, args.n, args.epochs) < 1:
        parser.error("counts must be >= 1")

    err = Console(stderr=True)
    stack = ConveyorStack(
        preprocessors=1,
        env={"CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S": str(STEP_DELAY_S)},
        use_scale=True,
        scale={"trainer": args.trainers},
    )
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    stack.start()
    try:
        with GatewayClient(stack.gateway_url) as gateway:
            for repeat in range(args.repeats):
                order = WAYS if repeat % 2 == 0 else WAYS[::-1]
                for way in order:
                    result = run_round(
                        gateway, way=way, jobs=args.jobs, trainers=args.trainers, n=args.n,
                        epochs=args.epochs,
                    )  # fmt: skip
                    results[way].append(result)
                    err.log(
                        f"repeat {repeat + 1}/{args.repeats} {way}: makespan "
                        f"{result['makespan_s']:.1f} s, mean completion "
                        f"{result['mean_completion_s']:.1f} s"
                    )
    finally:
        stack.stop()

    medians = {
        way: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for way, rounds in results.items()
    }
    table = Table(
        title=f"{args.jobs} jobs submitted at once on {args.trainers} trainers (synthetic "
        f"n={args.n}, {args.epochs} epochs, {STEP_DELAY_S * 1000:.0f} ms simulated compute per "
        f"micro-batch) - medians of {args.repeats} round(s)"
    )
    for column in ("way", "makespan (s)", "mean completion (s)"):
        table.add_column(column)
    for way in WAYS:
        table.add_row(
            way, f"{medians[way]['makespan_s']:.1f}", f"{medians[way]['mean_completion_s']:.1f}"
        )
    Console().print(table)
    print(json.dumps({
        "makespan_vs_fifo": round(
            medians["shared"]["makespan_s"] / medians["fifo"]["makespan_s"], 3),
        "mean_completion_vs_fifo": round(
            medians["shared"]["mean_completion_s"] / medians["fifo"]["mean_completion_s"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
