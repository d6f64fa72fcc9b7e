"""``mnist-idx://<dir>``: the classic IDX files of MNIST-like datasets in a local directory.

Reads ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte`` (also the
``train-images.idx3-ubyte`` spelling), each optionally gzipped (``.gz``).
Headers are parsed strictly: magic ``00 00 08 <ndim>`` (unsigned bytes),
big-endian int32 dims, exact file sizes, matching counts. Opening reads the
headers and the (small) labels; uncompressed images are memory-mapped, gzipped
ones are decompressed once on the first read. ``num_classes`` is max label + 1.
"""

from __future__ import annotations

import gzip
import io
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from conveyor.training.datasets.base import Dataset, DatasetError, ImageBatch, LabelBatch, split_uri

IMAGES_NAMES = ("train-images-idx3-ubyte", "train-images.idx3-ubyte")
LABELS_NAMES = ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte")
UBYTE = 0x08
IMAGES_MAGIC = 0x00000803
"""Magic number of an idx file of unsigned bytes with 3 dims (images)."""
LABELS_MAGIC = 0x00000801
"""Magic number of an idx file of unsigned bytes with 1 dim (labels)."""


@dataclass(slots=True, frozen=True)
class IdxHeader:
    """A parsed idx header."""

    path: Path
    dims: tuple[int, ...]
    header_bytes: int

    @property
    def data_bytes(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))


def _open(path: Path) -> io.BufferedIOBase:
    return gzip.GzipFile(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_header(path: Path, ndim: int) -> IdxHeader:
    """Parse the header of ``path``, which must hold unsigned bytes with ``ndim`` dims."""
    try:
        with _open(path) as f:
            head = f.read(4 + 4 * ndim)
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot read idx header: {exc}") from exc
    if len(head) < 4 + 4 * ndim:
        raise DatasetError(f"{path}: truncated idx header ({len(head)} bytes)")
    magic = struct.unpack(">I", head[:4])[0]
    expected = (UBYTE << 8) | ndim
    if magic != expected:
        raise DatasetError(
            f"{path}: bad idx magic 0x{magic:08x}, expected 0x{expected:08x} "
            f"(unsigned bytes, {ndim} dims)"
        )
    dims = struct.unpack(f">{ndim}i", head[4:])
    if any(d <= 0 for d in dims):
        raise DatasetError(f"{path}: idx dims {dims} must all be positive")
    header = IdxHeader(path=path, dims=dims, header_bytes=len(head))
    if path.suffix != ".gz":
        size = path.stat().st_size
        if size != header.header_bytes + header.data_bytes:
            raise DatasetError(
                f"{path}: file has {size} bytes, header promises "
                f"{header.header_bytes + header.data_bytes} (dims {dims})"
            )
    return header


def read_payload(header: IdxHeader) -> NDArray[np.uint8]:
    """The whole data section as uint8 ``dims``; DatasetError if its length is wrong."""
    try:
        with _open(header.path) as f:
            f.read(header.header_bytes)
            data = f.read(header.data_bytes + 1)  # one extra byte exposes trailing junk
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{header.path}: cannot read idx data: {exc}") from exc
    if len(data) != header.data_bytes:
        raise DatasetError(
            f"{header.path}: idx data has {len(data)}{'+' if len(data) > header.data_bytes else ''}"
            f" bytes, header promises {header.data_bytes} (dims {header.dims})"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(header.dims)


def _find(directory: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise DatasetError(f"{directory}: no {names[0]} (or .gz) file found")


class IdxDataset(Dataset):
    """MNIST-style images ``(1, rows, cols)``; see the module docstring."""

    def __init__(self, uri: str) -> None:
        _, location = split_uri(uri)
        directory = Path(location.removeprefix("file://"))
        if not location or not directory.is_dir():
            raise DatasetError(f"{uri}: {str(directory)!r} is not a readable directory")
        self._images = read_header(_find(directory, IMAGES_NAMES), 3)
        labels_header = read_header(_find(directory, LABELS_NAMES), 1)
        count, rows, cols = self._images.dims
        if labels_header.dims[0] != count:
            raise DatasetError(f"{uri}: {count} images but {labels_header.dims[0]} labels")
        self._labels = read_payload(labels_header).astype(np.int64)  # [N]
        super().__init__(
            uri=uri,
            num_samples=count,
            sample_shape=(1, rows, cols),
            num_classes=int(self._labels.max()) + 1,
        )
        self._pixels: NDArray[np.uint8] | None = None  # [N,1,rows,cols], loaded lazily
        self._lock = threading.Lock()

    def _all_pixels(self) -> NDArray[np.uint8]:
        with self._lock:
            if self._pixels is None:
                count, rows, cols = self._images.dims
                if self._images.path.suffix == ".gz":
                    pixels = read_payload(self._images)
                else:
                    pixels = np.memmap(
                        self._images.path,
                        dtype=np.uint8,
                        mode="r",
                        offset=self._images.header_bytes,
                        shape=(count, rows, cols),
                    )
                self._pixels = pixels.reshape(count, 1, rows, cols)
            return self._pixels

    def _read(self, ids: NDArray[np.int64]) -> tuple[ImageBatch, LabelBatch]:
        return np.asarray(self._all_pixels()[ids]), self._labels[ids]
