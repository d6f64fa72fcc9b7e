"""Helpers shared by the object-storage tests (test_storage_*.py): the S3 endpoint's settings
and a raw client to reach behind a store's back, and deterministic payloads."""

from __future__ import annotations

from minio import Minio

from conveyor.platform.config import StorageSettings

MiB = 1024 * 1024
S3_PREFIX = "runs/r1"


def s3_settings(s3_server: dict[str, str]) -> StorageSettings:
    return StorageSettings(
        s3_endpoint=s3_server["endpoint"],
        s3_access_key=s3_server["access_key"],
        s3_secret_key=s3_server["secret_key"],
        s3_region=s3_server["region"],
    )


def raw_client(s3_server: dict[str, str]) -> Minio:
    return Minio(
        s3_server["endpoint"],
        access_key=s3_server["access_key"],
        secret_key=s3_server["secret_key"],
        region=s3_server["region"],
        secure=False,
    )


def pending_uploads(s3_server: dict[str, str], bucket: str) -> list[str]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=f"http://{s3_server['endpoint']}",
        aws_access_key_id=s3_server["access_key"],
        aws_secret_access_key=s3_server["secret_key"],
        region_name=s3_server["region"],
    )
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return [str(upload["Key"]) for upload in uploads]


def payload(size_bytes: int, seed: int = 0) -> bytes:
    """Deterministic bytes; a prime period so chunks and parts differ from each other."""
    period = bytes((i * 31 + seed) % 256 for i in range(251))
    return (period * (size_bytes // 251 + 1))[:size_bytes]
