"""Typed settings shared by every process, read once at the edge.

Settings come from (highest priority first) constructor arguments, environment
variables (``CONVEYOR_...``), a TOML file named by ``CONVEYOR_CONFIG``, then
defaults. Services build their own settings class from these parts in their
``config.py`` and pass the resulting objects down explicitly.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from conveyor.platform.roots import Roots, resolve_location

MiB = 1024 * 1024

CONFIG_FILE_ENV = "CONVEYOR_CONFIG"


RETIRED_ENV: dict[str, str] = {
    "CONVEYOR_SHARDER_JOBS_PARTITIONS": "CONVEYOR_TOPOLOGY_JOBS_PARTITIONS",
    "CONVEYOR_SHARDER_SHARDS_PARTITIONS": "CONVEYOR_TOPOLOGY_SHARDS_PARTITIONS",
    "CONVEYOR_SHARDER_BATCHES_PARTITIONS_PER_TRAINER": (
        "CONVEYOR_TOPOLOGY_BATCHES_PARTITIONS_PER_TRAINER"
    ),
    "CONVEYOR_SHARDER_MIN_BATCHES_PARTITIONS": "CONVEYOR_TOPOLOGY_MIN_BATCHES_PARTITIONS",
    "CONVEYOR_GATEWAY_JOBS_PARTITIONS": "CONVEYOR_TOPOLOGY_JOBS_PARTITIONS",
    "CONVEYOR_PREPROCESSOR_JOBS_PARTITIONS": "CONVEYOR_TOPOLOGY_JOBS_PARTITIONS",
    "CONVEYOR_PREPROCESSOR_SHARDS_PARTITIONS": "CONVEYOR_TOPOLOGY_SHARDS_PARTITIONS",
}
"""Environment variables that are no longer read -> what replaced them. Unknown variables
under a settings prefix are otherwise ignored silently; these would change nothing."""


def check_retired_env(environ: Mapping[str, str]) -> None:
    """ValueError naming every retired variable set in ``environ`` and its replacement."""
    found = [f"{old} is no longer read: set {new}" for old, new in RETIRED_ENV.items()
             if old in environ]  # fmt: skip
    if found:
        raise ValueError("; ".join(found))


def worker_id_field(role: str) -> Any:
    """The ``worker_id`` setting of a process that publishes as itself (trainer, aggregator):
    its id in logs, events and heartbeats, by default ``<role>-<host>-<pid>``."""
    return Field(
        default_factory=lambda: f"{role}-{socket.gethostname()}-{os.getpid()}",
        min_length=1,
        max_length=128,
        description=(
            f"Id of this process in logs, events and heartbeats; default {role}-<host>-<pid>."
        ),
    )


class _FileAwareSettings(BaseSettings):
    """Adds the optional TOML file (``CONVEYOR_CONFIG``) below env vars."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(CONFIG_FILE_ENV)
        if path:
            if not Path(path).is_file():
                raise ValueError(f"{CONFIG_FILE_ENV}={path!r} is not a readable file")
            section = _section_for(settings_cls)
            toml_source = TomlConfigSettingsSource(settings_cls, toml_file=path)
            sources.append(_SectionSource(settings_cls, toml_source, section))
        return tuple(sources)


def _section_for(settings_cls: type[BaseSettings]) -> str:
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    return prefix.removeprefix("CONVEYOR_").rstrip("_").lower()


class _SectionSource(PydanticBaseSettingsSource):
    """Reads one ``[section]`` of the TOML file (``[kafka]``, ``[storage]``...)."""

    def __init__(
        self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource, section: str
    ) -> None:
        super().__init__(settings_cls)
        self._inner = inner
        self._section = section

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        data = self._inner()
        if not self._section:
            return data
        section = data.get(self._section, {})
        if not isinstance(section, dict):
            raise ValueError(f"config section [{self._section}] must be a table")
        return section


class KafkaSettings(_FileAwareSettings):
    """How to reach the broker and how big messages may be."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_KAFKA_", frozen=True, extra="forbid")

    bootstrap: str = Field(
        default="127.0.0.1:9092", description="Comma-separated host:port list of the brokers."
    )
    topic_prefix: str = Field(default="conveyor.", description="Prefix of every topic name.")
    client_id: str = Field(default="conveyor", description="Client id sent to the broker.")
    max_message_bytes: Annotated[int, Field(gt=0, le=256 * MiB)] = Field(
        default=16 * MiB,
        description=(
            "Largest record the bus will produce or accept. Producer max_request_size, "
            "consumer fetch sizes and the topics' max.message.bytes are all derived from it."
        ),
    )
    request_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    session_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=6.0,
        description=(
            "Consumer-group session timeout. Short enough that a dead member is noticed fast "
            "and that the embedded broker, which completes a join after half of it, joins "
            "quickly (a job's trainers wait for their batches group's join before their first "
            "step: 3 s at 6, 5 s at 10); 6 s is also the least a Kafka broker accepts by "
            "default (group.min.session.timeout.ms)."
        ),
    )
    heartbeat_interval_s: Annotated[float, Field(gt=0)] = 2.0
    max_poll_interval_s: Annotated[float, Field(gt=0)] = 300.0
    linger_ms: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description=(
            "How long a producer holds a record to batch it with others. 0 because every "
            "gradient-plane hop waits for it (5 ms made sync steps ~30% longer on the digits "
            "demo); raise it for throughput-bound producers on a busy cluster."
        ),
    )
    fetch_max_wait_ms: Annotated[int, Field(ge=0, le=10_000)] = Field(
        default=500,
        description=(
            "Longest a fetch waits at the broker for new records (aiokafka's default is 500 "
            "ms); the gradient plane's readers use plane_fetch_max_wait_ms instead. The "
            "embedded broker holds a fetch for part of this even when records arrive (hop "
            "median ~9 ms at 50, ~30 ms at 200), and every empty fetch costs CPU in the client "
            "and the broker: an idle embedded stack used 15% of a core at 200, 10% at 500 and "
            "9% at 1000; 500 also cut Conveyor's CPU per sample ~15% in bench_decode on 2 "
            "cores. Lower it where a reader's hop latency matters more than idle CPU."
        ),
    )
    plane_fetch_max_wait_ms: Annotated[int, Field(ge=0, le=10_000)] = Field(
        default=10,
        description=(
            "fetch_max_wait_ms of the gradient plane's readers (control, grads, params topics): "
            "every training step waits on three of their hops (~3 ms each at 5, ~5 at 10), "
            "while a shorter wait means more empty fetches, whose CPU the trainers' compute "
            "then lacks on a shared machine."
        ),
    )
    producer_metadata_idle_s: Annotated[float, Field(gt=0)] = Field(
        default=120.0,
        description=(
            "A producer stops tracking the metadata of a topic it has not sent to for this "
            "long (a finished job's, deleted by the sharder); a later send tracks it again. "
            "aiokafka otherwise asks for every topic it ever sent to at each metadata refresh "
            "and logs an error for each deleted one, more with every job."
        ),
    )
    topic_wait_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description=(
            "How long a reader waits for the broker to list its topic before it gives up "
            "with a retriable error: a job's processes may ask for its topics before the "
            "broker lists them (see conveyor.platform.bus.topic_wait)."
        ),
    )
    replication_factor: Annotated[int, Field(ge=1)] = 1

    @field_validator("bootstrap")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("bootstrap must name at least one host:port")
        return value

    def for_gradient_plane(self) -> KafkaSettings:
        """These settings with the gradient plane's short fetch wait."""
        return self.model_copy(update={"fetch_max_wait_ms": self.plane_fetch_max_wait_ms})


class StorageSettings(_FileAwareSettings):
    """Where objects (checkpoints, datasets, exports) live, and where jobs may put and find them.

    A job spec may name where its checkpoints and exported model go (``checkpoint.uri``) and
    where its dataset is read from (``dataset.uri``); both must lie inside roots listed here
    (:mod:`conveyor.platform.roots` says what "inside" means). The object store (``uri``) is
    always a root of both kinds.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_STORAGE_", frozen=True, extra="forbid")

    uri: str = Field(
        default="file://./.conveyor/objects",
        description="file://<dir> or s3://<bucket>[/prefix] root of the object store.",
    )
    s3_endpoint: str | None = Field(
        default=None, description="host:port of the S3 endpoint (MinIO, AWS, ...)."
    )
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str | None = None
    s3_secure: bool = Field(default=False, description="Use HTTPS to reach the S3 endpoint.")
    output_roots: tuple[str, ...] = Field(
        default=(),
        description=(
            "Where jobs may write (checkpoint.uri: their checkpoints and exported model) "
            "besides the object store, which is always allowed: file://<dir>, <dir> or "
            "s3://<bucket>[/prefix]. A JSON list in the environment."
        ),
    )
    dataset_roots: tuple[str, ...] = Field(
        default=(),
        description=(
            "Where jobs may read datasets (dataset.uri) besides the object store, which is "
            "always allowed: file://<dir>, <dir> or s3://<bucket>[/prefix]. A JSON list in the "
            "environment."
        ),
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if not value.startswith(("file://", "s3://")):
            raise ValueError("storage uri must start with file:// or s3://")
        return value

    @field_validator("output_roots", "dataset_roots")
    @classmethod
    def _usable_roots(cls, roots: tuple[str, ...]) -> tuple[str, ...]:
        for root in roots:
            resolve_location(root)  # ValueError naming what is wrong with it
        return roots

    def allowed_output_roots(self) -> Roots:
        """Where a job may write: the object store and ``output_roots``, normalised now."""
        return Roots.resolve(
            "output", "CONVEYOR_STORAGE_OUTPUT_ROOTS", (self.uri, *self.output_roots)
        )

    def allowed_dataset_roots(self) -> Roots:
        """Where a job may read its dataset: the object store and ``dataset_roots``,
        normalised now."""
        return Roots.resolve(
            "dataset", "CONVEYOR_STORAGE_DATASET_ROOTS", (self.uri, *self.dataset_roots)
        )


class TelemetrySettings(_FileAwareSettings):
    """Logging, tracing and metrics of one process."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_TELEMETRY_", frozen=True, extra="forbid")

    log_level: str = "INFO"
    log_json: bool = Field(default=False, description="One JSON object per log line.")
    otlp_endpoint: str | None = Field(
        default_factory=lambda: os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OTLP/HTTP endpoint; tracing exports only when set.",
    )
    trace_sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        default=1.0,
        description=(
            "Share of new traces kept (1: every batch, for development; 0.01 in production). "
            "Decided where a trace starts (a shard release, an HTTP request) and followed by "
            "every span after it, in every process, so a batch's chain is whole or absent. "
            "A process without an OTLP endpoint starts no sampled trace (nothing would "
            "receive its spans)."
        ),
    )
    http_host: str = Field(default="127.0.0.1", description="Bind address of /healthz, /metrics.")
    http_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        default=0, description="Port of /healthz, /readyz and /metrics; 0 picks a free one."
    )


class TopologySettings(_FileAwareSettings):
    """Partition counts of the topics (the layout is :class:`~conveyor.platform.messages.Topics`).

    Read by the topics' one owner, the sharder, which creates the global topics on start and a
    job's topics when it plans the job; the other services create no topic.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_TOPOLOGY_", frozen=True, extra="forbid")

    jobs_partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=4, description="Partitions of the jobs topic: the most sharders that share jobs."
    )
    shards_partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=8,
        description="Partitions of the shards topic: the most preprocessors that work at once.",
    )
    batches_partitions_per_trainer: Annotated[int, Field(ge=1, le=64)] = Field(
        default=2, description="Partitions of a job's batches topic per trainer the job wants."
    )
    min_batches_partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=2, description="Fewest partitions of a job's batches topic."
    )

    def batches_partitions(self, trainers: int) -> int:
        """Partitions of a job's batches topic for a job that wants ``trainers`` trainers."""
        return max(self.min_batches_partitions, self.batches_partitions_per_trainer * trainers)
