"""Decode benchmark: JPEG files decoded, random-resized-cropped and flipped, Conveyor against a
torch DataLoader with worker processes, side by side.

The benchmark writes an image folder (``imagefolder://``, one folder per class) of --images
JPEG files of 256 to 400 pixels a side (quality 90; each class a colour and a stripe direction
over noise, so the model has something to learn), then runs the job below on both systems with
the machinery of ``loadtests.bench_pipeline`` (same measurements, same alternating repeats):
    conveyor    a fresh ``conveyor up`` stack whose --preprocessors processes decode (Pillow),
                random-resized-crop to 64x64 and flip every image (``preprocess.image_size``
                [64, 64], augment ``random_resized_crop``, ``hflip``; evaluation batches get the
                deterministic resize), uint8 batches through the broker to one trainer;
    dataloader  one process whose DataLoader --workers decode and augment the same files with
                the same code and keys (seed, epoch, sample id), so both see the same pixels
                (a JPEG decoded at the DCT scale its crop needs); ``--baseline-decode full``
                decodes each file whole before cropping instead, as torchvision's
                RandomResizedCrop on a PIL image does (what a DataLoader user runs today).
The model is small_cnn [16, 32, 64] on 64x64x3 (a few ms of compute a micro-batch), so the
data path, not the model, is what is measured. On a machine of a few cores the two systems'
CPU needs are alike (decoding dominates): the ratio shows what Conveyor's broker, services and
gradient plane cost beside the same decoding work.

The last line printed is one JSON object,
{"decode_pipeline_vs_dataloader": r, "data_wait_ratio": w, "baseline_data_wait_ratio": b,
 "cpu_per_sample_vs_dataloader": c}.

    .venv/bin/python -m loadtests.bench_decode            # 3 repeats, 2048 images
    .venv/bin/python -m loadtests.bench_decode --quick    # 1 repeat, 768 images
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from rich.console import Console

from loadtests._bench_common import scale_supported
from loadtests.bench_pipeline import (
    Scenario,
    add_system_arguments,
    bench_scenario,
    footer,
    median_of,
    print_scenario,
    total_steps,
)

CLASSES = 8
SIDES_PX = (256, 400)


def write_jpeg_folder(root: Path, *, images: int, seed: int = 0) -> None:
    """``root/<class>/<index>.jpg``: ``images`` JPEGs spread over the classes, each of a
    random width and height in ``SIDES_PX``; class k is a tint and a stripe angle over noise."""
    rng = np.random.default_rng(seed)
    for index in range(images):
        label = index % CLASSES
        height, width = (int(v) for v in rng.integers(SIDES_PX[0], SIDES_PX[1] + 1, size=2))
        rows, cols = np.mgrid[0:height, 0:width]
        angle = np.pi * label / CLASSES
        stripes = np.sin((rows * np.cos(angle) + cols * np.sin(angle)) / 6.0)  # [H,W]
        tint = np.array([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256])
        noise = rng.normal(0.0, 30.0, size=(height, width, 3))
        pixels = 128 + 60 * stripes[..., None] + 0.3 * (tint - 128) + noise  # [H,W,3]
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        image.save(folder / f"{index:06d}.jpg", quality=90)


def decode_spec(
    root: Path, *, epochs: int, threads: int, max_lead_batches: int | None = None
) -> dict[str, Any]:
    """The benchmark's job on the folder at ``root``."""
    from conveyor.training.jobspec import JobSpec

    return JobSpec.from_dict(
        {
            "name": "bench-decode",
            "model": {"name": "small_cnn", "channels": [16, 32, 64]},
            "dataset": {"uri": f"imagefolder://{root}", "eval_fraction": 0.1},
            "preprocess": {
                "image_size": [64, 64],
                "channels": 3,
                "normalize": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
                "augment": [
                    {"name": "random_resized_crop", "scale": [0.35, 1.0]},
                    {"name": "hflip", "p": 0.5},
                ],
            },
            "training": {
                "epochs": epochs,
                "global_batch_size": 128,
                "micro_batch_size": 32,
                "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                "seed": 1,
            },
            "distribution": {"trainers": 1, "aggregator_shards": 1},
            "resources": {"device": "auto", "threads": threads},
            "flow": {"max_lead_batches": max_lead_batches},  # None: the job default
        }
    ).to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer images")
    parser.add_argument("--images", type=int, default=2048, help="JPEG files written")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--max-lead-batches",
        type=int,
        help="the job's flow.max_lead_batches (default: sized by "
        "the batch's bytes, as for any job)",
    )
    add_system_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.images = 1, 768
    if args.preprocessors is None:
        args.preprocessors = args.workers
    if min(args.repeats, args.images, args.epochs, args.threads) < 1:
        parser.error("counts must be >= 1")

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        root = Path(tmp) / "jpegs"
        write_jpeg_folder(root, images=args.images)
        megabytes = sum(p.stat().st_size for p in root.rglob("*.jpg")) / 2**20
        spec = decode_spec(
            root, epochs=args.epochs, threads=args.threads, max_lead_batches=args.max_lead_batches
        )
        warmup = args.warmup_steps
        if warmup is None:
            warmup = max(2, total_steps(spec) // 10)
        description = (
            f"{args.images} JPEGs ({megabytes:.0f} MiB, {SIDES_PX[0]}-{SIDES_PX[1]} px) -> "
            f"random_resized_crop 64x64 + hflip, small_cnn, {args.epochs} epochs"
        )
        scenario = Scenario(
            "decode", description, spec, warmup,
            env={"CONVEYOR_STORAGE_DATASET_ROOTS": json.dumps([str(root)])},
        )  # fmt: skip
        use_scale = scale_supported()
        load = [os.getloadavg()[0]]
        bench_scenario(scenario, args, use_scale, load)
    print_scenario(scenario, args)
    Console().print(footer(args, use_scale, load))

    ratios, cpu_ratios = scenario.ratios(), scenario.cpu_ratios()
    result: dict[str, float | None] = {
        "decode_pipeline_vs_dataloader": round(statistics.median(ratios), 4) if ratios else None,
        "data_wait_ratio": _rounded(median_of(scenario.runs["conveyor"], "data_wait_ratio")),
        "baseline_data_wait_ratio": _rounded(
            median_of(scenario.runs["dataloader"], "data_wait_ratio")
        ),
        "cpu_per_sample_vs_dataloader": (
            round(statistics.median(cpu_ratios), 4) if cpu_ratios else None
        ),
    }
    print(json.dumps(result))


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


if __name__ == "__main__":
    main()
