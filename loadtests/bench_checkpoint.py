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
import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table

from conveyor.platform.storage import ObjectStore
from conveyor.training.checkpoint import (
    CheckpointStore,
    DataCursor,
    Manifest,
    SliceFile,
    SliceState,
)
from conveyor.training.checkpoint.slicefile import encode_slice
from loadtests._bench_common import ConveyorStack, JobWatcher, Progress, Window, window_after

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


# -- pure helpers (tests/unit/test_bench_checkpoint.py) -----------------------------------------


def default_warmup(total_steps: int) -> int:
    """Warm-up steps left out of a job's window: 10%, at least 2."""
    return max(2, total_steps // 10)


def close_window(closes: Sequence[tuple[int, float, int]], warmup_steps: int) -> Window | None:
    """Throughput window of a job from its StepCloses ``(version, closed_at, num_samples)``
    (any order): a step is a close that applied samples; from the close of the last warm-up
    step to the last close (:func:`~loadtests._bench_common.window_after`). None when the
    window holds no step."""
    points: list[Progress] = []
    steps = samples = 0
    for _, closed_at, num_samples in sorted(closes):
        if num_samples <= 0:
            continue  # only empty contributions: nothing changed
        steps += 1
        samples += num_samples
        points.append(Progress(at_s=closed_at, step=steps, samples=samples))
    return window_after(points, warmup_steps)


def stall_excess(
    steps: Sequence[tuple[int, float]], checkpointed: Iterable[int], after_steps: int
) -> list[float]:
    """Per checkpointed version, what the ``after_steps`` steps after it took beyond as many
    typical steps (seconds; negative: faster). ``steps``: (version, closed_at) of the steps of a
    window (any order); typical = the median time between two of them. Versions not in
    ``steps`` or too close to the end are left out."""
    ordered = sorted(steps)
    if len(ordered) < 2:
        return []
    typical = statistics.median(b[1] - a[1] for a, b in itertools.pairwise(ordered))
    position = {version: i for i, (version, _) in enumerate(ordered)}
    found = []
    for version in checkpointed:
        i = position.get(version)
        if i is not None and i + after_steps < len(ordered):
            found.append(ordered[i + after_steps][1] - ordered[i][1] - after_steps * typical)
    return found


def losses(
    with_checkpoints: Sequence[float | None], without: Sequence[float | None]
) -> list[float]:
    """Per repeat, the share of throughput lost: ``1 - with / without`` (pairs with a missing
    or zero figure are left out)."""
    return [
        1.0 - w / wo
        for w, wo in zip(with_checkpoints, without, strict=True)
        if w is not None and wo
    ]


def ratios(ours: Sequence[float], raw: Sequence[float]) -> list[float]:
    """Per repeat, ours / raw (MB/s; a zero raw figure is left out)."""
    return [o / r for o, r in zip(ours, raw, strict=True) if r > 0]


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None nor NaN (None when none is)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def result_json(headline: Mapping[str, float | None], extras: Mapping[str, float | None]) -> str:
    """The last line: the three headline keys first, then the extras, rounded to 4 places."""

    def rounded(value: float | None) -> float | None:
        return None if value is None or math.isnan(value) else round(value, 4)

    result = {key: rounded(headline.get(key)) for key in
              ("checkpoint_throughput_loss", "save_vs_raw_put", "restore_vs_raw_get")}  # fmt: skip
    result.update({key: rounded(value) for key, value in extras.items() if key not in result})
    return json.dumps(result)


# -- part 2: save and restore vs raw put and get -------------------------------------------------


def slice_states(num_slices: int, numel: int, *, version: int = 1) -> list[SliceState]:
    """K slice states as an aggregator's snapshot holds them after Adam steps: fp32 values,
    exp_avg, exp_avg_sq (random: nothing compresses) and the scalar step."""
    generator = torch.Generator().manual_seed(version)
    return [
        SliceState(
            slice_index=index,
            version=version,
            values=torch.randn(numel, generator=generator),
            optimizer={
                "exp_avg": torch.randn(numel, generator=generator) * 1e-3,
                "exp_avg_sq": torch.rand(numel, generator=generator) * 1e-6,
                "step": torch.tensor(float(version)),
            },
            grads_offset=version * 10,
        )
        for index in range(num_slices)
    ]


def manifest_for(job_id: str, version: int, files: list[SliceFile]) -> Manifest:
    return Manifest(
        job_id=job_id, version=version, step=version, trigger="every_steps",
        created_at=time.time(), files=files, data_cursor=DataCursor(epoch=0), rng={"seed": 0},
        spec={}, model={"name": "bench", "num_params": 0},
    )  # fmt: skip


@dataclass
class IoRuns:
    """Seconds per repeat of each operation on one store, and the bytes each moves."""

    total_bytes: int = 0
    seconds: dict[str, list[float]] = field(
        default_factory=lambda: {"save": [], "raw_put": [], "restore": [], "raw_get": []}
    )

    commit_s: list[float] = field(default_factory=list)
    """Of each save, the commit."""
    encode_s: list[float] = field(default_factory=list)
    """encode_slice of every state, timed apart (the copy into the files' buffers that each
    write_slice makes before its put)."""

    def mb_per_s(self, operation: str) -> list[float]:
        return [self.total_bytes / s / 1e6 for s in self.seconds[operation] if s > 0]


@dataclass
class IoRound:
    """The four timed operations of one repeat: ``job_id``'s checkpoint and raw objects of the
    same sizes under ``bench-raw/<job_id>/`` in one store."""

    store: ObjectStore
    job_id: str
    states: list[SliceState]
    raw: list[bytes]
    commit_s: float = 0.0

    @property
    def raw_keys(self) -> list[str]:
        return [f"bench-raw/{self.job_id}/object-{i}" for i in range(len(self.raw))]

    def save(self) -> None:
        checkpoints = CheckpointStore(self.store, self.job_id)
        files = [checkpoints.write_slice(state) for state in self.states]
        started = time.perf_counter()
        checkpoints.commit(manifest_for(self.job_id, self.states[0].version, files))
        self.commit_s = time.perf_counter() - started

    def raw_put(self) -> None:
        for key, data in zip(self.raw_keys, self.raw, strict=True):
            self.store.put_bytes(key, data)

    def restore(self) -> None:
        manifest, loaded, _ = CheckpointStore(self.store, self.job_id).latest_good()
        assert manifest is not None and len(loaded) == len(self.states)

    def raw_get(self) -> None:
        # Held until all are read, as a restore holds every slice it loaded: a reader that
        # drops each object at once reuses its memory for the next and gets cheaper pages.
        objects = [self.store.get_bytes(key) for key in self.raw_keys]
        assert len(objects) == len(self.states)

    def clear(self) -> None:
        for key in [*self.store.list(f"checkpoints/{self.job_id}/"), *self.raw_keys]:
            self.store.delete(key)


def measure_io(store: ObjectStore, states: list[SliceState], repeats: int, runs: IoRuns) -> None:
    """Save and raw put, then restore and raw get, ``repeats`` times, each pair in alternating
    order, into ``store``; a repeat's objects are deleted after it."""
    sizes = [len(encode_slice("bench-io", state)) for state in states]
    runs.total_bytes = sum(sizes)
    # Random bytes, not zeros: a store (or a file system) must not get them cheaper.
    raw = [os.urandom(size) for size in sizes]
    for repeat in range(repeats):
        io = IoRound(store=store, job_id=f"bench-io-{repeat}", states=states, raw=raw)
        pairs: list[list[tuple[str, Callable[[], None]]]] = [
            [("save", io.save), ("raw_put", io.raw_put)],
            [("restore", io.restore), ("raw_get", io.raw_get)],
        ]
        for pair in pairs:
            for name, action in pair if repeat % 2 == 0 else pair[::-1]:
                started = time.perf_counter()
                action()
                runs.seconds[name].append(time.perf_counter() - started)
        runs.commit_s.append(io.commit_s)
        io.clear()
        started = time.perf_counter()
        encoded = [encode_slice(io.job_id, state) for state in states]
        runs.encode_s.append(time.perf_counter() - started)
        del encoded


@contextlib.contextmanager
def file_store() -> Iterator[ObjectStore]:
    """A ``file://`` store in a fresh temporary directory (removed afterwards)."""
    from conveyor.platform.storage import open_store

    directory = tempfile.mkdtemp(prefix="conveyor-bench-ckpt-")
    try:
        yield open_store(f"file://{directory}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def s3_store() -> Iterator[ObjectStore]:
    """An ``s3://`` store on a moto server started here (as tests/conftest.py starts it)."""
    from moto.server import ThreadedMotoServer

    from conveyor.embedded.broker import free_port
    from conveyor.platform.config import StorageSettings
    from conveyor.platform.storage import open_store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port("127.0.0.1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        settings = StorageSettings(
            uri="s3://bench-checkpoint", s3_endpoint=f"127.0.0.1:{port}",
            s3_access_key="testing", s3_secret_key="testing", s3_region="us-east-1",
        )  # fmt: skip
        yield open_store(settings.uri, settings)
    finally:
        server.stop()


STORES: dict[str, Callable[[], contextlib.AbstractContextManager[ObjectStore]]] = {
    "file": file_store,
    "s3": s3_store,
}


def run_io(args: argparse.Namespace) -> dict[str, IoRuns]:
    states = slice_states(args.slices, args.slice_params)
    found: dict[str, IoRuns] = {}
    for name in args.stores:
        runs = IoRuns()
        with STORES[name]() as store:
            measure_io(store, states, args.io_repeats, runs)
        found[name] = runs
        ERR.log(f"io {name}: " + ", ".join(
            f"{op} {statistics.median(runs.mb_per_s(op)):.0f} MB/s" for op in runs.seconds
        ))  # fmt: skip
    return found


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
