"""Checkpoint benchmark: training with periodic checkpoints vs without, and checkpoint save and
restore vs raw object-store PUT/GET of the same bytes, side by side.

Part 1, training throughput (``--parts training``). One real stack (``conveyor up --scale
trainer=2 --scale aggregator=2``: broker, gateway, sharder, preprocessor, 2 trainers,
2 aggregators, checkpointer; its object store is the embedded default, a local directory,
``file://``), jobs one after the other. Each repeat runs, per model case, the same job twice in
alternating order:
    every_n  ``checkpoint.every_steps: N`` (--every-steps, default 50 as examples/digits.yaml);
    none     ``checkpoint.every_steps`` unset.
"none" is not checkpoint-free: every epoch end and the job's end are always checkpointed (they
cannot be switched off), so both jobs take those; the difference is the every-N checkpoints,
which is what the figure isolates. Model cases:
    resnet18  resnet18 (width --resnet-width, default 32, group norm) on synthetic 3x32x32, Adam
              (values + exp_avg + exp_avg_sq: a 34 MB checkpoint at width 32, two slice files
              written by the two aggregators), global batch 16 (2 x 8), one epoch of
              --resnet-n samples (default 1344: 76 steps; the every-N checkpoint at step 50 is
              in the window, no epoch end is);
    digits    examples/digits.yaml (small_cnn, SGD momentum, 2 trainers, 2 slices, a 0.75 MB
              checkpoint: what is measured is the protocol's cost per checkpoint), its epochs
              raised by --digits-epochs (default 6: 138 steps, every-N checkpoints at 50 and
              100 in the window, epoch-end ones in both jobs).
The first case of --models is the headline (resnet18: its checkpoint is a realistic size), the
other one's keys are prefixed (``digits_...``).
Throughput: samples/s over a window after the warm-up (10% of the job's steps, at least 2),
measured as bench_aggregation measures steps: from the StepCloses the coordinator publishes on
the job's control topic (read while the job runs), samples applied / (closed_at of the last
step - closed_at of the last warm-up step). That is bench_pipeline's window (samples trained /
wall time after the warm-up, from the job's own reports) dated per step instead of by the
0.5 s progress events. The job's end checkpoint comes after the last step, outside the window,
in both jobs. The summary's whole-job samples_per_second (the trainers' own figure) is shown
beside it. Loss = 1 - every_n / none per repeat (both from the same repeat), median.
On a shared 2-core machine two runs of the same job differ by far more than 3.5%, so the paired
loss alone cannot resolve the target. Beside it, a within-job estimate that machine load
disturbs much less: for each every-N checkpoint of the every_n job, the time its next 3 steps
took beyond 3 median steps of the same window (the snapshot runs in the step, the write in the
background beside the next steps); estimated loss = the sum over the window / its length.

Part 2, save and restore (``--parts io``), in this process, no stack: K slice states (--slices,
default 3) of --slice-params fp32 parameters (default 2M: 24 MB files, multipart on S3) with
Adam's state (values, exp_avg, exp_avg_sq, step), as an aggregator's snapshot holds them.
    save     CheckpointStore.write_slice of each state + commit(manifest) (the checkpointer's
             check of each file, the manifest, the latest pointer);
    raw put  ObjectStore.put_bytes of K byte strings (random) of the encoded files' sizes;
    restore  CheckpointStore.latest_good() (listing, manifest, each file read with its sha256
             verified, decoded to tensors);
    raw get  ObjectStore.get_bytes of those K objects, all held until the last is read as a
             restore holds its slices (the store verifies their recorded sha256 too).
MB/s = encoded bytes / seconds; each repeat times both sides once, in alternating order, to
the same store; ratio = median over the repeats of ours / raw in the same repeat. Stores:
``file://`` (a temporary directory, as the embedded stack's) and a real HTTP S3 endpoint
(moto's ThreadedMotoServer, as the integration tests start it: in memory, in this process). The
headline is ``file://``: it is the embedded default and where part 1's checkpoints go; moto is
a Python server whose own cost dominates and says little about MinIO, so its figures are
extras (``s3_...``).

The last line printed is one JSON object:
    {"checkpoint_throughput_loss": resnet18 loss, "save_vs_raw_put": file save / raw put,
     "restore_vs_raw_get": file restore / raw get, "stall_share_estimate": ...,
     "digits_checkpoint_throughput_loss": ..., "s3_save_vs_raw_put": ...,
     "s3_restore_vs_raw_get": ..., ...samples/s, MB/s}
Targets (issue 13): throughput loss <= 0.035, save and restore >= 0.8 of raw.

    .venv/bin/python -m loadtests.bench_checkpoint              # 3 repeats, 14-16 minutes here
    .venv/bin/python -m loadtests.bench_checkpoint --quick      # smoke run, ~1 minute (20-40 s of
                                                                # it start the stack)
    .venv/bin/python -m loadtests.bench_checkpoint --parts io   # save/restore only, under a minute
"""

from __future__ import annotations

import argparse
import os
import time

from rich.console import Console

from loadtests._checkpoint_figures import (
    close_window,
    default_warmup,
    losses,
    ratios,
    result_json,
    stall_excess,
)
from loadtests._checkpoint_io import STORES, run_io, slice_states
from loadtests._checkpoint_report import footer, report_io, report_training
from loadtests._checkpoint_training import (
    ERR,
    IDLE_SETTLE_S,
    VARIANTS,
    Case,
    digits_spec,
    resnet_spec,
    run_job,
    run_training,
)

# The helpers tests/unit/test_bench_checkpoint.py reads from here, and bench_deterministic's
# ratios and run_job: they live in the private modules above.
__all__ = [
    "close_window",
    "default_warmup",
    "digits_spec",
    "losses",
    "main",
    "ratios",
    "resnet_spec",
    "result_json",
    "run_job",
    "slice_states",
    "stall_excess",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", default="training,io", help="any of training,io")
    parser.add_argument("--repeats", type=int, default=3, help="training repeats")
    parser.add_argument("--quick", action="store_true", help="1 repeat, digits, small sizes")
    parser.add_argument("--models", default="resnet18,digits",
                        help="any of resnet18,digits; the first is the headline")  # fmt: skip
    parser.add_argument("--every-steps", type=int, default=50, help="the demo's 50")
    parser.add_argument("--digits-epochs", type=int, default=6)
    parser.add_argument("--resnet-width", type=int, default=32)
    parser.add_argument(
        "--resnet-n", type=int, default=1344, help="synthetic samples (76 train steps)"
    )
    parser.add_argument("--stores", default="file,s3", help="any of file,s3; the first is "
                        "the headline")  # fmt: skip
    parser.add_argument("--slices", type=int, default=3)
    parser.add_argument("--slice-params", type=int, default=2_000_000)
    parser.add_argument("--io-repeats", type=int, default=9)
    args = parser.parse_args()
    args.settle_s = IDLE_SETTLE_S
    if args.quick:  # a smoke run of every code path; its figures mean nothing
        args.repeats, args.models, args.digits_epochs, args.every_steps = 1, "digits", 1, 10
        args.io_repeats, args.slice_params, args.settle_s = 2, 250_000, 0.0
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not parts or not parts <= {"training", "io"}:
        parser.error("--parts takes any of training, io")
    if not models or not set(models) <= {"resnet18", "digits"}:
        parser.error("--models takes any of resnet18, digits")
    if not args.stores or not set(args.stores) <= set(STORES):
        parser.error("--stores takes any of file, s3")
    counts = (args.repeats, args.every_steps, args.digits_epochs, args.resnet_width,
              args.resnet_n, args.slices, args.slice_params, args.io_repeats)  # fmt: skip
    if min(counts) < 1:
        parser.error("counts must be >= 1")

    cases = []
    for model in models:
        if model == "digits":
            specs = {v: digits_spec(epochs=args.digits_epochs,
                                    every_steps=args.every_steps if v == "every_n" else None)
                     for v in VARIANTS}  # fmt: skip
            description = f"examples/digits.yaml, {args.digits_epochs} epochs"
        else:
            specs = {v: resnet_spec(n=args.resnet_n, width=args.resnet_width,
                                    every_steps=args.every_steps if v == "every_n" else None)
                     for v in VARIANTS}  # fmt: skip
            description = (f"w{args.resnet_width} group norm, Adam, synthetic 3x32x32, "
                           f"n={args.resnet_n}, 1 epoch")  # fmt: skip
        cases.append(Case(model, description, specs))

    load = [os.getloadavg()[0]]
    began = time.monotonic()
    io = run_io(args) if "io" in parts else {}
    runs = run_training(args, cases, load) if "training" in parts else {}
    ERR.log(f"measured in {time.monotonic() - began:.0f} s")
    out = Console(width=max(160, Console().width))
    extras: dict[str, float | None] = {}
    if runs:
        extras.update(report_training(args, cases, runs, out))
    if io:
        extras.update(report_io(args, io, out))
    out.print(footer(args, load))
    print(result_json(extras, extras))


if __name__ == "__main__":
    main()
