"""Which places a job spec names, checked the way their writers and readers open them."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from conveyor.platform.config import StorageSettings
from conveyor.training.datasets.location import dataset_location
from conveyor.training.jobspec import DATASET_SCHEMES, JobSpec
from conveyor.training.locations import (
    LocationRefused,
    Refusal,
    check_dataset_uri,
    output_uri,
    refused_locations,
)

BASE: dict[str, Any] = {
    "name": "roots",
    "model": {"name": "small_cnn", "num_classes": 10},
    "dataset": {"uri": "builtin://sklearn-digits"},
    "training": {
        "epochs": 1,
        "global_batch_size": 64,
        "micro_batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.1},
    },
}


def spec(dataset: str | None = None, checkpoint: str | None = None) -> JobSpec:
    data = copy.deepcopy(BASE)
    if dataset is not None:
        data["dataset"]["uri"] = dataset
    if checkpoint is not None:
        data["checkpoint"] = {"uri": checkpoint}
    return JobSpec.from_dict(data)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``objects/``, ``out/``, ``data/`` (``a/b/``, ``link -> a/b``) and ``secret/``."""
    base = tmp_path.resolve()
    for directory in ("objects", "out", "data/a/b", "secret"):
        (base / directory).mkdir(parents=True)
    (base / "data" / "link").symlink_to(base / "data" / "a" / "b")
    (base / "out" / "leak").symlink_to(base / "secret")
    return base


@pytest.fixture
def storage(tree: Path) -> StorageSettings:
    return StorageSettings(
        uri=f"file://{tree}/objects",
        output_roots=(f"{tree}/out", "s3://bkt/out"),
        dataset_roots=(f"file://{tree}/data", "s3://bkt/data"),
    )


def test_every_dataset_scheme_says_where_it_reads() -> None:
    # Fail closed: a scheme without a rule would be refused, so each one must have a rule.
    for scheme in sorted(DATASET_SCHEMES):
        dataset_location(f"{scheme}://x")
    with pytest.raises(ValueError, match="no location rule"):
        dataset_location("video:///data/x")
    with pytest.raises(ValueError, match="no scheme"):
        dataset_location("/data/x")


def test_dataset_location_is_what_the_reader_opens(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree)
    assert dataset_location("builtin://sklearn-digits") is None
    assert dataset_location("synthetic://?n=10") is None
    assert dataset_location("npz://data/x") == f"file://{tree}/data/x"
    assert dataset_location("npz://s3://bkt/data/x") == "s3://bkt/data/x"
    # npz opens a FileObjectStore, which takes os.path.abspath: '..' goes before the link.
    assert dataset_location(f"npz://{tree}/data/link/../../x") == f"file://{tree}/x"
    assert dataset_location(f"npz://file://{tree}/data/link/../x") == f"file://{tree}/data/x"
    # mnist-idx opens the path as written: the system follows the link, then '..'.
    assert dataset_location(f"mnist-idx://{tree}/data/link/../x") == f"file://{tree}/data/link/../x"
    assert dataset_location("mnist-idx://file://data/x") == "file://data/x"
    with pytest.raises(ValueError, match="names no directory"):
        dataset_location("npz://file://")
    # The image-file readers open a FileObjectStore too; webdataset's last segment names shards.
    assert dataset_location(f"imagefolder://{tree}/data/link/../../x") == f"file://{tree}/x"
    assert dataset_location("webdataset://data/{0..3}.tar") == f"file://{tree}/data"
    assert dataset_location("webdataset://{0..3}.tar") == f"file://{tree}"
    assert dataset_location("parquet://data/x.parquet?image=png") == f"file://{tree}/data/x.parquet"


def test_a_spec_inside_the_roots_is_allowed(tree: Path, storage: StorageSettings) -> None:
    allowed = [
        spec(),
        spec(dataset=f"npz://{tree}/data/x", checkpoint=f"file://{tree}/out/ckpt"),
        spec(dataset=f"mnist-idx://{tree}/data/link", checkpoint="s3://bkt/out/job-1"),
        spec(dataset="npz://s3://bkt/data/set", checkpoint=f"file://{tree}/objects/ckpt"),
        spec(dataset=f"npz://{tree}/objects/set"),  # the object store holds datasets too
        spec(dataset="synthetic://?n=10", checkpoint=f"file://{tree}/out/../out/x"),
    ]
    for job in allowed:
        assert refused_locations(job, storage) == [], job


@pytest.mark.parametrize(
    ("dataset", "checkpoint", "fields"),
    [
        ("npz://{tree}/secret", None, ["dataset.uri"]),  # an absolute path elsewhere
        ("npz://{tree}/data/../secret", None, ["dataset.uri"]),  # a '..' escape
        ("npz://{tree}/data/link/../../../secret", None, ["dataset.uri"]),
        ("mnist-idx://{tree}/data/../secret", None, ["dataset.uri"]),
        ("npz://s3://other-bucket/data", None, ["dataset.uri"]),  # another bucket
        ("npz://s3://bkt/data2", None, ["dataset.uri"]),  # a sibling prefix
        ("npz://gs://bkt/data", None, ["dataset.uri"]),  # a location no check vouches for
        ("builtin://sklearn-digits", "file://{tree}/secret", ["checkpoint.uri"]),
        ("builtin://sklearn-digits", "file://{tree}/out/../secret", ["checkpoint.uri"]),
        ("builtin://sklearn-digits", "file://{tree}/out/leak/x", ["checkpoint.uri"]),  # link
        ("builtin://sklearn-digits", "file://{tree}/out2", ["checkpoint.uri"]),
        ("builtin://sklearn-digits", "s3://other-bucket/out", ["checkpoint.uri"]),
        ("builtin://sklearn-digits", "s3://bkt/out2/x", ["checkpoint.uri"]),
        ("builtin://sklearn-digits", "file://{tree}/data/x", ["checkpoint.uri"]),  # read-only
        ("npz://{tree}/out/x", "file://{tree}/secret", ["checkpoint.uri", "dataset.uri"]),
    ],
)
def test_a_spec_outside_the_roots_is_refused_per_field(
    tree: Path,
    storage: StorageSettings,
    dataset: str,
    checkpoint: str | None,
    fields: list[str],
) -> None:
    job = spec(
        dataset=dataset.format(tree=tree),
        checkpoint=checkpoint.format(tree=tree) if checkpoint else None,
    )
    refusals = refused_locations(job, storage)
    assert [refusal.field for refusal in refusals] == fields
    for refusal in refusals:
        kind = "output" if refusal.field == "checkpoint.uri" else "dataset"
        assert f"allowed {kind} roots" in refusal.reason or "not a usable" in refusal.reason
        assert str(refusal) == f"{refusal.field}: {refusal.reason}"


def test_refusals_name_the_allowed_roots(tree: Path, storage: StorageSettings) -> None:
    job = spec(dataset="npz://s3://bkt/data2", checkpoint="s3://bkt/out2")
    assert refused_locations(job, storage) == [
        Refusal(
            field="checkpoint.uri",
            reason=(
                f"s3://bkt/out2 is outside the allowed output roots (file://{tree}/objects, "
                f"file://{tree}/out, s3://bkt/out), compared after resolving '..' and symbolic "
                "links; the operator lists them in CONVEYOR_STORAGE_OUTPUT_ROOTS"
            ),
        ),
        Refusal(
            field="dataset.uri",
            reason=(
                f"s3://bkt/data2 is outside the allowed dataset roots (file://{tree}/objects, "
                f"file://{tree}/data, s3://bkt/data), compared after resolving '..' and "
                "symbolic links; the operator lists them in CONVEYOR_STORAGE_DATASET_ROOTS"
            ),
        ),
    ]


def test_output_uri_is_the_normalised_place_or_the_object_store(
    tree: Path, storage: StorageSettings
) -> None:
    assert output_uri(spec(), storage) == storage.uri
    (tree / "out" / "deep").symlink_to(tree / "out" / "real")
    # The writer gets the resolved path, so a link changed after the check cannot move it.
    assert output_uri(spec(checkpoint=f"file://{tree}/out/deep/x"), storage) == (
        f"file://{tree}/out/real/x"
    )
    assert output_uri(spec(checkpoint="s3://bkt/out/j/"), storage) == "s3://bkt/out/j"
    with pytest.raises(LocationRefused, match=r"^checkpoint\.uri: .* is outside the allowed"):
        output_uri(spec(checkpoint=f"file://{tree}/out/leak"), storage)
    assert not any((tree / "secret").iterdir())


def test_check_dataset_uri_names_the_field(tree: Path, storage: StorageSettings) -> None:
    check_dataset_uri(f"npz://{tree}/data/set", storage)
    check_dataset_uri("builtin://sklearn-digits", storage)
    with pytest.raises(LocationRefused, match=r"^dataset\.uri: file://.*/secret is outside"):
        check_dataset_uri(f"mnist-idx://{tree}/secret", storage)
    with pytest.raises(LocationRefused, match=r"^dataset\.uri: .*only s3://, file://"):
        check_dataset_uri("npz://gs://bkt/data", storage)


def test_relative_dataset_paths_resolve_against_the_working_directory(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree / "data")
    storage = StorageSettings(uri=f"file://{tree}/objects", dataset_roots=(".",))
    assert refused_locations(spec(dataset="npz://./a"), storage) == []
    assert refused_locations(spec(dataset="mnist-idx://link"), storage) == []
    for escape in ("npz://../secret", "npz://a/../../secret", "mnist-idx://file://../secret"):
        assert [r.field for r in refused_locations(spec(dataset=escape), storage)] == [
            "dataset.uri"
        ], escape
    assert os.getcwd() == str(tree / "data")
