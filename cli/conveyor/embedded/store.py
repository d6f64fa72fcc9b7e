"""Make the stack's object store ready before any service needs it."""

from __future__ import annotations

import os
from pathlib import Path

from conveyor.embedded.health import Probe, tcp_probe
from conveyor.platform.config import StorageSettings
from conveyor.platform.errors import ConveyorError

DEFAULT_BUCKET_URI = "s3://conveyor"


class StoreSetupError(ConveyorError):
    """The object store could not be prepared."""


def file_root(uri: str) -> Path:
    """Directory of a ``file://`` store URI."""
    return Path(uri.removeprefix("file://"))


def absolute_file_uri(uri: str) -> str:
    """``file://./x`` -> ``file:///abs/x``: services may run in another working directory."""
    return f"file://{file_root(uri).resolve()}"


def bucket_of(uri: str) -> str:
    """Bucket name of an ``s3://bucket[/prefix]`` URI."""
    bucket = uri.removeprefix("s3://").split("/", 1)[0]
    if not bucket:
        raise ValueError(f"no bucket in storage uri {uri!r}")
    return bucket


def absolute_root(root: str) -> str:
    """A local root (``file://<dir>`` or ``<dir>``) as ``file://<absolute dir>``; ``s3://`` as
    given. Links are left for the services to resolve when they check a location."""
    if root.startswith("s3://"):
        return root
    return f"file://{os.path.abspath(root.removeprefix('file://'))}"


def resolve_storage(
    state_dir: Path, overrides: dict[str, str | bool | tuple[str, ...] | None]
) -> StorageSettings:
    """Storage settings of a stack: command-line ``overrides`` (None = not given) over
    ``CONVEYOR_STORAGE_*`` / the config file.

    Without an explicit URI the store is ``s3://conveyor`` when an S3 endpoint is known, else the
    directory ``<state_dir>/objects``. Without dataset roots, jobs may read datasets from the
    working directory (and the object store, always). ``file://`` URIs and local roots are made
    absolute: the services check them whatever directory they run in. Raises
    ``pydantic.ValidationError`` on invalid values.
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    settings = StorageSettings(**given)  # type: ignore[arg-type]
    if "uri" in settings.model_fields_set:
        uri = settings.uri
    elif settings.s3_endpoint:
        uri = DEFAULT_BUCKET_URI
    else:
        uri = f"file://{(state_dir / 'objects').resolve()}"
    if uri.startswith("file://"):
        uri = absolute_file_uri(uri)
    dataset_roots = settings.dataset_roots
    if "dataset_roots" not in settings.model_fields_set:
        dataset_roots = (os.getcwd(),)
    return StorageSettings(
        **{  # type: ignore[arg-type]
            **given,
            "uri": uri,
            "output_roots": tuple(absolute_root(root) for root in settings.output_roots),
            "dataset_roots": tuple(absolute_root(root) for root in dataset_roots),
        }
    )


def prepare_store(settings: StorageSettings) -> None:
    """Create the store's directory (``file://``) or bucket (``s3://``) when missing.

    Raises :class:`StoreSetupError` with the reason when the directory cannot be created or the
    S3 endpoint cannot be reached, rejects the credentials, or refuses to create the bucket.
    """
    if settings.uri.startswith("file://"):
        root = file_root(settings.uri)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreSetupError(f"cannot create object store directory {root}: {exc}") from exc
        return
    if not settings.s3_endpoint:
        raise StoreSetupError(f"{settings.uri} needs an S3 endpoint (--s3 HOST:PORT)")
    reachable = tcp_probe(settings.s3_endpoint, timeout_s=5.0)
    if not reachable.healthy:
        raise StoreSetupError(f"S3 endpoint unreachable: {reachable.detail}")
    import urllib3
    from minio import Minio
    from minio.error import MinioException

    client = Minio(
        settings.s3_endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        region=settings.s3_region,
        secure=settings.s3_secure,
        # Fail in seconds, not after urllib3's default retry ladder.
        http_client=urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5.0, read=30.0),
            retries=urllib3.Retry(total=2, backoff_factor=0.2),
        ),
    )
    bucket = bucket_of(settings.uri)
    try:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise StoreSetupError(
            f"cannot prepare bucket {bucket!r} at {settings.s3_endpoint}: {exc}"
        ) from exc


def store_probe(uri: str, endpoint: str | None) -> Probe:
    """Cheap liveness check that needs no credentials: the directory exists / the endpoint
    accepts TCP connections."""
    if uri.startswith("file://"):
        root = file_root(uri)
        if root.is_dir():
            return Probe(healthy=True, detail="directory exists")
        return Probe(healthy=False, detail=f"{root} is missing")
    if endpoint is None:
        return Probe(healthy=False, detail="no S3 endpoint recorded")
    return tcp_probe(endpoint)
