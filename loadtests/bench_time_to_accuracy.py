"""Time to accuracy: plain PyTorch, DDP gloo, Conveyor sync and Conveyor local mode, side by side.

The same model, data, split, per-epoch order, initial weights, optimizer, global batch and
epochs, on the same cores (1 torch thread per training process), trained by:
    plain     one process, the whole global batch per step (loadtests/tta_baselines.py);
    ddp       torch.distributed DDP over gloo, one process per trainer, each its share;
    sync      Conveyor's real stack (``conveyor up --scale trainer=2 --scale aggregator=2``),
              distribution.mode sync, submitted through the gateway;
    local     the same stack, distribution.mode local (DiLoCo-style), sync_every_steps H
              (--window, default 8), the default outer optimizer (SGD lr 0.7, Nesterov 0.5);
    local_overlap  local with overlap_steps (--overlap, default 2): that many inner steps of
              the next window run while a window's delta travels (0: not run).
Cases: small_cnn on sklearn digits (examples/digits.yaml, 5 epochs, the headline) and resnet18
(width --resnet-width, group norm) on synthetic 3x32x32 (--resnet-n samples, --resnet-epochs).
The baselines run while no stack is up. Reported per system, median over --repeats:
    samples/s          train samples / wall time of training (evaluations included; Conveyor:
                       from the StepCloses, the samples of every step after the first one
                       that all trainers contributed to, over the time from that close to the
                       last: the steady state, without the job's start (the batches group's
                       join, a first window cut short by a rebalance), which made the
                       coordinator's own figure swing by 2x between repeats in local mode);
    time to accuracy   seconds from the start of training to the first epoch end whose eval
                       accuracy reaches the case's target (Conveyor: from the job's first
                       step begun, as its summary counts, to the epoch_completed event);
    final accuracy     eval accuracy after the last epoch;
    bytes per sample   bytes the training processes send per train sample: DDP's ring
                       all-reduce, 2 (W - 1) x 4 N bytes per step of the global batch; Conveyor,
                       the gradient (or delta) payload of every contribution plus one fp32
                       copy of the parameters per version published by the slice owners.
The last line printed is one JSON object (the headline keys are small_cnn's; resnet18's follow
with a ``resnet18_`` prefix):
    {"local_vs_ddp_samples_per_s", "local_vs_ddp_time_to_accuracy", "sync_vs_ddp_samples_per_s",
     "local_accuracy_delta_vs_sync" (points, sync minus local),
     "bytes_per_sample_local_vs_sync"}
then, with --overlap: "local_overlap_vs_ddp_samples_per_s", "local_overlap_vs_local_samples_per_s",
"local_overlap_vs_ddp_time_to_accuracy", "local_overlap_accuracy_delta_vs_sync".

    .venv/bin/python -m loadtests.bench_time_to_accuracy              # 1 repeat
    .venv/bin/python -m loadtests.bench_time_to_accuracy --quick      # smoke run

Each Conveyor run's log line also has the trainers' data wait and ``hops_ms``, where a version's
time went (``loadtests.plane_hops``); ``--max-lead-batches N`` sets the jobs' flow-control
lead, ``--preprocessors N`` the stack's preprocessors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from loadtests._bench_common import ConveyorStack, scale_supported
from loadtests.bench_aggregation import PlaneWatcher
from loadtests.plane_hops import median_hops, step_hops
from loadtests.tta_baselines import run_baselines

ROOT = Path(__file__).resolve().parent.parent
TRAINERS = 2
SLICES = 2
JOB_TIMEOUT_S = 900.0
SYSTEMS = ("plain", "ddp", "sync", "local", "local_overlap")
ERR = Console(stderr=True)


def case_specs(args: argparse.Namespace) -> dict[str, tuple[dict[str, Any], float]]:
    """{case: (sync job spec, target accuracy)}."""
    from conveyor.training.jobspec import JobSpec

    digits = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    digits["name"] = "bench-tta-small-cnn"
    digits["training"]["epochs"] = args.epochs
    digits["distribution"].update(trainers=TRAINERS, aggregator_shards=SLICES, mode="sync")
    digits["resources"] = {"device": "cpu", "threads": 1}
    digits["checkpoint"] = {"keep_last": 1}
    if args.max_lead_batches is not None:
        digits["flow"] = {"max_lead_batches": args.max_lead_batches}
    cases = {"small_cnn": (JobSpec.from_dict(digits).to_dict(), args.target)}
    lead = (
        ""
        if args.max_lead_batches is None
        else f"flow: {{max_lead_batches: {args.max_lead_batches}}}"
    )
    if args.resnet_epochs > 0:
        resnet = JobSpec.from_yaml(f"""
name: bench-tta-resnet18
model: {{name: resnet18, width: {args.resnet_width}, norm: group}}
dataset: {{uri: "synthetic://?n={args.resnet_n}&shape=3x32x32&classes=10", eval_fraction: 0.1}}
preprocess: {{normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}}}
training:
  epochs: {args.resnet_epochs}
  global_batch_size: 64
  micro_batch_size: 32
  optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
  seed: 0
distribution: {{trainers: {TRAINERS}, aggregator_shards: {SLICES}, mode: sync}}
checkpoint: {{keep_last: 1}}
resources: {{device: cpu, threads: 1}}
{lead}
""")
        cases["resnet18"] = (resnet.to_dict(), args.resnet_target)
    return cases


def local_spec(spec: dict[str, Any], window: int, overlap: int = 0) -> dict[str, Any]:
    from conveyor.training.jobspec import JobSpec

    data = json.loads(json.dumps(spec))
    data["name"] = f"{spec['name']}-local" + (f"-overlap{overlap}" if overlap else "")
    data["distribution"].update(mode="local", sync_every_steps=window, overlap_steps=overlap)
    return JobSpec.from_dict(data).to_dict()


def num_params(spec: dict[str, Any]) -> int:
    from conveyor.training.datasets import open_array_dataset
    from conveyor.training.jobspec import JobSpec
    from conveyor.training.slicing import build_job_model

    job = JobSpec.from_dict(spec)
    dataset = open_array_dataset(job.dataset.uri)
    model = build_job_model(job, num_classes=dataset.num_classes, sample_shape=dataset.sample_shape)
    return sum(p.numel() for p in model.parameters())


def time_to(epochs: list[dict[str, float]], target: float) -> float | None:
    """Seconds to the first epoch end at or above ``target`` (None: never)."""
    return next((e["elapsed_s"] for e in epochs if e["eval_accuracy"] >= target), None)


def baseline_figures(
    found: dict[str, Any], target: float, params: int, system: str
) -> dict[str, float | None]:
    epochs = found["epochs"]
    step_bytes = 2 * (TRAINERS - 1) * 4 * params if system == "ddp" else 0
    batch = 64
    return {
        "samples_per_s": found["samples"] / epochs[-1]["elapsed_s"],
        "time_to_accuracy_s": time_to(epochs, target),
        "final_accuracy": epochs[-1]["eval_accuracy"],
        "bytes_per_sample": step_bytes / batch,
    }


def run_job(
    stack: ConveyorStack, spec: dict[str, Any], target: float, params: int
) -> dict[str, Any]:
    """Submit ``spec``, follow it to its end; the figures of the run."""
    from conveyor.cli.client import GatewayClient
    from conveyor.platform.config import KafkaSettings

    with GatewayClient(stack.gateway_url) as client:
        client.wait_ready()
        job = client.submit(spec)
    watcher = PlaneWatcher(
        bootstrap=stack.bootstrap,
        topic_prefix=KafkaSettings(bootstrap=stack.bootstrap).topic_prefix,
        job_id=job["id"],
    )
    watcher.start()
    try:
        event, _, data = watcher.wait_terminal(JOB_TIMEOUT_S)
    finally:
        watcher.stop()
    if event != "completed":
        raise RuntimeError(f"job {job['id']} {event}: {data}")
    summary: dict[str, Any] = data["summary"]
    samples = int(summary["samples"])
    started_at = time.time()
    if summary["samples_per_second"]:
        # The coordinator's window: first step begun .. last step closed.
        ends = [at for name, at, _ in watcher.events if name == "completed"]
        started_at = ends[0] - samples / float(summary["samples_per_second"])
    epochs = [
        {"elapsed_s": at - started_at, "eval_accuracy": float(d["eval_accuracy"])}
        for name, at, d in watcher.events
        if name == "epoch_completed" and d.get("eval_accuracy") is not None
    ]
    sent = float(summary["grad_bytes_total"]) + int(summary["versions"]) * 4 * params
    workers = {cid: worker for cid, (worker, _, samples) in watcher.contributions.items()
               if samples}  # fmt: skip
    steps = [(at, samples, {workers[c] for c in ids if c in workers})
             for _, at, samples, ids in sorted(watcher.closes)]  # fmt: skip
    rate = steady_rate(steps, int(spec["distribution"]["trainers"]))
    # Where a version's time went (loadtests.plane_hops; in local mode "compute" is the whole
    # window: its inner steps and the data waits among them), median ms over the versions.
    hops = step_hops({v: (at, ids) for v, at, _, ids in watcher.closes}, watcher.stamps)
    return {
        "samples_per_s": rate if rate is not None else float(summary["samples_per_second"]),
        "time_to_accuracy_s": time_to(epochs, target),
        "final_accuracy": float(summary["eval_accuracy"]),
        "bytes_per_sample": sent / samples,
        "versions": int(summary["versions"]),
        "data_wait_ratio": summary.get("data_wait_ratio"),
        "hops_ms": {hop: round(1000 * s, 1) for hop, s in median_hops(hops).items()},
    }


def steady_rate(steps: list[tuple[float, int, set[str]]], trainers: int) -> float | None:
    """Samples per second of ``steps`` ((closed_at, num_samples, workers that contributed
    samples) in version order) after the first that ``trainers`` workers contributed to, over
    the time from its close to the last; None when there is no such step with a later one."""
    full = next((i for i, (_, _, who) in enumerate(steps) if len(who) >= trainers), None)
    if full is None or full + 1 >= len(steps):
        return None
    elapsed = steps[-1][0] - steps[full][0]
    samples = sum(n for _, n, _ in steps[full + 1 :])
    return samples / elapsed if elapsed > 0 else None


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def result_json(figures: dict[str, dict[str, dict[str, float | None]]]) -> dict[str, Any]:
    """The last line: local and sync against DDP, local against sync, per case."""
    result: dict[str, Any] = {}
    for case, systems in figures.items():
        prefix = "" if case == "small_cnn" else f"{case}_"
        local, sync, ddp = systems["local"], systems["sync"], systems["ddp"]
        delta = None
        if sync["final_accuracy"] is not None and local["final_accuracy"] is not None:
            delta = 100.0 * (sync["final_accuracy"] - local["final_accuracy"])
        rate = "samples_per_s"
        result.update({
            f"{prefix}local_vs_ddp_samples_per_s": ratio(local[rate], ddp[rate]),
            f"{prefix}local_vs_ddp_time_to_accuracy": ratio(
                local["time_to_accuracy_s"], ddp["time_to_accuracy_s"]
            ),
            f"{prefix}sync_vs_ddp_samples_per_s": ratio(sync[rate], ddp[rate]),
            f"{prefix}local_accuracy_delta_vs_sync": delta,
            f"{prefix}bytes_per_sample_local_vs_sync": ratio(
                local["bytes_per_sample"], sync["bytes_per_sample"]
            ),
        })  # fmt: skip
        overlap = systems.get("local_overlap")
        if overlap is None:
            continue
        delta = None
        if sync["final_accuracy"] is not None and overlap["final_accuracy"] is not None:
            delta = 100.0 * (sync["final_accuracy"] - overlap["final_accuracy"])
        result.update({
            f"{prefix}local_overlap_vs_ddp_samples_per_s": ratio(overlap[rate], ddp[rate]),
            f"{prefix}local_overlap_vs_local_samples_per_s": ratio(overlap[rate], local[rate]),
            f"{prefix}local_overlap_vs_ddp_time_to_accuracy": ratio(
                overlap["time_to_accuracy_s"], ddp["time_to_accuracy_s"]
            ),
            f"{prefix}local_overlap_accuracy_delta_vs_sync": delta,
        })  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=5, help="small_cnn epochs")
    parser.add_argument("--target", type=float, default=0.95, help="small_cnn target accuracy")
    parser.add_argument("--window", type=int, default=8, help="local mode's sync_every_steps")
    parser.add_argument(
        "--overlap", type=int, default=2, help="local_overlap's overlap_steps (0: not run)"
    )
    parser.add_argument("--resnet-width", type=int, default=16)
    parser.add_argument("--resnet-n", type=int, default=2048, help="synthetic samples")
    # 5: every system converges on the synthetic set (2 left them mid-way, where one run's
    # final accuracy swung by 20 points and said nothing of the modes; docs/operations.md).
    parser.add_argument("--resnet-epochs", type=int, default=5, help="0: no resnet18 case")
    parser.add_argument("--resnet-target", type=float, default=0.9)
    parser.add_argument("--quick", action="store_true", help="1 small_cnn epoch, no resnet18")
    parser.add_argument(
        "--preprocessors", type=int, default=1, help="preprocessor processes of the stack"
    )
    parser.add_argument(
        "--max-lead-batches",
        type=int,
        help="the Conveyor jobs' flow.max_lead_batches (default: the job default)",
    )
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.resnet_epochs, args.target = 1, 0, 0.5
    cases = case_specs(args)
    params = {case: num_params(spec) for case, (spec, _) in cases.items()}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        found = run_baselines({case: spec for case, (spec, _) in cases.items()}, TRAINERS)
        for case, systems in found.items():
            for system, result in systems.items():
                measured = baseline_figures(result, cases[case][1], params[case], system)
                runs.setdefault((case, system), []).append(measured)
                ERR.log(f"repeat {repeat + 1} {case} {system}: {measured}")
        stack = ConveyorStack(
            preprocessors=args.preprocessors,
            env={},
            use_scale=scale_supported(),
            scale={"trainer": TRAINERS, "aggregator": SLICES},
        )
        stack.start()
        try:
            for case, (spec, target) in cases.items():
                jobs = [("sync", spec), ("local", local_spec(spec, args.window))]
                if args.overlap:
                    jobs.append(("local_overlap", local_spec(spec, args.window, args.overlap)))
                for system, job in jobs:
                    measured = run_job(stack, job, target, params[case])
                    runs.setdefault((case, system), []).append(measured)
                    ERR.log(f"repeat {repeat + 1} {case} {system}: {measured}")
        finally:
            stack.stop()
    keys = ("samples_per_s", "time_to_accuracy_s", "final_accuracy", "bytes_per_sample")
    figures = {
        case: {
            system: {key: median([r[key] for r in runs[(case, system)]]) for key in keys}
            for system in SYSTEMS
            if (case, system) in runs
        }
        for case in cases
    }
    for case, systems in figures.items():
        print(f"{case} (target accuracy {cases[case][1]}, {params[case]} parameters):")
        print(f"  {'system':8} {'samples/s':>10} {'t->acc s':>9} {'final acc':>9} {'B/sample':>10}")
        for system, f in systems.items():
            print(
                f"  {system:8} {_fmt(f['samples_per_s'], '.0f'):>10} "
                f"{_fmt(f['time_to_accuracy_s'], '.1f'):>9} {_fmt(f['final_accuracy'], '.3f'):>9} "
                f"{_fmt(f['bytes_per_sample'], '.0f'):>10}"
            )
    print(json.dumps(result_json(figures)))


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


if __name__ == "__main__":
    main()
