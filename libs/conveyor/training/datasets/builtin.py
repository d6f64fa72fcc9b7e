"""``builtin://<name>``: small real datasets that ship with installed packages.

``builtin://sklearn-digits`` is scikit-learn's 8x8 handwritten digits (1,797
images, 10 classes). Pixel values 0..16 are scaled to 0..255 (x * 255 / 16,
rounded) so every dataset speaks uint8.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from conveyor.training.datasets.base import Dataset, DatasetError, ImageBatch, LabelBatch, split_uri


def _digits_table() -> NDArray[np.float64]:
    """The digits as scikit-learn ships them: 1797 rows of 64 pixels then the label.

    Read straight from the package's data file when it is where scikit-learn keeps
    it: importing ``sklearn.datasets`` costs seconds per process, the file
    milliseconds. Falls back to ``load_digits`` if the layout ever changes.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None:
        raise DatasetError(
            "builtin://sklearn-digits needs scikit-learn, which is not installed (pip install "
            "'conveyor[digits]'); the service image leaves it out: pack the digits into the "
            "object store with `conveyor dataset pack` and train npz://s3://..."
        )
    if spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table: NDArray[np.float64] = np.loadtxt(path, delimiter=",", ndmin=2)
            return table
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target]).astype(np.float64)


@functools.cache
def _sklearn_digits() -> tuple[ImageBatch, LabelBatch]:
    """Load once per process; arrays are read-only so threads can share them."""
    table = _digits_table()  # [1797, 65]
    images = table[:, :64].reshape(-1, 8, 8)  # [N, 8, 8], values 0..16
    x = np.rint(images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]  # [N,1,8,8]
    y = table[:, 64].astype(np.int64)  # [N]
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


_BUILTINS = {"sklearn-digits": _sklearn_digits}


class InMemoryDataset(Dataset):
    """A dataset whose arrays are already in memory."""

    def __init__(self, uri: str, x: ImageBatch, y: LabelBatch, num_classes: int) -> None:
        shape = x.shape[1:]
        assert len(shape) == 3
        super().__init__(
            uri=uri,
            num_samples=int(x.shape[0]),
            sample_shape=(shape[0], shape[1], shape[2]),
            num_classes=num_classes,
        )
        self._x = x
        self._y = y

    def _read(self, ids: NDArray[np.int64]) -> tuple[ImageBatch, LabelBatch]:
        return self._x[ids], self._y[ids]


def open_builtin(uri: str) -> Dataset:
    """Open ``builtin://<name>``; DatasetError naming the known builtins otherwise."""
    _, name = split_uri(uri)
    loader = _BUILTINS.get(name)
    if loader is None:
        raise DatasetError(
            f"unknown builtin dataset {name!r} in {uri!r} (known: {', '.join(sorted(_BUILTINS))})"
        )
    x, y = loader()
    return InMemoryDataset(uri, x, y, num_classes=10)
