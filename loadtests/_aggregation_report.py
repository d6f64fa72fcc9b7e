"""The report of bench_aggregation.py: the tables of step times, hops, bytes and accuracy per
job, the JSON line, and the top-k investigation's table."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from loadtests._aggregation_figures import (
    accuracy_deltas,
    max_topk_reduction,
    median,
    ratio,
    result_json,
)
from loadtests._aggregation_runs import (
    SLICES,
    STEP_PARTS,
    TARGET_DELTA_POINTS,
    TARGET_REDUCTION,
    TOPK_RATIO,
    TRAINERS,
    Runs,
)
from loadtests.ddp_baseline import Case
from loadtests.plane_hops import HOPS
from loadtests.topk_reference import REFERENCE_SEEDS


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
