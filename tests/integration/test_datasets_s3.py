"""npz datasets on a real S3 endpoint (moto server): pack, open, read, and failures."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import open_store
from conveyor.training.datasets import DatasetError, open_dataset, pack_npz


@pytest.fixture
def storage(s3_server: dict[str, str]) -> StorageSettings:
    return StorageSettings(
        uri="s3://unused",
        s3_endpoint=s3_server["endpoint"],
        s3_access_key=s3_server["access_key"],
        s3_secret_key=s3_server["secret_key"],
        s3_region=s3_server["region"],
    )


def _arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(2).integers(0, 256, (n, 3, 6, 5), dtype=np.uint8)
    y = (np.arange(n) * 7 % 4).astype(np.int64)
    return x, y


def test_pack_open_read_round_trip_on_s3(s3_bucket: str, storage: StorageSettings) -> None:
    x, y = _arrays(50)
    result = pack_npz(x, y, f"s3://{s3_bucket}/sets/demo", shard_size=16, storage=storage)
    assert result.uri == f"npz://s3://{s3_bucket}/sets/demo"
    keys = open_store(f"s3://{s3_bucket}/sets/demo", storage).list()
    assert keys == ["manifest.json", *(f"shard-{i:05d}.npz" for i in range(4))]

    ds = open_dataset(result.uri, storage=storage)
    assert (ds.num_samples, ds.sample_shape, ds.num_classes) == (50, (3, 6, 5), 4)
    ids = [49, 0, 17, 16, 33, 5]
    rx, ry = ds.read(ids)
    np.testing.assert_array_equal(rx, x[ids])
    np.testing.assert_array_equal(ry, y[ids])

    outputs: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: outputs.append(ds.read(range(50))[0])) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(outputs) == 4 and all(np.array_equal(o, x) for o in outputs)


def test_replaced_shard_on_s3_is_reported_corrupt(s3_bucket: str, storage: StorageSettings) -> None:
    x, y = _arrays(20)
    pack_npz(x, y, f"s3://{s3_bucket}/d", shard_size=10, storage=storage)
    store = open_store(f"s3://{s3_bucket}/d", storage)
    store.put_bytes("shard-00001.npz", b"not the shard the manifest names")
    ds = open_dataset(f"npz://s3://{s3_bucket}/d", storage=storage)
    with pytest.raises(DatasetError, match=rf"s3://{s3_bucket}/d/shard-00001\.npz is corrupt"):
        ds.read([15])
    np.testing.assert_array_equal(ds.read([3])[0], x[[3]])


def test_missing_manifest_and_missing_settings(s3_bucket: str, storage: StorageSettings) -> None:
    with pytest.raises(DatasetError, match=rf"s3://{s3_bucket}/empty/manifest\.json not found"):
        open_dataset(f"npz://s3://{s3_bucket}/empty", storage=storage)
    with pytest.raises(DatasetError, match="s3_endpoint"):
        open_dataset(f"npz://s3://{s3_bucket}/empty")
