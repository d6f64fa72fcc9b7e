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
import json
import os
import statistics
import time

from loadtests._aggregation_figures import (
    accuracy_deltas,
    default_warmup,
    max_topk_reduction,
    mean_contribution_bytes,
    median,
    ratio,
    result_json,
    step_bytes,
    step_window,
)
from loadtests._aggregation_report import job_names, print_investigation, report
from loadtests._aggregation_runs import (
    COMPRESSIONS,
    ERR,
    PlaneWatcher,
    Runs,
    digits_spec,
    measure,
    resnet_spec,
    with_overlap,
)
from loadtests._bench_common import scale_supported
from loadtests.ddp_baseline import Case
from loadtests.topk_reference import investigate

# The helpers tests/unit/test_bench_aggregation.py reads from here, and bench_time_to_accuracy's
# PlaneWatcher: they live in the private modules above.
__all__ = [
    "PlaneWatcher",
    "accuracy_deltas",
    "default_warmup",
    "digits_spec",
    "job_names",
    "main",
    "max_topk_reduction",
    "mean_contribution_bytes",
    "median",
    "ratio",
    "result_json",
    "step_bytes",
    "step_window",
    "with_overlap",
]


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
