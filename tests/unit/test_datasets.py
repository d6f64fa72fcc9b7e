"""Datasets: builtin digits, synthetic, npz (local), idx, packing and their failures."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conveyor.training.datasets import (
    DatasetError,
    NpzDataset,
    known_schemes,
    load_arrays,
    open_array_dataset,
    open_dataset,
    pack_npz,
    pack_source,
)


def _labelled_images(
    n: int, shape: tuple[int, ...] = (1, 4, 5), classes: int = 3
) -> tuple[np.ndarray, np.ndarray]:
    """Images whose pixels encode their index, so any mix-up shows."""
    x = (np.arange(n * int(np.prod(shape))) % 251).astype(np.uint8).reshape(n, *shape)
    y = (np.arange(n) % classes).astype(np.int64)
    return x, y


# --- builtin ------------------------------------------------------------------------------


def test_sklearn_digits_shape_count_and_scaling() -> None:
    ds = open_array_dataset("builtin://sklearn-digits")
    assert (ds.num_samples, ds.sample_shape, ds.num_classes) == (1797, (1, 8, 8), 10)
    x, y = ds.read(range(ds.num_samples))
    assert x.dtype == np.uint8 and x.shape == (1797, 1, 8, 8)
    assert y.dtype == np.int64 and set(y.tolist()) == set(range(10))
    assert int(x.max()) == 255 and int(x.min()) == 0
    from sklearn.datasets import load_digits

    raw = load_digits()  # the reference: every image and label as scikit-learn loads them
    np.testing.assert_array_equal(x[:, 0], np.rint(raw.images * 255 / 16).astype(np.uint8))
    np.testing.assert_array_equal(y, raw.target)


def test_sklearn_digits_without_scikit_learn_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from conveyor.training.datasets import builtin

    find_spec = importlib.util.find_spec

    def without_sklearn(name: str, *args: str | None) -> object:
        return None if name == "sklearn" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_sklearn)
    # The loader without its per-process cache (it may have loaded the digits already).
    uncached = builtin._sklearn_digits.__wrapped__
    monkeypatch.setattr(builtin, "_BUILTINS", {"sklearn-digits": uncached})
    with pytest.raises(DatasetError, match=r"pip install 'conveyor\[digits\]'.*dataset pack"):
        open_dataset("builtin://sklearn-digits")


def test_read_keeps_order_and_handles_empty_and_bad_ids() -> None:
    ds = open_array_dataset("builtin://sklearn-digits")
    x, y = ds.read([10, 3, 10])
    all_x, all_y = ds.read(range(11))
    np.testing.assert_array_equal(x, all_x[[10, 3, 10]])
    np.testing.assert_array_equal(y, all_y[[10, 3, 10]])
    ex, ey = ds.read([])
    assert ex.shape == (0, 1, 8, 8) and ey.shape == (0,)
    with pytest.raises(DatasetError, match="out of range"):
        ds.read([0, 1797])
    with pytest.raises(DatasetError, match="out of range"):
        ds.read([-1])


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("ftp://x", "unknown dataset scheme 'ftp'"),
        ("no-scheme-here", "has no scheme"),
        ("builtin://mnist", "unknown builtin dataset 'mnist'"),
        ("synthetic://?n=0", r"n=0 must be in \[1,"),
        ("synthetic://?shape=3x0x4", "shape height"),
        ("synthetic://?shape=abc", "CxHxW"),
        ("synthetic://?classes=ten", "not an integer"),
        ("synthetic://?colour=red", "unknown parameter 'colour'"),
        ("synthetic://?n=5&n=6", "given twice"),
        ("synthetic://?cost_ms=nan", "cost_ms=nan"),
        ("synthetic://somewhere?n=5", "only query parameters"),
        ("mnist-idx:///definitely/not/here", "not a readable directory"),
        ("npz:///definitely/not/here", "does not exist"),
        ("npz://gs://bucket/x", "only s3://, file:// or a local directory"),
    ],
)
def test_bad_uris_raise_clear_dataset_errors(uri: str, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        open_dataset(uri)


def test_known_schemes() -> None:
    assert known_schemes() == [
        "builtin", "imagefolder", "mnist-idx", "npz", "parquet", "synthetic", "tokens",
        "webdataset",
    ]  # fmt: skip


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_defaults_and_determinism_across_groupings() -> None:
    ds = open_array_dataset("synthetic://?n=300&seed=3")
    assert (ds.num_samples, ds.sample_shape, ds.num_classes) == (300, (3, 32, 32), 10)
    x_all, y_all = ds.read(range(300))
    x_mix, y_mix = ds.read([299, 7, 150, 7])
    np.testing.assert_array_equal(x_mix, x_all[[299, 7, 150, 7]])
    np.testing.assert_array_equal(y_mix, y_all[[299, 7, 150, 7]])
    again = open_array_dataset("synthetic://?seed=3&n=300")  # same parameters, another instance
    np.testing.assert_array_equal(again.read([42])[0], x_all[[42]])
    other = open_array_dataset("synthetic://?n=300&seed=4")
    assert not np.array_equal(other.read([42])[0], x_all[[42]])
    assert set(y_all.tolist()) == set(range(10))


def test_synthetic_is_learnable_by_nearest_class_mean() -> None:
    ds = open_array_dataset("synthetic://?n=2000&shape=3x16x16&classes=10&seed=11")
    x, y = ds.read(range(2000))
    flat = x.reshape(2000, -1).astype(np.float32)  # [N, 768]
    means = np.stack([flat[:1500][y[:1500] == k].mean(0) for k in range(10)])  # [10, 768]
    pred = ((flat[1500:, None] - means[None]) ** 2).sum(-1).argmin(1)  # [500]
    accuracy = float((pred == y[1500:]).mean())
    assert accuracy > 0.9
    # and the task is not trivial: samples of one class differ from each other
    same = flat[y == 0]
    assert float(np.abs(same[0] - same[1]).mean()) > 5


def test_synthetic_hw_shape_and_cost_ms_burns_cpu() -> None:
    ds = open_array_dataset("synthetic://?n=50&shape=8x8&classes=2&cost_ms=10")
    assert ds.sample_shape == (1, 8, 8) and ds.num_classes == 2
    start = time.thread_time()
    ds.read(range(10))
    cpu_s = time.thread_time() - start
    assert 0.05 <= cpu_s < 1.0  # asked for 10 x 10 ms of CPU


# --- npz (local) --------------------------------------------------------------------------


def test_pack_open_read_round_trip(tmp_path: Path) -> None:
    x, y = _labelled_images(23, shape=(2, 3, 4), classes=5)
    reported: list[tuple[int, int]] = []
    result = pack_npz(
        x, y, str(tmp_path / "ds"), shard_size=5, progress=lambda *p: reported.append(p)
    )
    assert reported == [(5, 23), (10, 23), (15, 23), (20, 23), (23, 23)]  # after each shard
    assert result.uri == f"npz://{tmp_path / 'ds'}"
    assert [s.num_samples for s in result.manifest.shards] == [5, 5, 5, 5, 3]
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["format"] == "conveyor-npz" and manifest["num_samples"] == 23
    assert manifest["sample_shape"] == [2, 3, 4] and manifest["num_classes"] == 5
    shard_bytes = (tmp_path / "ds" / "shard-00001.npz").read_bytes()
    assert manifest["shards"][1]["sha256"] == hashlib.sha256(shard_bytes).hexdigest()

    ds = open_array_dataset(result.uri)
    assert (ds.num_samples, ds.sample_shape, ds.num_classes) == (23, (2, 3, 4), 5)
    ids = [22, 0, 9, 10, 4, 5, 17]
    rx, ry = ds.read(ids)
    np.testing.assert_array_equal(rx, x[ids])
    np.testing.assert_array_equal(ry, y[ids])
    assert ry.dtype == np.int64
    full_x, _ = open_array_dataset(f"npz://file://{tmp_path / 'ds'}").read(range(23))
    np.testing.assert_array_equal(full_x, x)


def test_pack_hw_images_and_refuses_to_overwrite(tmp_path: Path) -> None:
    x, y = _labelled_images(10, shape=(4, 4))
    pack_npz(x, y, str(tmp_path), shard_size=3, num_classes=7)
    ds = open_array_dataset(f"npz://{tmp_path}")
    assert ds.sample_shape == (1, 4, 4) and ds.num_classes == 7
    np.testing.assert_array_equal(ds.read([9])[0][:, 0], x[[9]])
    with pytest.raises(ValueError, match="already holds a dataset"):
        pack_npz(x, y, str(tmp_path))
    pack_npz(x[:4], y[:4], f"npz://{tmp_path}", shard_size=3, overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        "shard-00000.npz",
        "shard-00001.npz",
    ]
    assert open_dataset(f"npz://{tmp_path}").num_samples == 4


@pytest.mark.parametrize(
    ("x", "y", "kwargs", "message"),
    [
        (np.zeros((3, 4, 4), np.float32), np.zeros(3, np.int64), {}, "must be uint8"),
        (np.zeros((3, 4), np.uint8), np.zeros(3, np.int64), {}, r"\[N,H,W\]"),
        (np.zeros((3, 4, 4), np.uint8), np.zeros(2, np.int64), {}, "3 samples but y has 2"),
        (np.zeros((3, 4, 4), np.uint8), np.array([0, 1, -1]), {}, "labels must be >= 0"),
        (np.zeros((3, 4, 4), np.uint8), np.array([0, 1, 5]), {"num_classes": 5}, "up to 5"),
        (np.zeros((3, 4, 4), np.uint8), np.zeros(3, np.int64), {"shard_size": 0}, "shard_size"),
    ],
)
def test_pack_rejects_bad_input(tmp_path: Path, x, y, kwargs, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        pack_npz(x, y, str(tmp_path), **kwargs)


def _write_raw_dataset(
    root: Path,
    shards: list[tuple[np.ndarray, np.ndarray]],
    *,
    sample_shape: list[int],
    num_classes: int,
) -> None:
    """A dataset written by 'another tool': plain files, no storage checksum records."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (x, y) in enumerate(shards):
        buffer = io.BytesIO()
        np.savez(buffer, x=x, y=y)
        (root / f"s{i}.npz").write_bytes(buffer.getvalue())
        entries.append(
            {
                "file": f"s{i}.npz",
                "num_samples": len(y),
                "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
            }
        )
    manifest = {
        "format": "conveyor-npz",
        "version": 1,
        "num_classes": num_classes,
        "num_samples": sum(len(y) for _, y in shards),
        "sample_shape": sample_shape,
        "shards": entries,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_foreign_dataset_with_3d_shards_and_int32_labels(tmp_path: Path) -> None:
    x = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    _write_raw_dataset(
        tmp_path,
        [(x, np.array([1, 0], np.int32)), (x, np.array([2, 2]))],
        sample_shape=[1, 3, 3],
        num_classes=3,
    )
    rx, ry = open_array_dataset(f"npz://{tmp_path}").read([3, 0])
    np.testing.assert_array_equal(rx[:, 0], x[[1, 0]])
    assert ry.tolist() == [2, 1] and ry.dtype == np.int64


def test_corrupt_shard_names_the_file(tmp_path: Path) -> None:
    x, y = _labelled_images(10)
    pack_npz(x, y, str(tmp_path), shard_size=5)
    ds = open_array_dataset(f"npz://{tmp_path}")
    shard = tmp_path / "shard-00001.npz"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"shard-00001\.npz is corrupt"):
        ds.read([7])
    np.testing.assert_array_equal(ds.read([1])[0], x[[1]])  # the intact shard still reads


def test_manifest_sha_mismatch_on_foreign_dataset(tmp_path: Path) -> None:
    x = np.zeros((2, 3, 3), np.uint8)
    _write_raw_dataset(tmp_path, [(x, np.array([0, 1]))], sample_shape=[1, 3, 3], num_classes=2)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"s0\.npz is corrupt"):
        open_dataset(f"npz://{tmp_path}")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(format="other"), "format must be 'conveyor-npz'"),
        (lambda m: m.update(version=2), "unsupported version 2"),
        (lambda m: m.pop("num_classes"), r"missing keys \['num_classes'\]"),
        (lambda m: m.update(extra=1), r"unknown keys \['extra'\]"),
        (lambda m: m.update(num_samples=99), "!= sum of shard sizes"),
        (lambda m: m.update(sample_shape=[3, 3]), "sample_shape must be 3 positive"),
        (lambda m: m.update(shards=[]), "shards must be a non-empty list"),
        (lambda m: m["shards"][0].update(file="../escape.npz"), r"shards\[0\]\.file"),
        (lambda m: m["shards"][0].update(sha256="xyz"), "64 lowercase hex"),
    ],
)
def test_bad_manifest(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    _write_raw_dataset(
        tmp_path,
        [(np.zeros((2, 3, 3), np.uint8), np.array([0, 1]))],
        sample_shape=[1, 3, 3],
        num_classes=2,
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    mutate(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=message):
        open_dataset(f"npz://{tmp_path}")


def test_missing_or_unparsable_manifest(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"manifest\.json not found"):
        open_dataset(f"npz://{tmp_path}")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        open_dataset(f"npz://{tmp_path}")


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        (np.zeros((2, 3, 4), np.uint8), np.array([0, 1]), r"x has shape \(2, 3, 4\)"),
        (np.zeros((2, 3, 3), np.float32), np.array([0, 1]), "dtype float32, expected uint8"),
        (np.zeros((2, 3, 3), np.uint8), np.array([0.0, 1.0]), "expected integer"),
        (np.zeros((2, 3, 3), np.uint8), np.array([0, 2]), r"labels span \[0, 2\]"),
    ],
)
def test_bad_shard_contents_fail_on_read(tmp_path: Path, x, y, message: str) -> None:  # type: ignore[no-untyped-def]
    good = (np.zeros((2, 3, 3), np.uint8), np.array([0, 1]))
    _write_raw_dataset(tmp_path, [good, (x, y)], sample_shape=[1, 3, 3], num_classes=2)
    ds = open_array_dataset(f"npz://{tmp_path}")  # the first shard is fine, so opening works
    with pytest.raises(DatasetError, match=message):
        ds.read([2])
    # ... and the same problem in the first shard fails at open
    _write_raw_dataset(tmp_path / "first", [(x, y)], sample_shape=[1, 3, 3], num_classes=2)
    with pytest.raises(DatasetError, match=message):
        open_dataset(f"npz://{tmp_path / 'first'}")


def test_npz_cache_is_bounded_and_concurrent_misses_load_once(tmp_path: Path) -> None:
    x, y = _labelled_images(40, shape=(1, 8, 8))
    pack_npz(x, y, str(tmp_path), shard_size=10)
    shard_bytes = 10 * 64 + 10 * 8

    def counting(ds: NpzDataset) -> list[int]:
        loads: list[int] = []
        original = ds._load

        def load(index: int):  # type: ignore[no-untyped-def]
            loads.append(index)
            time.sleep(0.05)  # widen the race window
            return original(index)

        ds._load = load  # type: ignore[method-assign]
        return loads

    # Opening loaded shard 0 already; a one-shard cache evicts it for shard 1 and back.
    small = NpzDataset(f"npz://{tmp_path}", max_cache_bytes=shard_bytes)
    loads = counting(small)
    for ids in ([0], [15], [1], [15]):
        small.read(ids)
    assert loads == [1, 0, 1]
    roomy = NpzDataset(f"npz://{tmp_path}", max_cache_bytes=2 * shard_bytes)
    loads = counting(roomy)
    for ids in ([0], [15], [1], [15]):
        roomy.read(ids)
    assert loads == [1]

    shared = NpzDataset(f"npz://{tmp_path}")
    loads = counting(shared)
    results: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: results.append(shared.read([35, 21])[0])) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(results) == 8 and all(np.array_equal(r, x[[35, 21]]) for r in results)
    assert sorted(loads) == [2, 3]  # 8 concurrent readers, each shard loaded once


# --- idx ----------------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    header = struct.pack(f">I{array.ndim}i", magic or (0x0800 | array.ndim), *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx(root: Path, images: np.ndarray, labels: np.ndarray, *, gz: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, array in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels)):
        data = _idx_bytes(array)
        if gz:
            (root / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (root / name).write_bytes(data)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    images = np.random.default_rng(0).integers(0, 256, (7, 5, 6), dtype=np.uint8)
    labels = np.array([0, 3, 1, 3, 2, 0, 1], np.uint8)
    _write_idx(tmp_path, images, labels, gz=gz)
    ds = open_array_dataset(f"mnist-idx://{tmp_path}")
    assert (ds.num_samples, ds.sample_shape, ds.num_classes) == (7, (1, 5, 6), 4)
    x, y = ds.read([6, 1, 3])
    np.testing.assert_array_equal(x[:, 0], images[[6, 1, 3]])
    assert y.tolist() == [1, 3, 3]


def test_idx_strict_headers(tmp_path: Path) -> None:
    images = np.zeros((3, 2, 2), np.uint8)
    labels = np.array([0, 1, 2], np.uint8)
    _write_idx(tmp_path / "magic", images, labels)
    (tmp_path / "magic" / "train-images-idx3-ubyte").write_bytes(_idx_bytes(images, 0x0C03))
    with pytest.raises(DatasetError, match="bad idx magic 0x00000c03, expected 0x00000803"):
        open_dataset(f"mnist-idx://{tmp_path / 'magic'}")

    _write_idx(tmp_path / "short", images, labels)
    path = tmp_path / "short" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DatasetError, match="file has 27 bytes, header promises 28"):
        open_dataset(f"mnist-idx://{tmp_path / 'short'}")

    _write_idx(tmp_path / "count", images, labels[:2])
    with pytest.raises(DatasetError, match="3 images but 2 labels"):
        open_dataset(f"mnist-idx://{tmp_path / 'count'}")

    _write_idx(tmp_path / "gz", images, labels, gz=True)
    gz_path = tmp_path / "gz" / "train-images-idx3-ubyte.gz"
    gz_path.write_bytes(gzip.compress(_idx_bytes(images) + b"junk"))
    ds = open_array_dataset(f"mnist-idx://{tmp_path / 'gz'}")  # gz sizes are checked on first read
    with pytest.raises(DatasetError, match="header promises 12"):
        ds.read([0])

    (tmp_path / "none").mkdir()
    with pytest.raises(DatasetError, match="no train-images-idx3-ubyte"):
        open_dataset(f"mnist-idx://{tmp_path / 'none'}")


# --- pack_source (the CLI's entry) --------------------------------------------------------


def test_pack_source_from_npz_npy_and_idx(tmp_path: Path) -> None:
    x, y = _labelled_images(12, shape=(3, 2, 2), classes=4)
    np.savez(tmp_path / "arrays.npz", x=x, y=y)
    result = pack_source(tmp_path / "arrays.npz", str(tmp_path / "a"), shard_size=5)
    np.testing.assert_array_equal(open_array_dataset(result.uri).read(range(12))[0], x)

    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    result = pack_source(tmp_path / "x.npy", str(tmp_path / "b"), labels_path=tmp_path / "y.npy")
    assert open_array_dataset(result.uri).read([11])[1].tolist() == [y[11]]

    images = np.arange(5 * 3 * 3, dtype=np.uint8).reshape(5, 3, 3)
    _write_idx(tmp_path / "idx", images, np.array([0, 1, 0, 1, 9], np.uint8), gz=True)
    result = pack_source(tmp_path / "idx", str(tmp_path / "c"), shard_size=2)
    ds = open_array_dataset(result.uri)
    assert (ds.num_samples, ds.num_classes, len(result.manifest.shards)) == (5, 10, 3)
    np.testing.assert_array_equal(ds.read([4])[0][0, 0], images[4])

    np.savez(tmp_path / "wrong.npz", images=x, labels=y)
    with pytest.raises(ValueError, match=r"lacks array\(s\) \['x', 'y'\]"):
        load_arrays(tmp_path / "wrong.npz")
    with pytest.raises(ValueError, match=r"give the labels \.npy too"):
        load_arrays(tmp_path / "x.npy")
    with pytest.raises(ValueError, match=r"expected a \.npz"):
        load_arrays(tmp_path / "manifest.txt")


def test_storage_failures_map_to_dataset_errors() -> None:
    from conveyor.platform.storage import StorageError, StorageUnavailable
    from conveyor.training.datasets import DatasetUnavailable
    from conveyor.training.datasets.location import read_object

    class FailingStore:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
            raise self.error

    unavailable = FailingStore(StorageUnavailable("timeout"))
    with pytest.raises(DatasetUnavailable, match=r"s3://b/p/k\.npz: storage unavailable") as info:
        read_object(unavailable, "s3://b/p", "k.npz")  # type: ignore[arg-type]
    assert info.value.retriable is True
    denied = FailingStore(StorageError("denied"))
    with pytest.raises(DatasetError, match=r"k\.npz cannot be read: denied") as fatal:
        read_object(denied, "s3://b/p", "k.npz")  # type: ignore[arg-type]
    assert fatal.value.retriable is False
