"""`make run`'s path, as a user runs it: `conveyor run examples/digits.yaml --json` starts a stack
sized for the spec (2 trainers, 2 aggregators: one per parameter slice), trains the demo to
completion, stops the stack and prints the run summary (DESIGN section 7) as its last line. Then the
same demo with top-k 1% and error feedback: it still learns while moving >= 50x fewer gradient bytes
per step.

Accuracy bounds are set for ONE run: the eval split has 359 samples and the order in which
batches reach the trainers changes the steps, so single runs scatter around their mean. The
in-process reference of the algorithm over 48 seeds (loadtests/bench_aggregation.py): dense
0.944..0.992 (median 0.969, 44 of 48 >= 0.95), top-k 0.911..0.986 (median 0.964); the system
adds the arrival order (one dense run reached 0.928), so the bounds below sit well under those
minima: the test fails on a broken plane (~0.1..0.5), not on a seed. The
>= 95% median and the <= 1.5-point mean delta are measured by that benchmark.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
import yaml
from e2e_stack import DIGITS_SAMPLES, base_env, conveyor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DEMO = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
EPOCHS = 5
NUM_TRAIN = DIGITS_SAMPLES - int(DIGITS_SAMPLES * 0.2)
TRAIN_BATCHES = math.ceil(NUM_TRAIN / 32)


def run_spec(spec_path: Path, state_dir: Path) -> dict[str, Any]:
    """`conveyor run SPEC --json` in a fresh state dir: its exit code must be 0 and its last
    stdout line the summary object."""
    done = conveyor(
        "run", str(spec_path), "--state-dir", str(state_dir), "--json",
        env=base_env(), timeout_s=420,
    )  # fmt: skip
    assert done.returncode == 0, f"conveyor run failed ({done.returncode}):\n{done.stderr[-4000:]}"
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # Not a terminal: progress comes as log lines from the event stream, not a redrawn bar.
    logged = [
        line
        for line in done.stderr.splitlines()
        if line.startswith(f"job {summary['job_id']}: step")
    ]
    assert logged and "state=completed" in logged[-1] and "\r" not in done.stderr, done.stderr[
        -2000:
    ]
    return summary


def assert_demo_summary(summary: dict[str, Any]) -> None:
    assert summary["state"] == "completed", summary.get("reason")
    assert summary["epochs"] == EPOCHS
    assert summary["samples"] == NUM_TRAIN * EPOCHS
    # Every step holds the global batch (64: 2 of the 45 micro-batches of an epoch, whatever
    # the number of trainers: tests/unit/test_global_batch.py folds 1 to 4 of them) but each
    # epoch's last: the planned 23 steps an epoch. The batches are routed to the trainers as
    # their steps take them, so none is left holding batches the other waits for (a hash
    # routing took 25-27 steps an epoch, with partial ones). The routing follows the trainers'
    # partitions: a rebalance while a trainer joins late may cost a partial step, at most about
    # one an epoch (seen: 118 once in a quiet run), never the old 127-130.
    planned = EPOCHS * math.ceil(TRAIN_BATCHES / 2)
    assert planned == 115 and planned <= summary["steps"] <= planned + EPOCHS, summary["steps"]
    assert 0.0 <= summary["data_wait_ratio"] <= 1.0
    assert summary["samples_per_second"] > 0
    assert summary["eval_loss"] > 0
    checkpoint = urlparse(summary["checkpoint"])
    assert checkpoint.scheme == "file" and checkpoint.path.endswith("/model.safetensors")
    assert Path(unquote(checkpoint.path)).stat().st_size > 4 * 90_000  # fp32 small_cnn


def test_demo_trains_and_topk_keeps_up_with_50x_fewer_gradient_bytes(
    tmp_path: Path,
) -> None:
    dense = run_spec(DEMO, tmp_path / "dense")
    assert_demo_summary(dense)
    assert dense["eval_accuracy"] >= 0.90

    spec = yaml.safe_load(DEMO.read_text())
    assert spec["distribution"]["trainers"] == 2 and spec["distribution"]["aggregator_shards"] == 2
    spec["name"] = "digits-cnn-topk"
    spec["distribution"]["compression"] = {"kind": "topk", "ratio": 0.01, "error_feedback": True}
    topk_path = tmp_path / "digits-topk.yaml"
    topk_path.write_text(yaml.safe_dump(spec))
    topk = run_spec(topk_path, tmp_path / "topk")
    assert_demo_summary(topk)
    assert topk["eval_accuracy"] >= 0.85
    reduction = dense["grad_bytes_per_step"] / topk["grad_bytes_per_step"]
    assert reduction >= 50.0, f"top-k moved only {reduction:.1f}x fewer bytes per step"
