"""Image files through the real stack: the digits written as an image folder of PNG files, as
WebDataset shards and as Parquet (``examples/make_digits_datasets.py``, as a user runs it) train
with the shipped example specs to the accuracy of the same digits in npz shards, bad image
files are skipped, counted and fail a job past ``dataset.max_bad_samples``, a BatchNorm
ResNet-18 trains on the image folder and its export evaluates to the accuracy it reported, and
the GPT example learns the standard library's bytes (``examples/gpt.yaml``).

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

import io
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from e2e_stack import DIGITS_SAMPLES, RunningStack, conveyor, metric_sum, running_stack, wait_for
from ledger_check import assert_exactly_once
from PIL import Image

from conveyor.training.datasets import open_dataset
from conveyor.training.datasets.base import EncodedDataset
from conveyor.training.exported import MODEL_FILES, load_model

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
    assert job["skipped_samples"] == 3  # the gateway's view of the samples_skipped events
    spec["dataset"]["max_bad_samples"] = 3
    job = train(stack, {**spec, "name": "few-bad"})
    plan = job["plan"]
    bad_train = len(set(stack.train_ids(job)) & set(_ids_of(corrupted)))
    assert job["summary"]["samples"] == (plan["num_train"] - bad_train) * 2
    assert job["skipped_samples"] == 3 and len(job["skipped_reasons"]) == 3
    assert all(any(str(path) in r for r in job["skipped_reasons"]) for path in corrupted)


def _ids_of(paths: list[Path]) -> list[int]:
    """Sample ids of image-folder files named by their index in the label-sorted digits."""
    return [int(path.stem) for path in paths]


def test_a_batch_norm_resnet_trains_and_its_export_evaluates_alike(
    stack: RunningStack, workdir: Path, tmp_path: Path
) -> None:
    """BatchNorm running statistics travel with the gradients (departure 28), averaged over two
    trainers at every step: the exported model, loaded outside Conveyor and fed the eval images
    decoded here with Pillow, scores exactly what the trainers measured; with untrained
    statistics (mean 0, var 1 in every layer) it would not."""
    spec = example("imagefolder")
    spec["name"] = "digits-resnet-bn"
    spec["model"] = {"name": "resnet18", "width": 8, "norm": "batch"}
    spec["distribution"] = {"trainers": 2, "aggregator_shards": 2}  # statistics in both slices
    second = stack.start_extra("trainer-bn", "trainer", stack.environ_of("trainer"))
    stack.wait_ready(second)

    def samples_trained() -> list[float]:  # by each trainer, in applied contributions
        return [metric_sum(stack.metrics(t), "conveyor_trainer_samples_total")
                for t in (stack.service("trainer"), second)]  # fmt: skip

    try:
        before = samples_trained()[0]  # the first trainer trained the module's earlier jobs
        job = train(stack, spec)
        expected = job["plan"]["num_train"] * job["summary"]["epochs"]

        def this_job() -> list[float] | None:
            first, other = samples_trained()
            counts = [first - before, other]
            return counts if sum(counts) == expected else None

        trained = wait_for(this_job, timeout_s=10, what=f"trained samples to add up to {expected}")
    finally:
        stack.stop_extra("trainer-bn")
    assert min(trained) > 0, trained  # both trainers' statistics went into the average
    reported = job["summary"]["eval_accuracy"]
    assert reported > 0.8, reported  # chance is 0.1
    export = tmp_path / "export"
    export.mkdir()
    for name in MODEL_FILES:
        (export / name).write_bytes(stack.store().get_bytes(f"jobs/{job['id']}/{name}"))
    model = load_model(export)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(
        m.running_var is not None and not torch.equal(m.running_var, torch.ones_like(m.running_var))
        for m in norms
    )
    dataset = open_dataset(f"imagefolder://{workdir}/data/digits/images")
    assert isinstance(dataset, EncodedDataset)
    eval_ids = np.array(sorted(set(range(DIGITS_SAMPLES)) - stack.train_ids(job)), np.int64)
    samples, bad = dataset.read_encoded(eval_ids)
    assert not bad and len(samples) == len(eval_ids) == job["plan"]["num_eval"]
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(s.data)).convert("L")) for s in samples])
    x = (torch.from_numpy(pixels)[:, None].float() / 255 - 0.5) / 0.5  # [N,1,8,8], normalize
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    labels = torch.tensor([s.label for s in samples])
    accuracy = (predicted == labels).float().mean().item()
    print(f"BatchNorm resnet18: reported {reported:.4f}, exported model {accuracy:.4f}")
    # the same samples right; one may flip where two logits tie within float rounding (the
    # trainers evaluate in batches of 32, here all at once)
    assert abs(accuracy - reported) <= 1 / len(eval_ids) + 1e-9


def test_the_gpt_example_learns_the_stdlib_bytes_below_their_unigram_entropy(
    stack: RunningStack, workdir: Path
) -> None:
    """Token batches (int ids, next-token targets) through the stack: after one epoch the
    eval loss per byte is well under what any model of byte frequencies alone can reach (the
    unigram entropy), by more than half a nat."""
    made = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_stdlib_tokens.py")],
        cwd=workdir, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    corpus = np.fromfile(workdir / "data/stdlib/bytes.bin", dtype="<u2")
    frequencies = np.bincount(corpus, minlength=256) / corpus.size
    seen = frequencies[frequencies > 0]
    unigram_entropy = float(-(seen * np.log(seen)).sum())  # nats per byte
    spec: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "gpt.yaml").read_text())
    spec["resources"] = {"device": "cpu", "threads": 1}
    job = train(stack, spec)
    summary = job["summary"]
    print(
        f"GPT on {corpus.size} stdlib bytes: eval loss {summary['eval_loss']:.3f} nats, "
        f"perplexity {summary['eval_perplexity']:.2f}, unigram entropy {unigram_entropy:.3f}"
    )
    # measured: 2.39 nats against 3.11 (perplexity 10.9 against 22.4 for byte frequencies)
    assert summary["eval_loss"] < unigram_entropy - 0.5
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert summary["eval_accuracy"] is None  # next tokens have a loss, not an accuracy
    assert_exactly_once(stack.ledger(job["id"]), stack.train_ids(job), epochs=1)
