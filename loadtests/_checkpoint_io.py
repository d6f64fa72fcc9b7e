"""Part 2 of bench_checkpoint.py: a checkpoint's save and restore vs raw PUT and GET of the same
bytes on the same store (file, and S3 on a local moto server)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from conveyor.platform.storage import ObjectStore
from conveyor.training.checkpoint import (
    CheckpointStore,
    DataCursor,
    Manifest,
    SliceFile,
    SliceState,
)
from conveyor.training.checkpoint.slicefile import encode_slice
from loadtests._checkpoint_training import ERR

# -- part 2: save and restore vs raw put and get -------------------------------------------------


def slice_states(num_slices: int, numel: int, *, version: int = 1) -> list[SliceState]:
    """K slice states as an aggregator's snapshot holds them after Adam steps: fp32 values,
    exp_avg, exp_avg_sq (random: nothing compresses) and the scalar step."""
    generator = torch.Generator().manual_seed(version)
    return [
        SliceState(
            slice_index=index,
            version=version,
            values=torch.randn(numel, generator=generator),
            optimizer={
                "exp_avg": torch.randn(numel, generator=generator) * 1e-3,
                "exp_avg_sq": torch.rand(numel, generator=generator) * 1e-6,
                "step": torch.tensor(float(version)),
            },
            grads_offset=version * 10,
        )
        for index in range(num_slices)
    ]


def manifest_for(job_id: str, version: int, files: list[SliceFile]) -> Manifest:
    return Manifest(
        job_id=job_id, version=version, step=version, trigger="every_steps",
        created_at=time.time(), files=files, data_cursor=DataCursor(epoch=0), rng={"seed": 0},
        spec={}, model={"name": "bench", "num_params": 0},
    )  # fmt: skip


@dataclass
class IoRuns:
    """Seconds per repeat of each operation on one store, and the bytes each moves."""

    total_bytes: int = 0
    seconds: dict[str, list[float]] = field(
        default_factory=lambda: {"save": [], "raw_put": [], "restore": [], "raw_get": []}
    )

    commit_s: list[float] = field(default_factory=list)
    """Of each save, the commit."""
    encode_s: list[float] = field(default_factory=list)
    """encode_slice of every state, timed apart (the copy into the files' buffers that each
    write_slice makes before its put)."""

    def mb_per_s(self, operation: str) -> list[float]:
        return [self.total_bytes / s / 1e6 for s in self.seconds[operation] if s > 0]


@dataclass
class IoRound:
    """The four timed operations of one repeat: ``job_id``'s checkpoint and raw objects of the
    same sizes under ``bench-raw/<job_id>/`` in one store."""

    store: ObjectStore
    job_id: str
    states: list[SliceState]
    raw: list[bytes]
    commit_s: float = 0.0

    @property
    def raw_keys(self) -> list[str]:
        return [f"bench-raw/{self.job_id}/object-{i}" for i in range(len(self.raw))]

    def save(self) -> None:
        checkpoints = CheckpointStore(self.store, self.job_id)
        files = [checkpoints.write_slice(state) for state in self.states]
        started = time.perf_counter()
        checkpoints.commit(manifest_for(self.job_id, self.states[0].version, files))
        self.commit_s = time.perf_counter() - started

    def raw_put(self) -> None:
        for key, data in zip(self.raw_keys, self.raw, strict=True):
            self.store.put_bytes(key, data)

    def restore(self) -> None:
        manifest, loaded, _ = CheckpointStore(self.store, self.job_id).latest_good()
        assert manifest is not None and len(loaded) == len(self.states)

    def raw_get(self) -> None:
        # Held until all are read, as a restore holds every slice it loaded: a reader that
        # drops each object at once reuses its memory for the next and gets cheaper pages.
        objects = [self.store.get_bytes(key) for key in self.raw_keys]
        assert len(objects) == len(self.states)

    def clear(self) -> None:
        for key in [*self.store.list(f"checkpoints/{self.job_id}/"), *self.raw_keys]:
            self.store.delete(key)


def measure_io(store: ObjectStore, states: list[SliceState], repeats: int, runs: IoRuns) -> None:
    """Save and raw put, then restore and raw get, ``repeats`` times, each pair in alternating
    order, into ``store``; a repeat's objects are deleted after it."""
    sizes = [len(encode_slice("bench-io", state)) for state in states]
    runs.total_bytes = sum(sizes)
    # Random bytes, not zeros: a store (or a file system) must not get them cheaper.
    raw = [os.urandom(size) for size in sizes]
    for repeat in range(repeats):
        io = IoRound(store=store, job_id=f"bench-io-{repeat}", states=states, raw=raw)
        pairs: list[list[tuple[str, Callable[[], None]]]] = [
            [("save", io.save), ("raw_put", io.raw_put)],
            [("restore", io.restore), ("raw_get", io.raw_get)],
        ]
        for pair in pairs:
            for name, action in pair if repeat % 2 == 0 else pair[::-1]:
                started = time.perf_counter()
                action()
                runs.seconds[name].append(time.perf_counter() - started)
        runs.commit_s.append(io.commit_s)
        io.clear()
        started = time.perf_counter()
        encoded = [encode_slice(io.job_id, state) for state in states]
        runs.encode_s.append(time.perf_counter() - started)
        del encoded


@contextlib.contextmanager
def file_store() -> Iterator[ObjectStore]:
    """A ``file://`` store in a fresh temporary directory (removed afterwards)."""
    from conveyor.platform.storage import open_store

    directory = tempfile.mkdtemp(prefix="conveyor-bench-ckpt-")
    try:
        yield open_store(f"file://{directory}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def s3_store() -> Iterator[ObjectStore]:
    """An ``s3://`` store on a moto server started here (as tests/conftest.py starts it)."""
    from moto.server import ThreadedMotoServer

    from conveyor.embedded.broker import free_port
    from conveyor.platform.config import StorageSettings
    from conveyor.platform.storage import open_store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port("127.0.0.1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        settings = StorageSettings(
            uri="s3://bench-checkpoint", s3_endpoint=f"127.0.0.1:{port}",
            s3_access_key="testing", s3_secret_key="testing", s3_region="us-east-1",
        )  # fmt: skip
        yield open_store(settings.uri, settings)
    finally:
        server.stop()


STORES: dict[str, Callable[[], contextlib.AbstractContextManager[ObjectStore]]] = {
    "file": file_store,
    "s3": s3_store,
}


def run_io(args: argparse.Namespace) -> dict[str, IoRuns]:
    states = slice_states(args.slices, args.slice_params)
    found: dict[str, IoRuns] = {}
    for name in args.stores:
        runs = IoRuns()
        with STORES[name]() as store:
            measure_io(store, states, args.io_repeats, runs)
        found[name] = runs
        ERR.log(f"io {name}: " + ", ".join(
            f"{op} {statistics.median(runs.mb_per_s(op)):.0f} MB/s" for op in runs.seconds
        ))  # fmt: skip
    return found
