"""A harder real-image task built from scikit-learn's 8x8 digits: distorted digits.

The digits set is too easy to show an accuracy gap between training modes (every mode ends
near 97%). This one keeps the real handwriting and makes it harder the way MNIST-style
benchmarks are hard:

- **held-out writers**: the eval samples are distortions of the last ``EVAL_WRITER_SHARE``
  of the 1,797 originals (the set is ordered by writer block), the train samples of the rest,
  so no eval image is a copy of a train image;
- each sample is one original upsampled to ``size`` x ``size`` (bilinear) under a random
  affine map (rotation +-20 degrees, scale 0.8-1.15, shear +-0.3, shift +-12% of the side),
  a smooth elastic displacement (Simard et al. 2003) and Gaussian pixel noise.

The distortion of sample ``i`` is drawn from ``seed`` alone, so a directory written twice is
the same bytes. The job's random train/eval split (:func:`conveyor.training.plan.split_ids`
with the job's seed and ``eval_fraction``) decides which sample ids are eval ids; the writer
puts held-out-writer images at exactly those ids, so write the set for the seed and
eval fraction of the job that trains on it.

    .venv/bin/python -m loadtests.distorted_digits DIR [--size 28] [--samples 10000]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from numpy.typing import NDArray
from torch.nn import functional as F

from conveyor.training.plan import split_ids

EVAL_WRITER_SHARE = 0.25
"""Share of the originals (the last ones: other writers) that only the eval split shows."""
NOISE_STD = 0.12
"""Gaussian pixel noise, in units of full intensity."""
ELASTIC_ALPHA = 0.06
"""Elastic displacement amplitude, in units of the half side (grid_sample coordinates)."""


def distorted_digits(
    num_samples: int, *, size: int, seed: int, eval_fraction: float
) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """(x uint8 [N, size, size], y int64 [N]); eval ids (as the job with ``seed`` and
    ``eval_fraction`` splits) hold held-out-writer images. ValueError for size < 8."""
    from sklearn.datasets import load_digits

    if size < 8:
        raise ValueError(f"size must be >= 8, got {size}")
    digits = load_digits()
    images = torch.from_numpy(digits.images / 16.0).float()  # [M, 8, 8] in [0, 1]
    labels = torch.from_numpy(digits.target.astype(np.int64))  # [M]
    first_eval = int(len(images) * (1 - EVAL_WRITER_SHARE))
    train_ids, eval_ids = split_ids(num_samples, eval_fraction, seed)
    rng = np.random.default_rng([seed, 8])
    source = np.empty(num_samples, dtype=np.int64)
    source[train_ids] = rng.integers(0, first_eval, train_ids.size)
    source[eval_ids] = rng.integers(first_eval, len(images), eval_ids.size)
    x = torch.empty(num_samples, size, size)
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, num_samples, 1024):
        chunk = torch.from_numpy(source[start : start + 1024])
        x[start : start + len(chunk)] = _distort(images[chunk], size, generator)
    pixels = (x.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).numpy()
    return pixels, labels[torch.from_numpy(source)].numpy()


def _distort(images: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """float [B, 8, 8] in [0, 1] -> float [B, size, size]: affine + elastic + noise."""
    batch = images.shape[0]

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(batch, generator=generator)

    angle = uniform(-math.pi / 9, math.pi / 9)
    scale = uniform(0.8, 1.15)
    shear = uniform(-0.3, 0.3)
    shift = torch.stack([uniform(-0.24, 0.24), uniform(-0.24, 0.24)], dim=1)  # [B, 2]
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack(
        [torch.stack([cos, -sin + shear * cos, shift[:, 0]], dim=1),
         torch.stack([sin, cos + shear * sin, shift[:, 1]], dim=1)],
        dim=1,
    )  # fmt: skip  # [B, 2, 3], output -> input coordinates
    grid = F.affine_grid(theta, [batch, 1, size, size], align_corners=False)  # [B, S, S, 2]
    # Elastic: white noise smoothed by upsampling a coarse field (a Gaussian blur's shape).
    coarse = torch.randn(batch, 2, 4, 4, generator=generator) * ELASTIC_ALPHA
    field = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    grid = grid + field.permute(0, 2, 3, 1)
    upsampled = F.grid_sample(
        images[:, None], grid, mode="bilinear", padding_mode="zeros", align_corners=False
    )[:, 0]  # [B, S, S]
    return upsampled + NOISE_STD * torch.randn(upsampled.shape, generator=generator)


def write_distorted_digits(
    dest: str,
    *,
    num_samples: int = 10_000,
    size: int = 28,
    seed: int = 0,
    eval_fraction: float = 0.2,
) -> str:
    """Write the set as npz shards under ``dest`` (overwriting); returns the ``npz://`` URI."""
    from conveyor.training.datasets.pack import pack_npz  # the storage clients: only to write

    x, y = distorted_digits(num_samples, size=size, seed=seed, eval_fraction=eval_fraction)
    return pack_npz(x, y, dest, shard_size=2048, num_classes=10, overwrite=True).uri


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    args = parser.parse_args()
    print(write_distorted_digits(
        args.dest, num_samples=args.samples, size=args.size, seed=args.seed,
        eval_fraction=args.eval_fraction,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
