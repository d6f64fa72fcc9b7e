"""The benchmarks run as modules from the repository root, as the README shows them
(``python -m loadtests.bench_codec``), with no ``sys.path`` edits of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_codec_benchmark_runs_as_a_module_and_prints_its_ratio_last() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_codec", "--repeats", "3", "--sample-s", "0.001",
         "--sizes", "8x1x8x8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert headline["codec_vs_memcpy"] > 0


def test_no_loadtest_edits_sys_path() -> None:
    offenders = [
        path.name for path in (ROOT / "loadtests").glob("*.py") if "sys.path" in path.read_text()
    ]
    assert offenders == []


def test_the_checkpoint_benchmark_runs_as_a_module_and_prints_its_ratios_last(
    tmp_path: Path,
) -> None:
    # The save/restore part only, on a local directory (no stack, no S3 server): seconds.
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_checkpoint", "--parts", "io", "--stores", "file",
         "--slices", "2", "--slice-params", "1000", "--io-repeats", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert headline["save_vs_raw_put"] > 0 and headline["restore_vs_raw_get"] > 0
    assert headline["checkpoint_throughput_loss"] is None  # the training part did not run
    assert list(tmp_path.iterdir()) == []  # its store was removed
