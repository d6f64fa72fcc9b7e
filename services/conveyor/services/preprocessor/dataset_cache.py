"""The preprocessor's open datasets, kept per process by URI (least recently used dropped)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets import AnyDataset, DatasetError, DatasetUnavailable, open_dataset
from conveyor.training.locations import LocationRefused, check_dataset_uri


class DatasetCache:
    """Open datasets by URI, least recently used dropped past ``size``.

    :meth:`get` opens in a worker thread, one open at a time (opens are rare: once per URI
    while it stays cached). Raises what ``open_dataset`` raises, :class:`DatasetError` for a
    dataset outside the roots ``storage`` allows (a shard task the sharder did not vet) and
    :class:`DatasetUnavailable` when an open takes longer than ``open_timeout_s``.
    """

    def __init__(self, *, storage: StorageSettings, size: int, open_timeout_s: float) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._storage = storage
        self._size = size
        self._open_timeout_s = open_timeout_s
        self._datasets: OrderedDict[str, AnyDataset] = OrderedDict()
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._datasets)

    async def get(self, uri: str) -> AnyDataset:
        """The dataset at ``uri``, opened once and cached."""
        async with self._lock:
            dataset = self._datasets.get(uri)
            if dataset is None:
                try:
                    async with asyncio.timeout(self._open_timeout_s):
                        dataset = await asyncio.to_thread(self._open, uri)
                except TimeoutError:
                    raise DatasetUnavailable(
                        f"{uri}: did not open within {self._open_timeout_s:g}s"
                    ) from None
                self._datasets[uri] = dataset
                while len(self._datasets) > self._size:
                    self._datasets.popitem(last=False)
            self._datasets.move_to_end(uri)
            return dataset

    def _open(self, uri: str) -> AnyDataset:
        try:
            check_dataset_uri(uri, self._storage)
        except LocationRefused as exc:
            raise DatasetError(str(exc)) from exc
        return open_dataset(uri, storage=self._storage)
