"""The preprocessor's pure work: shard task -> Batch messages, and its process helpers."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from conveyor.platform.codec import decode, encode
from conveyor.platform.config import StorageSettings
from conveyor.platform.messages import Batch, ShardTask
from conveyor.services.preprocessor.busy_meter import BusyMeter
from conveyor.services.preprocessor.dataset_cache import DatasetCache
from conveyor.services.preprocessor.work import (
    augmenter_for,
    batch_ids,
    make_batches,
    process_shard,
    read_shard,
)
from conveyor.training.datasets import DatasetError, open_array_dataset, open_dataset

DIGITS = "builtin://sklearn-digits"
SYNTHETIC = "synthetic://?n=500&shape=3x16x16&classes=4&seed=1"


def make_task(**overrides: object) -> ShardTask:
    args: dict[str, object] = dict(
        job_id="job1", shard_id="job1:e2:train:00003", epoch=2, index=3, split="train",
        dataset_uri=DIGITS, sample_ids=[5, 900, 17, 1796, 0, 44, 123, 321, 77, 8],
        micro_batch_size=4, seed=11, preprocess={"augment": []}, released_at=1234.5,
    )  # fmt: skip
    args.update(overrides)
    return ShardTask(**args)  # type: ignore[arg-type]


def run(task: ShardTask) -> list[Batch]:
    dataset = open_dataset(task.dataset_uri)
    return process_shard(dataset, task, augmenter_for(task.preprocess)).batches


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """A batch's ``x`` or ``y`` as the preprocessors build it: a numpy array, typed as a tensor
    (see Batch)."""
    array = cast(object, tensor)
    assert type(array) is np.ndarray
    return array


def test_batches_ids_shapes_dtypes_and_labels() -> None:
    task = make_task()
    batches = run(task)
    assert [b.batch_id for b in batches] == [
        "job1:e2:train:00003:b000", "job1:e2:train:00003:b001", "job1:e2:train:00003:b002",
    ]  # fmt: skip
    assert batch_ids(task) == [b.batch_id for b in batches]
    assert [b.sample_ids for b in batches] == [[5, 900, 17, 1796], [0, 44, 123, 321], [77, 8]]
    x_all, y_all = open_array_dataset(DIGITS).read(task.sample_ids)
    for k, batch in enumerate(batches):
        rows = slice(4 * k, 4 * k + 4)
        # numpy: the preprocessors never load torch (the codec sends arrays as tensors).
        x, y = numpy_of(batch.x), numpy_of(batch.y)
        assert x.dtype == np.uint8 and y.dtype == np.int64
        assert list(x.shape) == [len(batch.sample_ids), 1, 8, 8]
        assert np.array_equal(x, x_all[rows])  # no augmentation: as read
        assert y.tolist() == y_all[rows].tolist()
        assert (batch.job_id, batch.shard_id, batch.epoch, batch.split) == (
            "job1", task.shard_id, 2, "train",
        )  # fmt: skip
        stamps = batch.timestamps
        assert stamps["released"] == 1234.5
        assert stamps["read_start"] <= stamps["read_end"] <= stamps["augment_end"]


def test_same_task_gives_identical_bytes_and_ids() -> None:
    task = make_task(
        dataset_uri=SYNTHETIC,
        sample_ids=list(range(40, 60)),
        micro_batch_size=8,
        preprocess={"augment": [{"name": "random_crop", "padding": 2}, {"name": "hflip"}]},
    )
    first, second = run(task), run(task)
    assert [b.batch_id for b in first] == [b.batch_id for b in second]
    for a, b in zip(first, second, strict=True):
        a.timestamps.clear()
        b.timestamps.clear()
        assert encode(a) == encode(b)
    round_trip = decode(encode(first[0]))
    assert isinstance(round_trip, Batch) and isinstance(round_trip.x, torch.Tensor)
    assert np.array_equal(round_trip.x.numpy(), first[0].x)


def test_augmentation_is_applied_and_keyed_by_epoch() -> None:
    augment = {"augment": [{"name": "random_crop", "padding": 3}, {"name": "hflip", "p": 0.5}]}
    plain = run(make_task(dataset_uri=SYNTHETIC, sample_ids=list(range(32)), micro_batch_size=32))
    task = make_task(
        dataset_uri=SYNTHETIC, sample_ids=list(range(32)), micro_batch_size=32, preprocess=augment
    )
    augmented = run(task)[0]
    assert augmented.x.shape == plain[0].x.shape
    changed = [not np.array_equal(a, b) for a, b in zip(augmented.x, plain[0].x, strict=True)]
    assert sum(changed) >= 16  # most samples are shifted or flipped
    other_epoch = run(make_task(
        dataset_uri=SYNTHETIC, sample_ids=list(range(32)), micro_batch_size=32,
        preprocess=augment, epoch=3,
    ))[0]  # fmt: skip
    assert not np.array_equal(other_epoch.x, augmented.x)
    assert np.array_equal(other_epoch.y, augmented.y)  # labels never change


def test_a_sample_is_augmented_the_same_in_any_shard() -> None:
    augment = {"augment": [{"name": "random_crop", "padding": 2}]}
    whole = run(make_task(dataset_uri=SYNTHETIC, sample_ids=[7, 8, 9], preprocess=augment))[0]
    alone = run(make_task(dataset_uri=SYNTHETIC, sample_ids=[9], preprocess=augment))[0]
    assert np.array_equal(whole.x[2], alone.x[0])


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        augmenter_for({"augment": [{"name": "rotate"}]})
    with pytest.raises(ValueError):
        augmenter_for({"augment": "hflip"})
    dataset = open_dataset(DIGITS)
    with pytest.raises(DatasetError, match="out of range"):
        read_shard(dataset, make_task(sample_ids=[1, 5000]))
    with pytest.raises(DatasetError, match="no samples"):
        read_shard(dataset, make_task(sample_ids=[]))


def test_released_timestamp_only_when_released() -> None:
    task = make_task(released_at=0.0)
    samples = read_shard(open_dataset(DIGITS), task)
    batches = make_batches(task, samples, augmenter_for({})).batches
    assert "released" not in batches[0].timestamps


def test_busy_meter_ratio() -> None:
    meter = BusyMeter(window_s=10.0, slots=2)
    start = meter._created
    assert meter.ratio(now=start + 1.0) == 0.0
    meter._done.append((start + 1.0, start + 3.0))  # one slot busy for 2 s
    assert meter.ratio(now=start + 4.0) == pytest.approx(2.0 / (4.0 * 2))
    assert meter.ratio(now=start + 13.5) == 0.0  # out of the window
    with meter.busy():
        assert meter.ratio() >= 0.0
    assert len(meter._running) == 0 and len(meter._done) == 1


async def test_dataset_cache_reuses_and_evicts() -> None:
    cache = DatasetCache(storage=StorageSettings(), size=2, open_timeout_s=30)
    first = await cache.get(DIGITS)
    assert await cache.get(DIGITS) is first
    await cache.get(SYNTHETIC)
    await cache.get("synthetic://?n=10")
    assert len(cache) == 2
    assert await cache.get(DIGITS) is not first  # evicted, reopened
    with pytest.raises(DatasetError):
        await asyncio.wait_for(cache.get("npz:///does/not/exist"), 10)


# --- image files: decoding, sizing, bad samples ----------------------------------------------


def _image_folder(root: Path, count: int = 12) -> None:
    from conveyor.training.datasets.images import encode_png

    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"c{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (3, 10 + i, 14), dtype=np.uint8)
        (folder / f"{i:03d}.png").write_bytes(encode_png(pixels))


def test_image_files_are_decoded_sized_and_bit_identical_when_redone(tmp_path: Path) -> None:
    _image_folder(tmp_path)
    preprocess = {
        "image_size": [8, 6],
        "channels": 1,
        "augment": [{"name": "random_resized_crop"}, {"name": "hflip"},
                    {"name": "color_jitter", "brightness": 0.3}],
    }  # fmt: skip
    task = make_task(dataset_uri=f"imagefolder://{tmp_path}", sample_ids=[11, 0, 5, 7, 2],
                     micro_batch_size=2, preprocess=preprocess)  # fmt: skip
    first = run(task)
    assert [b.sample_ids for b in first] == [[11, 0], [5, 7], [2]]
    assert all(list(b.x.shape[1:]) == [1, 8, 6] and numpy_of(b.x).dtype == np.uint8 for b in first)
    assert [b.y.tolist() for b in first] == [[2, 0], [1, 1], [0]]
    # A redelivered task (another process, another time) sends the very same bytes.
    again = run(task)
    for a, b in zip(first, again, strict=True):
        a.timestamps.clear()
        b.timestamps.clear()
        assert encode(a) == encode(b)
    # Evaluation shards get the deterministic resize only: equal whatever the seed.
    evaluation_task = {"dataset_uri": task.dataset_uri, "sample_ids": [11, 0], "split": "eval",
                       "shard_id": "job1:e2:eval:00000", "preprocess": preprocess}  # fmt: skip
    evaluation = run(make_task(**evaluation_task))
    other_seed = run(make_task(**evaluation_task, seed=99))
    assert np.array_equal(evaluation[0].x, other_seed[0].x)


def test_bad_images_are_left_out_and_reported(tmp_path: Path) -> None:
    _image_folder(tmp_path)
    whole = (tmp_path / "c1" / "001.png").read_bytes()
    (tmp_path / "c1" / "001.png").write_bytes(whole[: len(whole) // 2])  # truncated
    (tmp_path / "c2" / "005.png").write_bytes(b"plain text")
    uri = f"imagefolder://{tmp_path}"
    dataset = open_dataset(uri)
    task = make_task(dataset_uri=uri, sample_ids=[0, 4, 1, 9, 6, 8], micro_batch_size=2,
                     preprocess={"image_size": [8, 8]})  # fmt: skip
    # Ids: c0 holds 000,003,006,009 (ids 0-3), c1 001,004,007,010 (4-7), c2 002,005,.. (8-11).
    output = process_shard(dataset, task, augmenter_for(task.preprocess))
    assert [b.sample_ids for b in output.batches] == [[0], [1], [6, 8]]
    assert [b.batch_id for b in output.batches] == batch_ids(task)
    assert [(b.sample_id, b.source) for b in output.bad] == [
        (4, f"file://{tmp_path}/c1/001.png"), (9, f"file://{tmp_path}/c2/005.png"),
    ]  # fmt: skip
    assert output.bad[0].reason.startswith("corrupt image")
    assert output.bad[1].reason == "not a JPEG/PNG image"
    # A micro-batch with no good sample left fails the shard with the reasons.
    lonely = make_task(dataset_uri=uri, sample_ids=[4, 0], micro_batch_size=1,
                       preprocess={"image_size": [8, 8]})  # fmt: skip
    with pytest.raises(DatasetError, match=r"every sample of micro-batch 0 is bad \(.*001\.png"):
        process_shard(dataset, lonely, augmenter_for(lonely.preprocess))


def test_token_sequences_become_inputs_and_next_token_targets(tmp_path: Path) -> None:
    np.arange(100, dtype="<u2").tofile(tmp_path / "t.bin")  # token i at position i
    uri = f"tokens://{tmp_path}/t.bin?block_size=8&vocab_size=100"
    task = make_task(dataset_uri=uri, sample_ids=[3, 0, 11, 5, 7], micro_batch_size=2)
    batches = run(task)
    assert [b.sample_ids for b in batches] == [[3, 0], [11, 5], [7]]
    first = batches[0]
    assert numpy_of(first.x).dtype == np.int32 and numpy_of(first.y).dtype == np.int64
    assert first.x.tolist() == [list(range(24, 32)), list(range(0, 8))]
    assert first.y.tolist() == [list(range(25, 33)), list(range(1, 9))]
    decoded = decode(encode(first))  # what the wire carries back
    assert isinstance(decoded, Batch) and torch.equal(decoded.y, torch.from_numpy(first.y))
    with pytest.raises(ValueError, match="y must be int64"):
        dataclasses.replace(first, y=first.y[:, :4])
