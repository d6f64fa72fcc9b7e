"""Roots: a location is inside a root only after normalisation (``..``, symbolic links,
relative paths, whole path components, exact buckets, whole S3 key segments)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from conveyor.platform.config import StorageSettings
from conveyor.platform.roots import Location, LocationRefused, Roots, resolve_location


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``allowed/`` (with ``sub/``, ``a/b/``, ``out -> ../secret``, ``deep -> a/b``),
    ``allowed2/``, ``secret/``, ``elsewhere/in -> ../allowed`` and ``rootlink -> allowed``."""
    base = tmp_path.resolve()
    for directory in ("allowed/sub", "allowed/a/b", "allowed2", "secret", "elsewhere"):
        (base / directory).mkdir(parents=True)
    (base / "allowed" / "out").symlink_to(base / "secret")
    (base / "allowed" / "deep").symlink_to(base / "allowed" / "a" / "b")
    (base / "elsewhere" / "in").symlink_to(base / "allowed")
    (base / "rootlink").symlink_to(base / "allowed")
    return base


def file_roots(*paths: Path | str) -> Roots:
    return Roots.resolve("output", "CONVEYOR_STORAGE_OUTPUT_ROOTS", [str(p) for p in paths])


def test_resolve_location_normalises_each_form(tree: Path) -> None:
    assert resolve_location(f"file://{tree}/allowed/sub/../x") == Location(
        scheme="file", bucket="", parts=(*tree.parts[1:], "allowed", "x")
    )
    assert resolve_location(f"{tree}/elsewhere/in/y") == resolve_location(f"{tree}/allowed/y")
    assert str(resolve_location(f"{tree}/allowed/out/z")) == f"file://{tree}/secret/z"
    assert str(resolve_location("file:///")) == "file:///"
    assert resolve_location("s3://bkt/data/x/") == Location(
        scheme="s3", bucket="bkt", parts=("data", "x")
    )
    assert str(resolve_location("s3://bkt")) == "s3://bkt"
    assert str(resolve_location("s3://bkt/a/b")) == "s3://bkt/a/b"


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("", "names no path"),
        ("file://", "names no path"),
        ("gs://bucket/x", "only file://, s3:// or a local path"),
        ("file://s3://bkt/x", "only file://, s3:// or a local path"),
        ("/tmp/a\0b", "NUL"),
        ("s3://B/x", "not a valid bucket name"),
        ("s3:///x", "not a valid bucket name"),
        ("s3://bkt/data/../x", "'.', '..' or empty segments"),
        ("s3://bkt/data/./x", "'.', '..' or empty segments"),
        ("s3://bkt/data//x", "'.', '..' or empty segments"),
        ("s3://bkt/..", "'.', '..' or empty segments"),
    ],
)
def test_malformed_locations_are_refused(location: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_location(location)
    with pytest.raises(LocationRefused, match="not a usable output location") as refused:
        file_roots("/").check(location)
    assert message in str(refused.value)


def test_local_locations_inside_a_root(tree: Path) -> None:
    roots = file_roots(tree / "allowed")
    inside = [
        f"{tree}/allowed",  # the root itself
        f"{tree}/allowed/",
        f"file://{tree}/allowed/new/dir",  # does not exist yet
        f"{tree}/allowed/sub/../x",  # '..' that stays inside
        f"{tree}/allowed/deep/x",  # a link to a place inside
        f"{tree}/elsewhere/in/x",  # a link from outside to inside: where it resolves counts
        f"{tree}/allowed/deep/../x",  # '..' after a link: <allowed>/a/x, inside
    ]
    for location in inside:
        assert roots.check(location).is_within(resolve_location(f"{tree}/allowed")), location
    assert str(roots.check(f"{tree}/elsewhere/in/x")) == f"file://{tree}/allowed/x"
    assert str(roots.check(f"{tree}/allowed/deep/../x")) == f"file://{tree}/allowed/a/x"


@pytest.mark.parametrize(
    "location",
    [
        "{tree}/secret",  # an absolute path elsewhere
        "file://{tree}/secret/ckpt",
        "{tree}/allowed2/x",  # a sibling sharing the root's name as a prefix
        "{tree}/allowed/../secret",  # a '..' escape
        "{tree}/allowed/sub/../../secret",
        "{tree}/allowed/out",  # a symbolic link to a place outside
        "{tree}/allowed/out/ckpt",
        "{tree}/allowed/out/../secret",  # '..' is taken after the link, as the system does
        "{tree}",  # the root's parent
        "s3://bkt{tree}/allowed",  # same path, another scheme
    ],
)
def test_local_locations_outside_every_root(tree: Path, location: str) -> None:
    roots = file_roots(tree / "allowed", "s3://bkt/data")
    with pytest.raises(LocationRefused) as refused:
        roots.check(location.format(tree=tree))
    message = str(refused.value)
    assert "is outside the allowed output roots" in message
    assert f"file://{tree}/allowed, s3://bkt/data" in message  # names what is allowed
    assert "CONVEYOR_STORAGE_OUTPUT_ROOTS" in message
    assert "secret" not in message.replace(location.format(tree=tree), "")  # no link target


def test_relative_locations_resolve_against_the_working_directory(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree / "allowed")
    roots = file_roots(".")
    assert str(roots.check("./ckpt")) == f"file://{tree}/allowed/ckpt"
    assert str(roots.check("file://sub/x")) == f"file://{tree}/allowed/sub/x"
    for escape in ("..", "../secret", "file://../allowed2", "sub/../../secret", "out/x"):
        with pytest.raises(LocationRefused, match="outside"):
            roots.check(escape)


def test_a_root_that_is_a_link_is_its_target(tree: Path) -> None:
    roots = file_roots(tree / "rootlink")
    assert str(roots.check(f"{tree}/allowed/x")) == f"file://{tree}/allowed/x"
    assert str(roots.check(f"{tree}/rootlink/x")) == f"file://{tree}/allowed/x"
    with pytest.raises(LocationRefused):
        roots.check(f"{tree}/rootlink/../secret")


def test_the_file_system_root_holds_every_local_path_and_no_bucket(tree: Path) -> None:
    roots = file_roots("/")
    assert str(roots.check(f"{tree}/secret")) == f"file://{tree}/secret"
    with pytest.raises(LocationRefused):
        roots.check("s3://bkt/x")


def test_s3_buckets_match_exactly_and_prefixes_by_whole_segments() -> None:
    roots = Roots.resolve(
        "dataset", "CONVEYOR_STORAGE_DATASET_ROOTS", ["s3://bkt/data", "s3://whole-bucket"]
    )
    for inside in ("s3://bkt/data", "s3://bkt/data/", "s3://bkt/data/x/y", "s3://whole-bucket/z"):
        assert roots.check(inside).scheme == "s3", inside
    assert str(roots.check("s3://bkt/data/x/")) == "s3://bkt/data/x"
    for outside in (
        "s3://bkt/data2",  # a sibling prefix
        "s3://bkt/data2/x",
        "s3://bkt/dat",
        "s3://bkt",  # the bucket above the prefix
        "s3://bkt/other/data",
        "s3://bkt2/data",  # another bucket
        "s3://other-bucket/data/x",
        "s3://whole-bucket2/z",
        "file:///bkt/data/x",  # the same words as a local path
    ):
        with pytest.raises(LocationRefused, match="outside the allowed dataset roots") as refused:
            roots.check(outside)
        assert "s3://bkt/data, s3://whole-bucket" in str(refused.value)


def test_no_roots_allow_nothing() -> None:
    roots = Roots.resolve("output", "X", [])
    with pytest.raises(LocationRefused, match=r"roots \(none\)"):
        roots.check("/tmp")


def test_storage_settings_roots_come_from_the_environment_and_include_the_object_store(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_STORAGE_URI", f"file://{tree}/allowed/objects")
    monkeypatch.setenv("CONVEYOR_STORAGE_DATASET_ROOTS", f'["{tree}/allowed2", "s3://bkt/d/"]')
    monkeypatch.setenv("CONVEYOR_STORAGE_OUTPUT_ROOTS", f'["file://{tree}/secret"]')
    settings = StorageSettings()
    assert settings.dataset_roots == (f"{tree}/allowed2", "s3://bkt/d/")
    datasets = settings.allowed_dataset_roots()
    assert [str(root) for root in datasets.roots] == [
        f"file://{tree}/allowed/objects",
        f"file://{tree}/allowed2",
        "s3://bkt/d",
    ]
    assert datasets.setting == "CONVEYOR_STORAGE_DATASET_ROOTS"
    outputs = settings.allowed_output_roots()
    assert [str(root) for root in outputs.roots] == [
        f"file://{tree}/allowed/objects",
        f"file://{tree}/secret",
    ]
    assert outputs.setting == "CONVEYOR_STORAGE_OUTPUT_ROOTS"
    defaults = StorageSettings(uri="s3://store/p", output_roots=(), dataset_roots=())
    assert [str(r) for r in defaults.allowed_output_roots().roots] == ["s3://store/p"]
    assert [str(r) for r in defaults.allowed_dataset_roots().roots] == ["s3://store/p"]


@pytest.mark.parametrize(
    ("field", "root", "message"),
    [
        ("output_roots", "gs://bucket", "only file://, s3:// or a local path"),
        ("dataset_roots", "s3://bkt/a/../b", "'.', '..' or empty segments"),
        ("dataset_roots", "", "names no path"),
    ],
)
def test_a_malformed_root_is_a_settings_error(field: str, root: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as error:
        StorageSettings(**{field: (root,)})  # type: ignore[arg-type]
    assert error.value.errors()[0]["loc"] == (field,)


def test_realpath_is_what_the_system_opens(tree: Path) -> None:
    # The reason for realpath over a lexical normalisation: '<allowed>/out/..' is <tree>, not
    # <allowed>, once the system follows the link.
    assert os.path.normpath(f"{tree}/allowed/out/..") == f"{tree}/allowed"
    assert (tree / "allowed" / "out" / "..").resolve() == tree
    with pytest.raises(LocationRefused):
        file_roots(tree / "allowed").check(f"{tree}/allowed/out/..")
