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
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from loadtests._bench_common import scale_supported
from loadtests._bench_figures import mib, pct
from loadtests._pipeline_baseline import TRAIN as TRAIN  # re-exported: test_bench_decode
from loadtests._pipeline_baseline import AugmentedImages as AugmentedImages  # re-exported
from loadtests._pipeline_baseline import baseline_main
from loadtests._pipeline_systems import digits_spec, run_baseline, run_conveyor, synthetic_spec
from loadtests._pipeline_systems import total_steps as total_steps  # re-exported: bench_decode

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
