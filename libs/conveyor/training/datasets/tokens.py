"""``tokens://<file>?dtype=uint16&block_size=256&vocab_size=50304``: a flat array of token ids.

nanoGPT's ``.bin`` layout: the file is nothing but token ids, little-endian ``uint16`` or
``uint32`` (``dtype``), one after the other. Sample ``i`` is the ``block_size + 1`` tokens from
position ``i * block_size`` (inputs are its first ``block_size`` tokens, targets its last
``block_size``), so consecutive samples overlap by one token and every token but the first is a
target exactly once per epoch; ``num_samples = (num_tokens - 1) // block_size``.

Local, ``file://`` or ``s3://`` through the object store; opening reads the file's size only,
and each sample is one range read. A file that is not a whole number of tokens fails the open;
with ``vocab_size`` given, a token ``>= vocab_size`` fails the read naming the file and the
token's position.

A job trains a language model on it (``gpt``): the sharder plans it as samples of "shape"
``(1, 1, block_size)`` and ``num_classes = vocab_size``; the preprocessors send each batch's
inputs and next-token targets (:class:`~conveyor.platform.messages.Batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.base import DatasetError, parse_query, split_uri
from conveyor.training.datasets.location import open_file_location, read_range, stat_object

TOKEN_DTYPES: dict[str, np.dtype[np.unsignedinteger[Any]]] = {
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
MAX_BLOCK_SIZE = 1 << 20
MAX_VOCAB_SIZE = 1 << 31
"""Token ids travel as int32 on the batches topic."""


class TokenDataset:
    """Sequences of ``block_size + 1`` token ids; see the module docstring. Thread-safe."""

    def __init__(self, uri: str, *, storage: StorageSettings | None = None) -> None:
        _, rest = split_uri(uri)
        location, _, query = rest.partition("?")
        params = parse_query(uri, query, ("dtype", "block_size", "vocab_size"))
        dtype_name = params.get("dtype", "uint16")
        if dtype_name not in TOKEN_DTYPES:
            raise DatasetError(f"{uri}: dtype={dtype_name!r} must be one of {sorted(TOKEN_DTYPES)}")
        self.dtype = TOKEN_DTYPES[dtype_name]
        self.block_size = _positive(uri, "block_size", params.get("block_size", "256"))
        if self.block_size > MAX_BLOCK_SIZE:
            raise DatasetError(f"{uri}: block_size must be <= {MAX_BLOCK_SIZE}")
        vocab = params.get("vocab_size")
        self.vocab_size = None if vocab is None else _positive(uri, "vocab_size", vocab)
        if self.vocab_size is not None and self.vocab_size > MAX_VOCAB_SIZE:
            raise DatasetError(f"{uri}: vocab_size must be <= {MAX_VOCAB_SIZE}")
        self._store, self._key, self._where = open_file_location(uri, location, storage)
        size = stat_object(self._store, self._where, self._key)
        if size % self.dtype.itemsize:
            raise DatasetError(
                f"{self._where}/{self._key}: {size} bytes is not a whole number of "
                f"{dtype_name} tokens"
            )
        self.num_tokens = size // self.dtype.itemsize
        self.uri = uri
        self.sample_shape = (1, 1, self.block_size)
        """A sequence as the plan sees a sample: one channel, one row of ``block_size``."""
        self.num_samples = (self.num_tokens - 1) // self.block_size
        if self.num_samples < 1:
            raise DatasetError(
                f"{uri}: {self.num_tokens} tokens do not make one sequence of "
                f"block_size + 1 = {self.block_size + 1}"
            )

    @property
    def num_classes(self) -> int:
        """The vocabulary a model predicts over: ``vocab_size``, else every id the dtype holds
        for uint16 (65536). DatasetError for uint32 without ``vocab_size`` (2^32 outputs)."""
        if self.vocab_size is not None:
            return self.vocab_size
        if self.dtype.itemsize == 2:
            return 1 << 16
        raise DatasetError(f"{self.uri}: uint32 tokens need vocab_size=<n> to be trained on")

    def read(self, sample_ids: Sequence[int] | NDArray[np.integer]) -> NDArray[np.int64]:
        """Token ids int64 ``[N, block_size + 1]`` of ``sample_ids``, in that order.
        DatasetError for an id out of range or a token outside the vocabulary."""
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)  # [N]
        out = np.empty((ids.size, self.block_size + 1), dtype=np.int64)  # [N, T+1]
        span = (self.block_size + 1) * self.dtype.itemsize
        for row, sample_id in enumerate(ids.tolist()):
            if not 0 <= sample_id < self.num_samples:
                raise DatasetError(
                    f"{self.uri}: sample id {sample_id} out of range [0, {self.num_samples})"
                )
            offset = sample_id * self.block_size * self.dtype.itemsize
            data = read_range(self._store, self._where, self._key, offset, span)
            out[row] = np.frombuffer(data, dtype=self.dtype)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row, col = np.argwhere(out >= self.vocab_size)[0].tolist()
            position = int(ids[row]) * self.block_size + col
            raise DatasetError(
                f"{self._where}/{self._key}: token {int(out[row, col])} at position {position} "
                f"is outside the vocabulary (vocab_size={self.vocab_size})"
            )
        return out


def _positive(uri: str, name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise DatasetError(f"{uri}: {name}={raw!r} is not an integer") from None
    if value < 1:
        raise DatasetError(f"{uri}: {name} must be >= 1, got {value}")
    return value
