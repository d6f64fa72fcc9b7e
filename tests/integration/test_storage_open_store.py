"""Object storage: open_store, the URI parsing and settings that pick and configure a backend."""

from __future__ import annotations

import pytest
from storage_backends import s3_settings

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import open_store


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("file://", "names no directory"),
        ("ftp://host/x", "must start with"),
        ("s3://", "not a valid bucket"),
        ("s3:///prefix", "not a valid bucket"),
        ("s3://Bad_Bucket/x", "not a valid bucket"),
        ("s3://bucket/a/../b", "invalid prefix"),
        ("s3://bucket//x", "invalid prefix"),
    ],
)
def test_open_store_rejects_malformed_uris(uri: str, message: str) -> None:
    settings = StorageSettings(s3_endpoint="127.0.0.1:9000")
    with pytest.raises(ValueError, match=message):
        open_store(uri, settings)


def test_open_store_needs_an_s3_endpoint() -> None:
    with pytest.raises(ValueError, match="s3_endpoint"):
        open_store("s3://bucket")
    with pytest.raises(ValueError, match="s3_endpoint"):
        open_store("s3://bucket", StorageSettings())


def test_open_store_accepts_an_endpoint_url(s3_server: dict[str, str], s3_bucket: str) -> None:
    settings = s3_settings(s3_server).model_copy(
        update={"s3_endpoint": f"http://{s3_server['endpoint']}/"}
    )
    store = open_store(f"s3://{s3_bucket}", settings)
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"
    assert store.uri_for("k") == f"s3://{s3_bucket}/k"
