"""``synthetic://?n=..&shape=CxHxW&classes=..&seed=..&cost_ms=..``: learnable generated images.

Each class has a smooth, low-frequency prototype image drawn from the seed.
Sample ``i`` draws its label, a small circular shift and uniform pixel noise
from its own counter-based generator keyed by ``(seed, i)``, so a sample is identical
whichever ids are read with it. ``cost_ms`` burns that much CPU per sample in
``read`` to emulate heavy decoding (JPEG, video), keeping the preprocessor tier
CPU-bound as in real pipelines.

Defaults: n=10000, shape=3x32x32, classes=10, seed=0, cost_ms=0.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from conveyor.training.datasets.base import (
    Dataset,
    DatasetError,
    ImageBatch,
    LabelBatch,
    burn_cpu,
    parse_query,
    split_uri,
)

MAX_SAMPLES = 2**40
MAX_CHANNELS = 64
MAX_SIDE = 4096
MAX_CLASSES = 100_000
MAX_PROTOTYPE_ELEMENTS = 64 * 2**20  # classes * C * H * W; keeps prototypes under 256 MiB
MAX_COST_MS = 10_000.0
NOISE_AMPLITUDE = 40.0
"""Per-pixel noise is uniform in [-A, A] uint8 levels (std ~23); cheaper to draw than normal."""


def _interp_matrix(size: int, grid: int) -> NDArray[np.float64]:
    """Linear interpolation weights ``[size, grid]`` that stretch ``grid`` points over ``size``."""
    positions = np.linspace(0.0, grid - 1.0, size)
    low = np.floor(positions).astype(np.int64).clip(0, grid - 1)
    high = (low + 1).clip(0, grid - 1)
    frac = positions - low
    weights = np.zeros((size, grid))
    weights[np.arange(size), low] += 1.0 - frac
    weights[np.arange(size), high] += frac
    return weights


def make_prototypes(seed: int, classes: int, shape: tuple[int, int, int]) -> NDArray[np.float32]:
    """Smooth class prototypes ``[classes, C, H, W]`` with values in 0..255."""
    c, h, w = shape
    grid_h, grid_w = max(2, h // 4), max(2, w // 4)
    rng = np.random.default_rng([seed, classes, c, h, w])
    coarse = rng.uniform(0.0, 255.0, size=(classes, c, grid_h, grid_w))  # [K,C,gh,gw]
    rows, cols = _interp_matrix(h, grid_h), _interp_matrix(w, grid_w)  # [H,gh], [W,gw]
    smooth: NDArray[np.float64] = np.einsum("hi,kcij,wj->kchw", rows, coarse, cols)  # [K,C,H,W]
    return smooth.astype(np.float32)


class SyntheticDataset(Dataset):
    """Deterministic class-structured images; see the module docstring."""

    def __init__(
        self,
        uri: str,
        *,
        n: int,
        shape: tuple[int, int, int],
        classes: int,
        seed: int,
        cost_ms: float,
    ) -> None:
        super().__init__(uri=uri, num_samples=n, sample_shape=shape, num_classes=classes)
        self.seed = seed
        self.cost_ms = cost_ms
        self._max_shift = min(shape[1], shape[2]) // 8
        prototypes = make_prototypes(seed, classes, shape)  # [K,C,H,W] float32
        # Wrap-padded once so a circular shift is a slice instead of np.roll (a copy).
        pad = ((0, 0), (0, 0), (self._max_shift,) * 2, (self._max_shift,) * 2)
        self._padded = np.pad(prototypes, pad, mode="wrap")  # [K,C,H+2s,W+2s]

    def sample(self, sample_id: int) -> tuple[NDArray[np.uint8], int]:
        """One sample: image uint8 ``[C,H,W]`` and its label."""
        # Philox is counter-based: keying by (seed, id) is cheap and gives independent streams.
        rng = np.random.Generator(np.random.Philox(key=[self.seed, sample_id]))
        label = int(rng.integers(self.num_classes))
        _, h, w = self.sample_shape
        dy, dx = rng.integers(0, 2 * self._max_shift + 1, size=2).tolist()
        image = self._padded[label, :, dy : dy + h, dx : dx + w]  # [C,H,W] view
        pixels = rng.random(image.shape, dtype=np.float32)  # [C,H,W] in [0, 1)
        pixels *= 2.0 * NOISE_AMPLITUDE
        pixels += image
        pixels -= NOISE_AMPLITUDE - 0.5  # +0.5 then truncation rounds to nearest
        np.clip(pixels, 0.0, 255.0, out=pixels)
        return pixels.astype(np.uint8), label

    def _read(self, ids: NDArray[np.int64]) -> tuple[ImageBatch, LabelBatch]:
        x = np.empty((ids.size, *self.sample_shape), dtype=np.uint8)  # [N,C,H,W]
        y = np.empty((ids.size,), dtype=np.int64)  # [N]
        for row, sample_id in enumerate(ids.tolist()):
            burn_cpu(self.cost_ms)
            x[row], y[row] = self.sample(sample_id)
        return x, y


def _int_param(uri: str, name: str, raw: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise DatasetError(f"{uri}: {name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise DatasetError(f"{uri}: {name}={value} must be in [{low}, {high}]")
    return value


def _shape_param(uri: str, raw: str) -> tuple[int, int, int]:
    parts = raw.lower().split("x")
    if len(parts) == 2:  # HxW means one channel
        parts = ["1", *parts]
    if len(parts) != 3:
        raise DatasetError(f"{uri}: shape={raw!r} must be CxHxW or HxW")
    c = _int_param(uri, "shape channels", parts[0], 1, MAX_CHANNELS)
    h = _int_param(uri, "shape height", parts[1], 1, MAX_SIDE)
    w = _int_param(uri, "shape width", parts[2], 1, MAX_SIDE)
    return c, h, w


def open_synthetic(uri: str) -> SyntheticDataset:
    """Open ``synthetic://?...``; DatasetError on unknown or out-of-range parameters."""
    _, rest = split_uri(uri)
    path, _, query = rest.partition("?")
    if path.strip("/"):
        raise DatasetError(f"{uri}: synthetic takes only query parameters, got path {path!r}")
    params = parse_query(uri, query, ("n", "shape", "classes", "seed", "cost_ms"))
    n = _int_param(uri, "n", params.get("n", "10000"), 1, MAX_SAMPLES)
    shape = _shape_param(uri, params.get("shape", "3x32x32"))
    classes = _int_param(uri, "classes", params.get("classes", "10"), 1, MAX_CLASSES)
    seed = _int_param(uri, "seed", params.get("seed", "0"), 0, 2**63 - 1)
    raw_cost = params.get("cost_ms", "0")
    try:
        cost_ms = float(raw_cost)
    except ValueError:
        raise DatasetError(f"{uri}: cost_ms={raw_cost!r} is not a number") from None
    if not 0.0 <= cost_ms <= MAX_COST_MS:  # also rejects nan
        raise DatasetError(f"{uri}: cost_ms={cost_ms} must be in [0, {MAX_COST_MS}]")
    if classes * shape[0] * shape[1] * shape[2] > MAX_PROTOTYPE_ELEMENTS:
        raise DatasetError(f"{uri}: classes * C * H * W exceeds {MAX_PROTOTYPE_ELEMENTS}")
    return SyntheticDataset(uri, n=n, shape=shape, classes=classes, seed=seed, cost_ms=cost_ms)
