"""Image files through the real stack: the digits written as an image folder of PNG files, as
WebDataset shards and as Parquet (``examples/make_digits_datasets.py``, as a user runs it) train
with the shipped example specs to the accuracy of the same digits in npz shards, and bad image
files are skipped, counted and fail a job past ``dataset.max_bad_samples``.

How the accuracies are compared: every format holds the same pixels under the same sample ids
(checked in tests/unit/test_datasets_images.py's readers and by the script's construction), so
the jobs train on identical data; what could still differ between single runs is the order in
which batches reach the trainer. The stack here runs one preprocessor working on one task at a
time, one shards partition, one batches partition and one trainer, so batches arrive in release
order and the four runs see the same sequence: their eval accuracies agree to within 1 point
(measured: equal), where free arrival order spreads 2-epoch digits runs over several points
(see digits_spec in e2e_stack.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_stack import DIGITS_SAMPLES, RunningStack, conveyor, running_stack
from ledger_check import assert_exactly_once

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("imagefolder", "webdataset", "parquet")
IN_ORDER_ENV = {
    "CONVEYOR_PREPROCESSOR_CONCURRENCY": "1",
    "CONVEYOR_TOPOLOGY_SHARDS_PARTITIONS": "1",
    "CONVEYOR_TOPOLOGY_MIN_BATCHES_PARTITIONS": "1",
    "CONVEYOR_TOPOLOGY_BATCHES_PARTITIONS_PER_TRAINER": "1",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory `conveyor up` runs in (its default dataset root), with the data the
    examples read, written by the script the README names."""
    work = tmp_path_factory.mktemp("datasets")
    made = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_digits_datasets.py")],
        cwd=work, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return work


@pytest.fixture(scope="module")
def stack(workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    state_dir = tmp_path_factory.mktemp("datasets-stack") / "state"
    with running_stack(state_dir, env=IN_ORDER_ENV, cwd=workdir) as running:
        yield running


def example(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{kind}.yaml").read_text())
    spec["resources"] = {"device": "cpu", "threads": 1}  # the stack shares two cores
    return spec


def train(stack: RunningStack, spec: dict[str, Any]) -> dict[str, Any]:
    job = stack.wait_job(stack.submit(spec), timeout_s=240)
    assert job["state"] == "completed", job.get("reason")
    return job


def test_the_pack_command_writes_the_same_shards(stack: RunningStack, workdir: Path) -> None:
    packed = conveyor(
        "dataset", "pack", "data/digits/images", "data/digits/wds-cli", "--shard-size", "500",
        env=stack.env, cwd=workdir,
    )  # fmt: skip
    assert packed.returncode == 0, packed.stderr
    assert (
        packed.stdout.strip()
        == f"webdataset://{workdir}/data/digits/wds-cli/{{000000..000003}}.tar"
    )
    assert "packed 1797 images of 10 classes into 4 tar shard(s)" in packed.stderr
    manifest = (workdir / "data/digits/wds-cli/manifest.json").read_bytes()
    assert manifest == (workdir / "data/digits/wds/manifest.json").read_bytes()  # same sha256s


def test_image_files_train_to_the_npz_accuracy(stack: RunningStack) -> None:
    reference = example("imagefolder")
    reference["name"] = "digits-npz"
    reference["dataset"] = {**reference["dataset"], "uri": "npz://data/digits/npz"}
    accuracy = {"npz": train(stack, reference)["summary"]["eval_accuracy"]}
    for kind in KINDS:
        job = train(stack, example(kind))
        assert job["plan"]["num_train"] + job["plan"]["num_eval"] == DIGITS_SAMPLES
        assert_exactly_once(stack.ledger(job["id"]), stack.train_ids(job), epochs=2)
        accuracy[kind] = job["summary"]["eval_accuracy"]
    print(f"eval accuracy after 2 epochs: {accuracy}")
    assert accuracy["npz"] > 0.85, accuracy
    for kind in KINDS:
        assert abs(accuracy[kind] - accuracy["npz"]) <= 0.01, accuracy


def test_bad_images_are_skipped_and_fail_the_job_past_the_limit(
    stack: RunningStack, workdir: Path
) -> None:
    broken = workdir / "data" / "broken"
    shutil.copytree(workdir / "data/digits/images", broken)
    corrupted = sorted(broken.glob("*/*.png"))[::600][:3]  # three files of different classes
    for path in corrupted:
        path.write_bytes(path.read_bytes()[:30])  # a truncated PNG
    spec = example("imagefolder")
    spec["dataset"] = {**spec["dataset"], "uri": "imagefolder://data/broken", "max_bad_samples": 2}
    job = stack.wait_job(stack.submit({**spec, "name": "too-many-bad"}), timeout_s=240)
    assert job["state"] == "failed"
    assert "3 samples failed validation, more than dataset.max_bad_samples=2" in job["reason"]
    assert all(str(path) in job["reason"] for path in corrupted), job["reason"]
    spec["dataset"]["max_bad_samples"] = 3
    job = train(stack, {**spec, "name": "few-bad"})
    plan = job["plan"]
    bad_train = len(set(stack.train_ids(job)) & set(_ids_of(corrupted)))
    assert job["summary"]["samples"] == (plan["num_train"] - bad_train) * 2


def _ids_of(paths: list[Path]) -> list[int]:
    """Sample ids of image-folder files named by their index in the label-sorted digits."""
    return [int(path.stem) for path in paths]
