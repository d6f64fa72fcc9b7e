"""Image-file datasets against real files made here: imagefolder, webdataset, parquet, tokens,
the webdataset pack, and what each reports for corrupt inputs."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.training.datasets import (
    DatasetError,
    EncodedDataset,
    ImageFolderDataset,
    WebDataset,
    open_dataset,
    open_tokens,
    output_shape,
)
from conveyor.training.datasets.images import BadImage, decode_image, encode_jpeg, encode_png
from conveyor.training.datasets.location import dataset_location
from conveyor.training.datasets.pack_webdataset import is_image_folder, pack_imagefolder
from conveyor.training.datasets.parquet import ParquetDataset
from conveyor.training.datasets.webdataset import expand_braces


def _image(seed: int, channels: int = 3, size: tuple[int, int] = (7, 9)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (channels, *size), dtype=np.uint8)


def make_image_folder(root: Path, per_class: dict[str, int]) -> dict[str, np.ndarray]:
    """Class folders of PNG files (lossless, so pixels can be compared) of varied sizes;
    returns relative path -> pixels [3,h,w]."""
    written = {}
    for c, (name, count) in enumerate(sorted(per_class.items())):
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = _image(100 * c + i, size=(5 + i, 6 + c))
            (root / name / f"img{i:03d}.png").write_bytes(encode_png(pixels))
            written[f"{name}/img{i:03d}.png"] = pixels
    return written


def _decoded(ds: EncodedDataset, ids: list[int], channels: int = 3) -> list[np.ndarray]:
    good, bad = ds.read_encoded(ids)
    assert not bad
    return [decode_image(s.data, channels=channels) for s in good]


# --- decoding -------------------------------------------------------------------------------


def test_decode_png_and_jpeg_to_rgb_and_grayscale() -> None:
    pixels = _image(1)
    np.testing.assert_array_equal(decode_image(encode_png(pixels), channels=3), pixels)
    gray = decode_image(encode_png(pixels), channels=1)
    assert gray.shape == (1, 7, 9) and gray.dtype == np.uint8
    smooth = np.full((3, 16, 16), 120, dtype=np.uint8)
    jpeg = decode_image(encode_jpeg(smooth, quality=95), channels=3)
    assert jpeg.shape == (3, 16, 16) and np.abs(jpeg.astype(int) - 120).max() <= 2


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not an image at all", "not a JPEG/PNG image"),
        (encode_png(np.zeros((3, 32, 32), np.uint8))[:60], "corrupt image"),
        (b"GIF89a" + b"\0" * 40, "not a JPEG/PNG image"),
    ],
)
def test_decode_refuses_corrupt_and_other_formats(data: bytes, reason: str) -> None:
    with pytest.raises(BadImage, match=reason):
        decode_image(data, channels=3)


# --- imagefolder ----------------------------------------------------------------------------


def test_imagefolder_classes_order_and_bytes(tmp_path: Path) -> None:
    written = make_image_folder(tmp_path, {"dog": 2, "cat": 3, "ant": 1})
    (tmp_path / "README.txt").write_text("ignored")
    (tmp_path / "cat" / "notes.txt").write_text("ignored")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.png").write_bytes(encode_png(_image(9)))
    ds = open_dataset(f"imagefolder://{tmp_path}")
    assert isinstance(ds, ImageFolderDataset)
    assert ds.classes == ["ant", "cat", "dog"]
    assert (ds.num_samples, ds.num_classes) == (6, 3)
    good, bad = ds.read_encoded([5, 0, 2])
    assert not bad
    assert [(s.sample_id, s.label) for s in good] == [(5, 2), (0, 0), (2, 1)]
    assert good[0].source == f"file://{tmp_path}/dog/img001.png"
    np.testing.assert_array_equal(decode_image(good[0].data, channels=3), written["dog/img001.png"])
    np.testing.assert_array_equal(decode_image(good[2].data, channels=3), written["cat/img001.png"])


def test_imagefolder_missing_or_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        open_dataset(f"imagefolder://{tmp_path}/nope")
    with pytest.raises(DatasetError, match="no class folder"):
        open_dataset(f"imagefolder://{tmp_path}")
    with pytest.raises(DatasetError, match="takes no parameters"):
        open_dataset(f"imagefolder://{tmp_path}?size=3")


def test_imagefolder_vanished_file_is_a_bad_sample(tmp_path: Path) -> None:
    make_image_folder(tmp_path, {"a": 2, "b": 2})
    ds = open_dataset(f"imagefolder://{tmp_path}")
    assert isinstance(ds, EncodedDataset)
    (tmp_path / "b" / "img000.png").unlink()
    good, bad = ds.read_encoded([0, 2, 3])
    assert [s.sample_id for s in good] == [0, 3]
    assert [(b.sample_id, b.source) for b in bad] == [(2, f"file://{tmp_path}/b/img000.png")]
    assert "not found" in bad[0].reason


def test_output_shape_rules(tmp_path: Path) -> None:
    make_image_folder(tmp_path, {"a": 1})
    folder = open_dataset(f"imagefolder://{tmp_path}")
    assert output_shape(folder, image_size=(32, 24), channels=None) == (3, 32, 24)
    assert output_shape(folder, image_size=(8, 8), channels=1) == (1, 8, 8)
    with pytest.raises(DatasetError, match=r"need preprocess\.image_size"):
        output_shape(folder, image_size=None, channels=None)
    digits = open_dataset("builtin://sklearn-digits")
    assert output_shape(digits, image_size=None, channels=None) == (1, 8, 8)
    assert output_shape(digits, image_size=(16, 16), channels=1) == (1, 16, 16)
    with pytest.raises(DatasetError, match="channels=3 but the dataset's images have 1"):
        output_shape(digits, image_size=None, channels=3)


# --- webdataset -----------------------------------------------------------------------------


def test_expand_braces() -> None:
    assert expand_braces("{000000..000002}.tar") == ["000000.tar", "000001.tar", "000002.tar"]
    assert expand_braces("s-{8..10}-{a,b}.tar") == [
        "s-8-a.tar", "s-8-b.tar", "s-9-a.tar", "s-9-b.tar", "s-10-a.tar", "s-10-b.tar",
    ]  # fmt: skip
    assert expand_braces("one.tar") == ["one.tar"]
    for bad in ("{3..1}.tar", "{a..b}.tar", "{x}.tar", "a}.tar", "{0..9999999}.tar"):
        with pytest.raises(ValueError):
            expand_braces(bad)


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_without_manifest_indexes_shards(tmp_path: Path) -> None:
    images = {k: _image(k) for k in range(5)}
    _write_tar(
        tmp_path / "000000.tar",
        [
            ("s0.png", encode_png(images[0])),
            ("s0.cls", b"1"),
            ("s0.json", b"{}"),
            ("s1.cls", b"0\n"),
            ("s1.png", encode_png(images[1])),
        ],
    )
    _write_tar(
        tmp_path / "000001.tar",
        [
            ("d/s2.png", encode_png(images[2])),
            ("d/s2.cls", b"3"),
            ("s3.png", encode_png(images[3])),  # no .cls: bad member
            ("s4.png", encode_png(images[4])),
            ("s4.cls", b"cat"),  # not a class id
        ],
    )
    ds = open_dataset(f"webdataset://{tmp_path}/{{000000..000001}}.tar")
    assert isinstance(ds, WebDataset)
    assert (ds.num_samples, ds.num_classes) == (5, 4)
    good, bad = ds.read_encoded([2, 0, 3, 1, 4])
    assert [(s.sample_id, s.label) for s in good] == [(2, 3), (0, 1), (1, 0)]
    for sample in good:
        decoded = decode_image(sample.data, channels=3)
        np.testing.assert_array_equal(decoded, images[sample.sample_id])
    assert good[0].source == f"file://{tmp_path}/000001.tar:d/s2.png"
    reasons = {b.sample_id: str(b) for b in bad}
    assert set(reasons) == {3, 4}
    assert "000001.tar:s3.png: bad tar member: no readable .cls member" in reasons[3]
    assert "holds 'cat', not a class id" in reasons[4]


def test_webdataset_corrupt_header_and_missing_shard(tmp_path: Path) -> None:
    _write_tar(tmp_path / "000000.tar", [("s0.png", encode_png(_image(0))), ("s0.cls", b"0")])
    with pytest.raises(DatasetError, match=r"000001\.tar not found"):
        open_dataset(f"webdataset://{tmp_path}/{{000000..000001}}.tar")
    data = bytearray((tmp_path / "000000.tar").read_bytes())
    second = 512 + -(-len(encode_png(_image(0))) // 512) * 512  # header of s0.cls
    data[second : second + 100] = b"\xff" * 100
    (tmp_path / "000000.tar").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"000000\.tar: unreadable tar header at byte"):
        open_dataset(f"webdataset://{tmp_path}/000000.tar")
    with pytest.raises(DatasetError, match=r"must be named \.tar files"):
        open_dataset(f"webdataset://{tmp_path}/{{0..1}}.zip")


def test_pack_imagefolder_round_trip_and_manifest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    written = make_image_folder(src, {"x": 3, "y": 2})
    assert is_image_folder(str(src)) and not is_image_folder(str(tmp_path / "none"))
    reported: list[tuple[int, int]] = []
    result = pack_imagefolder(
        str(src), str(tmp_path / "out"), shard_size=2, progress=lambda *p: reported.append(p)
    )
    assert reported == [(2, 5), (4, 5), (5, 5)]  # the images packed, as the shards fill
    assert result.uri == f"webdataset://{tmp_path}/out/{{000000..000002}}.tar"
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert manifest["classes"] == ["x", "y"] and manifest["num_samples"] == 5
    assert [s["num_samples"] for s in manifest["shards"]] == [2, 2, 1]
    import hashlib

    for shard in manifest["shards"]:
        data = (tmp_path / "out" / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
    # Deterministic: the same folder packs to the same bytes.
    again = pack_imagefolder(str(src), str(tmp_path / "again"), shard_size=2)
    assert again.manifest.shards == result.manifest.shards
    with pytest.raises(ValueError, match="already holds a dataset"):
        pack_imagefolder(str(src), str(tmp_path / "out"), shard_size=2)

    ds = open_dataset(result.uri)
    folder = open_dataset(f"imagefolder://{src}")
    assert (ds.num_samples, ds.num_classes) == (5, 2)
    assert isinstance(ds, EncodedDataset) and isinstance(folder, EncodedDataset)
    ids = [4, 1, 2, 0, 3]
    packed, bad = ds.read_encoded(ids)
    plain, _ = folder.read_encoded(ids)
    assert not bad
    assert [(s.label, s.data) for s in packed] == [(s.label, s.data) for s in plain]
    np.testing.assert_array_equal(decode_image(packed[0].data, channels=3), written["y/img001.png"])
    # A manifest that disagrees with a shard's content is caught on the read.
    (tmp_path / "out" / "000001.tar").write_bytes((tmp_path / "out" / "000002.tar").read_bytes())
    stale = open_dataset(result.uri)
    assert isinstance(stale, EncodedDataset)
    with pytest.raises(DatasetError, match=r"000001\.tar holds 1 samples, the manifest says 2"):
        stale.read_encoded([2])


# --- parquet --------------------------------------------------------------------------------


def _hf_table(
    images: Sequence[bytes | None], labels: Sequence[int | None], names: int = 10
) -> pa.Table:
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array(
                [None if b is None else {"bytes": b, "path": None} for b in images], image_type
            ),
            "label": pa.array(labels, pa.int64()),
        }
    )
    names_list = [str(i) for i in range(names)]
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": names_list}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return table.replace_schema_metadata(metadata)


def test_parquet_hugging_face_layout(tmp_path: Path) -> None:
    images = [encode_png(_image(i)) for i in range(7)]
    pq.write_table(_hf_table(images[:4], [0, 1, 2, 3]), tmp_path / "train-0.parquet",
                   row_group_size=3)  # fmt: skip
    pq.write_table(_hf_table(images[4:], [4, None, 6]), tmp_path / "train-1.parquet")
    ds = open_dataset(f"parquet://{tmp_path}")
    assert isinstance(ds, ParquetDataset)
    assert (ds.num_samples, ds.num_classes) == (7, 10)  # the ClassLabel names, not max + 1
    good, bad = ds.read_encoded([6, 0, 3, 5, 4])
    assert [(s.sample_id, s.label) for s in good] == [(6, 6), (0, 0), (3, 3), (4, 4)]
    assert [s.data for s in good] == [images[6], images[0], images[3], images[4]]
    assert good[2].source == f"file://{tmp_path}/train-0.parquet:row 3"
    assert [str(b) for b in bad] == [
        f"file://{tmp_path}/train-1.parquet:row 1: label is null or < 0"
    ]
    single = open_dataset(f"parquet://{tmp_path}/train-1.parquet")
    assert single.num_samples == 3


def test_parquet_plain_columns_named_in_the_query(tmp_path: Path) -> None:
    images = [encode_png(_image(i)) for i in range(3)]
    table = pa.table({"png": pa.array(images, pa.binary()), "y": pa.array([2, 0, 1], pa.int8())})
    pq.write_table(table, tmp_path / "d.parquet")
    ds = open_dataset(f"parquet://{tmp_path}/d.parquet?image=png&label=y")
    assert isinstance(ds, EncodedDataset)
    assert (ds.num_samples, ds.num_classes) == (3, 3)  # no metadata: max label + 1
    good, _ = ds.read_encoded([1])
    assert (good[0].label, good[0].data) == (0, images[1])


def test_parquet_wrong_column_types_and_corrupt_file(tmp_path: Path) -> None:
    pq.write_table(pa.table({"image": ["a"], "label": [0]}), tmp_path / "str.parquet")
    with pytest.raises(DatasetError, match=r"str\.parquet: column 'image' is string, expected"):
        open_dataset(f"parquet://{tmp_path}/str.parquet")
    pq.write_table(pa.table({"image": [b"x"], "label": [0.5]}), tmp_path / "float.parquet")
    with pytest.raises(DatasetError, match="column 'label' is double, expected integers"):
        open_dataset(f"parquet://{tmp_path}/float.parquet")
    with pytest.raises(DatasetError, match=r"no column 'label' \(columns: \['image'\]\)"):
        pq.write_table(pa.table({"image": [b"x"]}), tmp_path / "nolabel.parquet")
        open_dataset(f"parquet://{tmp_path}/nolabel.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match=r"junk\.parquet is not a readable Parquet file"):
        open_dataset(f"parquet://{tmp_path}/junk.parquet")
    with pytest.raises(DatasetError, match="unknown parameter 'img'"):
        open_dataset(f"parquet://{tmp_path}/str.parquet?img=x")


# --- tokens ---------------------------------------------------------------------------------


def test_tokens_blocks_and_validation(tmp_path: Path) -> None:
    tokens = (np.arange(1000) * 7 % 50_000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    ds = open_tokens(f"tokens://{tmp_path}/train.bin?dtype=uint16&block_size=64")
    assert (ds.num_tokens, ds.num_samples) == (1000, 15)
    seq = ds.read([3, 0])
    assert seq.shape == (2, 65) and seq.dtype == np.int64
    np.testing.assert_array_equal(seq[0], tokens[192:257])
    np.testing.assert_array_equal(seq[1], tokens[0:65])
    wide = open_tokens(f"tokens://{tmp_path}/train.bin?dtype=uint32&block_size=10")
    assert wide.num_tokens == 500
    with pytest.raises(DatasetError, match=r"token \d+ at position 8 is outside the vocabulary"):
        open_tokens(f"tokens://{tmp_path}/train.bin?block_size=64&vocab_size=50").read([0])
    with pytest.raises(DatasetError, match="out of range"):
        ds.read([15])
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(DatasetError, match="not a whole number of uint16 tokens"):
        open_tokens(f"tokens://{tmp_path}/odd.bin")
    with pytest.raises(DatasetError, match="dtype='int8' must be one of"):
        open_tokens(f"tokens://{tmp_path}/train.bin?dtype=int8")
    with pytest.raises(DatasetError, match="do not make one sequence"):
        open_tokens(f"tokens://{tmp_path}/train.bin?block_size=5000")


# --- locations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "location"),
    [
        ("imagefolder:///data/pets", "file:///data/pets"),
        ("webdataset:///data/wds/{000000..000009}.tar", "file:///data/wds"),
        ("webdataset://s3://b/wds/{0..9}.tar", "s3://b/wds"),
        ("parquet:///data/hf/train.parquet?image=img", "file:///data/hf/train.parquet"),
        ("parquet://s3://b/hf", "s3://b/hf"),
        ("tokens:///data/owt/train.bin?dtype=uint16", "file:///data/owt/train.bin"),
        ("imagefolder:///data/x/../y", "file:///data/y"),
    ],
)
def test_dataset_locations_of_the_new_schemes(uri: str, location: str) -> None:
    assert dataset_location(uri) == location
