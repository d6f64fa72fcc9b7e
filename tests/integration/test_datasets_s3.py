"""npz datasets on a real S3 endpoint (moto server): pack, open, read, and failures."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import open_store
from conveyor.training.datasets import DatasetError, open_array_dataset, open_dataset, pack_npz


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

    ds = open_array_dataset(result.uri, storage=storage)
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
    ds = open_array_dataset(f"npz://s3://{s3_bucket}/d", storage=storage)
    with pytest.raises(DatasetError, match=rf"s3://{s3_bucket}/d/shard-00001\.npz is corrupt"):
        ds.read([15])
    np.testing.assert_array_equal(ds.read([3])[0], x[[3]])


def test_missing_manifest_and_missing_settings(s3_bucket: str, storage: StorageSettings) -> None:
    with pytest.raises(DatasetError, match=rf"s3://{s3_bucket}/empty/manifest\.json not found"):
        open_dataset(f"npz://s3://{s3_bucket}/empty", storage=storage)
    with pytest.raises(DatasetError, match="s3_endpoint"):
        open_dataset(f"npz://s3://{s3_bucket}/empty")


# --- image files in S3 ----------------------------------------------------------------------


def _png(seed: int, size: tuple[int, int] = (6, 7)) -> tuple[np.ndarray, bytes]:
    from conveyor.training.datasets.images import encode_png

    pixels = np.random.default_rng(seed).integers(0, 256, (3, *size), dtype=np.uint8)
    return pixels, encode_png(pixels)


def test_imagefolder_and_its_webdataset_pack_on_s3(
    s3_bucket: str, storage: StorageSettings
) -> None:
    from conveyor.training.datasets import EncodedDataset
    from conveyor.training.datasets.images import decode_image
    from conveyor.training.datasets.pack_webdataset import pack_imagefolder

    store = open_store(f"s3://{s3_bucket}/pets", storage)
    written = {}
    for i in range(7):
        pixels, data = _png(i, (5 + i, 8))
        key = f"{'cat' if i % 2 else 'dog'}/{i:02d}.png"
        store.put_bytes(key, data)
        written[key] = pixels
    store.put_bytes("cat/notes.txt", b"not an image")
    folder = open_dataset(f"imagefolder://s3://{s3_bucket}/pets", storage=storage)
    assert isinstance(folder, EncodedDataset)
    assert (folder.num_samples, folder.num_classes) == (7, 2)  # cat: 01 03 05, dog: 00 02 04 06
    good, bad = folder.read_encoded([3, 0])
    assert not bad and [(s.label, s.source) for s in good] == [
        (1, f"s3://{s3_bucket}/pets/dog/00.png"), (0, f"s3://{s3_bucket}/pets/cat/01.png"),
    ]  # fmt: skip
    np.testing.assert_array_equal(decode_image(good[0].data, channels=3), written["dog/00.png"])

    result = pack_imagefolder(
        f"imagefolder://s3://{s3_bucket}/pets", f"s3://{s3_bucket}/wds", shard_size=3,
        storage=storage,
    )  # fmt: skip
    assert result.uri == f"webdataset://s3://{s3_bucket}/wds/{{000000..000002}}.tar"
    assert open_store(f"s3://{s3_bucket}/wds", storage).list() == [
        "000000.tar", "000001.tar", "000002.tar", "manifest.json",
    ]  # fmt: skip
    packed = open_dataset(result.uri, storage=storage)
    assert isinstance(packed, EncodedDataset)
    ids = list(range(7))[::-1]
    assert [(s.label, s.data) for s in packed.read_encoded(ids)[0]] == [
        (s.label, s.data) for s in folder.read_encoded(ids)[0]
    ]
    # Without the manifest, the shards are indexed (in ranges) when opened.
    open_store(f"s3://{s3_bucket}/wds", storage).delete("manifest.json")
    indexed = open_dataset(result.uri, storage=storage)
    assert (indexed.num_samples, indexed.num_classes) == (7, 2)
    assert isinstance(indexed, EncodedDataset)
    assert indexed.read_encoded([6])[0][0].data == folder.read_encoded([6])[0][0].data


def test_parquet_and_tokens_on_s3(s3_bucket: str, storage: StorageSettings) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from conveyor.training.datasets import EncodedDataset, open_tokens

    images = [_png(i)[1] for i in range(9)]
    table = pa.table({"image": pa.array([{"bytes": b, "path": None} for b in images]),
                      "label": pa.array([i % 4 for i in range(9)], pa.int32())})  # fmt: skip
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=4)
    store = open_store(f"s3://{s3_bucket}/hf/data", storage)
    store.put_bytes("train-00000-of-00001.parquet", buffer.getvalue())
    for uri in (f"parquet://s3://{s3_bucket}/hf", f"parquet://s3://{s3_bucket}/hf/data/"
                "train-00000-of-00001.parquet"):  # fmt: skip
        ds = open_dataset(uri, storage=storage)
        assert isinstance(ds, EncodedDataset)
        assert (ds.num_samples, ds.num_classes) == (9, 4)
        good, bad = ds.read_encoded([8, 1, 5])
        assert not bad and [(s.label, s.data) for s in good] == [
            (0, images[8]), (1, images[1]), (1, images[5]),
        ]  # fmt: skip
    store.put_bytes("broken.parquet", buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(DatasetError, match=r"broken\.parquet is not a readable Parquet file"):
        open_dataset(f"parquet://s3://{s3_bucket}/hf", storage=storage)

    tokens = (np.arange(300) % 97).astype(np.uint32)
    open_store(f"s3://{s3_bucket}/lm", storage).put_bytes("train.bin", tokens.tobytes())
    lm = open_tokens(f"tokens://s3://{s3_bucket}/lm/train.bin?dtype=uint32&block_size=16",
                     storage=storage)  # fmt: skip
    assert (lm.num_tokens, lm.num_samples) == (300, 18)
    np.testing.assert_array_equal(lm.read([17])[0], tokens[272:289])
    with pytest.raises(DatasetError, match=r"lm/none\.bin not found"):
        open_tokens(f"tokens://s3://{s3_bucket}/lm/none.bin", storage=storage)
