"""The report of bench_checkpoint.py: the tables of part 1 (throughput, stalls and losses per
case) and part 2 (save and restore vs raw put and get), and the footer."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtests._checkpoint_figures import losses, median, ratios
from loadtests._checkpoint_io import IoRuns
from loadtests._checkpoint_training import STALL_STEPS, TARGET_IO_RATIO, TARGET_LOSS, Case

# -- the report ----------------------------------------------------------------------------------


def spread(values: Sequence[float], fmt: str) -> str:
    """``median (min..max)``, or the value alone, or ``-``."""
    if not values:
        return "-"
    middle = format(statistics.median(values), fmt)
    return middle if len(values) == 1 else f"{middle} ({min(values):{fmt}}..{max(values):{fmt}})"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report_training(
    args: argparse.Namespace,
    cases: list[Case],
    runs: Mapping[str, Mapping[str, list[dict[str, Any]]]],
    out: Console,
) -> dict[str, float | None]:
    """Print one table per model case; returns ``{prefix}checkpoint_throughput_loss`` and the
    other figures (the first case unprefixed)."""
    found: dict[str, float | None] = {}
    for case in cases:
        prefix = "" if case is cases[0] else f"{case.name}_"
        figures = report_case(args, case, runs[case.name]["every_n"], runs[case.name]["none"], out)
        found.update({f"{prefix}{key}": value for key, value in figures.items()})
    return found


def _values(runs: list[dict[str, Any]], key: str) -> list[float | None]:
    return [run.get(key) for run in runs]


def report_case(
    args: argparse.Namespace,
    case: Case,
    every: list[dict[str, Any]],
    none: list[dict[str, Any]],
    out: Console,
) -> dict[str, float | None]:
    """Print the table of one model case (its every_n and none runs); returns its figures."""

    def both(key: str, fmt: str, scale: float = 1.0) -> tuple[str, str]:
        return (_num(_scaled(median(_values(every, key)), scale), fmt),
                _num(_scaled(median(_values(none, key)), scale), fmt))  # fmt: skip

    table = Table(title=f"{case.name}: {case.description}; medians of {args.repeats} repeat(s)")
    for column in ("", f"every_n: checkpoint every {args.every_steps} steps",
                   "none: epoch and job end only", "loss = 1 - every_n / none"):  # fmt: skip
        table.add_column(column, justify="left" if not column else "right")
    lost = losses(_values(every, "samples_per_second"), _values(none, "samples_per_second"))
    job_lost = losses(
        _values(every, "job_samples_per_second"), _values(none, "job_samples_per_second")
    )
    table.add_row("samples/s, after the warm-up (StepCloses)",
                  *both("samples_per_second", ".1f"), _percent_spread(lost))  # fmt: skip
    table.add_row("samples/s, whole job (trainers' summary)",
                  *both("job_samples_per_second", ".1f"), _percent_spread(job_lost))  # fmt: skip
    table.add_row("window: seconds", *both("window_s", ".1f"), "")
    table.add_row("window: steps", *both("window_steps", ".0f"), "")
    table.add_row("window: samples per step (partial steps lower it)",
                  *both("samples_per_step", ".1f"), "")  # fmt: skip
    table.add_row("checkpoints in the window (all triggers)",
                  *both("checkpoints_in_window", ".0f"), "")  # fmt: skip
    table.add_row("  of which every_steps", *both("every_steps_in_window", ".0f"), "")
    table.add_row("checkpoints committed, whole job", *both("commits", ".0f"), "")
    table.add_row("checkpoint size, MB", *both("checkpoint_bytes", ".2f", 1e-6), "")
    table.add_row("StepClose -> commit, s (median)", *both("commit_seconds", ".2f"), "")
    stall_ms = _scaled(median(_values(every, "stall_s")), 1000)
    stall_share = median(_values(every, "stall_share"))
    table.add_row(
        f"{STALL_STEPS} steps after an every_steps checkpoint: ms beyond {STALL_STEPS} median "
        "steps",
        _num(stall_ms, "+.0f"),
        "",
        f"{_num(_scaled(stall_share, 100), '+.1f')} % of the window (estimate)",
    )
    table.add_row("eval accuracy", *both("eval_accuracy", ".3f"), "")
    out.print(table)
    failures = sum(run["commit_failures"] for run in (*every, *none))
    if failures:
        out.print(f"[red]{case.name}: {failures} checkpoint(s) failed to commit[/red]")
    return {
        "checkpoint_throughput_loss": median(lost),
        "job_throughput_loss": median(job_lost),
        "stall_share_estimate": stall_share,
        "stall_ms_per_checkpoint": stall_ms,
        "samples_per_second_every_n": median(_values(every, "samples_per_second")),
        "samples_per_second_none": median(_values(none, "samples_per_second")),
        "checkpoint_bytes": median(_values(every, "checkpoint_bytes")),
    }


def _percent_spread(fractions: Sequence[float]) -> str:
    return spread([100 * f for f in fractions], "+.1f") + " %" if fractions else "-"


def report_io(args: argparse.Namespace, io: Mapping[str, IoRuns], out: Console) -> dict[str, Any]:
    """Print the save/restore table; returns the ratios and MB/s (the first store unprefixed)."""
    total = next(iter(io.values())).total_bytes if io else 0
    table = Table(
        title=f"Save and restore vs raw put/get, same bytes, same store: {args.slices} slices x "
        f"{args.slice_params:,} params, values + Adam state ({total / 1e6:.0f} MB), MB/s "
        f"medians of {args.io_repeats} repeat(s)"
    )
    columns = ("store", "save (write_slice + commit)", "raw put", "save / raw put",
               "save: commit, ms", "encode alone, ms", "restore (latest_good)", "raw get",
               "restore / raw get")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "store" else "right")
    found: dict[str, float | None] = {}
    for index, (name, runs) in enumerate(io.items()):
        save, put = runs.mb_per_s("save"), runs.mb_per_s("raw_put")
        restore, get = runs.mb_per_s("restore"), runs.mb_per_s("raw_get")
        table.add_row(
            f"{name}://" + (" (moto server, in memory)" if name == "s3" else " (temporary dir)"),
            spread(save, ".0f"), spread(put, ".0f"), spread(ratios(save, put), ".2f"),
            spread([1000 * t for t in runs.commit_s], ".0f"),
            spread([1000 * t for t in runs.encode_s], ".0f"),
            spread(restore, ".0f"), spread(get, ".0f"), spread(ratios(restore, get), ".2f"),
        )  # fmt: skip
        prefix = "" if index == 0 else f"{name}_"
        found[f"{prefix}save_vs_raw_put"] = median(ratios(save, put))
        found[f"{prefix}restore_vs_raw_get"] = median(ratios(restore, get))
        for operation in runs.seconds:
            found[f"{prefix}{operation}_mb_per_s"] = median(runs.mb_per_s(operation))
        found[f"{prefix}commit_ms"] = _scaled(median(runs.commit_s), 1000)
        found[f"{prefix}encode_ms"] = _scaled(median(runs.encode_s), 1000)
    out.print(table)
    return found


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def footer(args: argparse.Namespace, load: list[float]) -> str:
    cores = os.cpu_count() or 1
    return (
        f"Machine: {cores} CPU core(s), torch threads 1 per training process; 1-minute load "
        f"average {min(load):.1f}..{max(load):.1f} (shared with other work: compare ratios).\n"
        "Training: one stack (broker + gateway + sharder + preprocessor + 2 trainers + "
        "2 aggregators + checkpointer) for every job, jobs one after the other; checkpoints go "
        "to its file:// store. 'none' still checkpoints every epoch end and the job's end "
        "(always on); checkpoints in window counts the checkpointed StepCloses between the "
        "warm-up's last step and the last step. The loss pairs two jobs of one repeat: other "
        "load on the machine moves it by more than the target; the stall estimate compares "
        f"steps within one job (the {STALL_STEPS} steps after each every_steps checkpoint "
        "against the window's median step).\n"
        "Save/restore: in this process, one thread, each repeat times ours and raw once in "
        "alternating order; raw objects are random bytes of the encoded files' sizes. Within "
        "save: the commit (stat each file, write the manifest and latest.json, each durably); "
        "encode alone: encode_slice of every state timed apart, the one copy of the state into "
        "the files' buffers that save makes and raw put does not.\n"
        f"Targets (issue 13): throughput loss <= {TARGET_LOSS:.1%}, save and restore >= "
        f"{TARGET_IO_RATIO:g} of raw."
    )
