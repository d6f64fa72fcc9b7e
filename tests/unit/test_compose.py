"""Static checks of docker-compose.yml and infra/ (no Docker on the build machines).

Each test pins a concrete relation that `docker compose up` depends on: pinned images, unique
host ports, listeners that match ports, scrape targets and datasource URLs that name real
services and ports, mounts of files that exist, dashboards that query Conveyor's metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load(ROOT / "docker-compose.yml")


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _port_pairs(service: dict[str, Any]) -> list[tuple[int, int]]:
    """(host port, container port) of every published port (short syntax)."""
    pairs = []
    for entry in service.get("ports", []):
        parts = str(entry).split("/")[0].split(":")
        assert len(parts) in (2, 3), f"publish ports as HOST:CONTAINER, got {entry!r}"
        pairs.append((int(parts[-2]), int(parts[-1])))
    return pairs


def container_ports(service: dict[str, Any]) -> set[int]:
    exposed = {int(str(port)) for port in service.get("expose", [])}
    return exposed | {container for _, container in _port_pairs(service)}


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of every volume entry (short syntax)."""
    return [tuple(str(v).split(":")[:2]) for v in service.get("volumes", [])]  # type: ignore[misc]


def _host_path(service: dict[str, Any], container_path: str) -> Path:
    """The file on this machine that a bind mount puts at ``container_path``."""
    for source, target in _mounts(service):
        if source.startswith("./") and (
            container_path == target or container_path.startswith(target.rstrip("/") + "/")
        ):
            return ROOT / source / container_path[len(target) :].lstrip("/")
    raise AssertionError(f"{container_path} is not inside any bind mount")


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(address if "://" in address else f"//{address}")
    assert parts.hostname and parts.port, f"no host:port in {address!r}"
    return parts.hostname, parts.port


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> {NAME: (host, port)}."""
    result = {}
    for item in value.split(","):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        result[name] = (host, int(port))
    return result


def test_every_service_has_a_pinned_image_or_a_build(services: dict[str, Any]) -> None:
    assert set(services) >= {"kafka", "minio", "minio-init", "jaeger", "prometheus", "grafana"}
    for name, service in services.items():
        if "build" in service:
            continue
        image = service["image"]
        repository, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag not in ("latest", "stable", "main"), f"{name}: floating tag {image!r}"
        assert repository and re.search(r"\d", tag), f"{name}: tag {tag!r} is not a version"


def test_infrastructure_images_are_the_expected_products(services: dict[str, Any]) -> None:
    assert services["kafka"]["image"].startswith("apache/kafka:3.9.")
    assert services["minio"]["image"].startswith("quay.io/minio/minio:RELEASE.2025-")
    assert services["minio-init"]["image"].startswith("quay.io/minio/mc:RELEASE.")
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", services["jaeger"]["image"])


def test_host_ports_are_unique(services: dict[str, Any]) -> None:
    published = [host for s in services.values() for host, _ in _port_pairs(s)]
    assert len(published) == len(set(published)), f"duplicate host ports in {published}"
    assert {9092, 9000, 16686, 4317, 4318, 9090, 3000} <= set(published)


def test_depends_on_targets_exist_and_conditions_hold(services: dict[str, Any]) -> None:
    for name, service in services.items():
        depends = service.get("depends_on", {})
        targets = depends if isinstance(depends, dict) else {t: {} for t in depends}
        for target, spec in targets.items():
            assert target in services, f"{name} depends on unknown service {target!r}"
            condition = (spec or {}).get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"
            if condition == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} must run once"


def test_long_running_services_have_healthchecks(services: dict[str, Any]) -> None:
    for name, service in services.items():
        if service.get("restart") != "no":
            assert "healthcheck" in service, f"{name} has no healthcheck"


def test_named_volumes_and_networks_are_declared_and_used(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    used = set()
    for name, service in compose["services"].items():
        for source, _ in _mounts(service):
            if not source.startswith(("./", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"
                used.add(source)
        for network in service.get("networks", []):
            assert network in compose["networks"], f"{name} uses undeclared network {network}"
    assert used == declared, f"declared but unused volumes: {declared - used}"


def test_bind_mounted_files_exist(services: dict[str, Any]) -> None:
    sources = [src for s in services.values() for src, _ in _mounts(s) if src.startswith("./")]
    assert len(sources) == 4
    for source in sources:
        assert (ROOT / source).exists(), f"mounted {source} does not exist"


def test_kafka_listeners_match_ports(services: dict[str, Any]) -> None:
    kafka = services["kafka"]
    env = _env(kafka)
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(
        item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert set(listeners) == set(protocols)
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert controller in listeners and controller not in advertised
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    # Each advertised listener is served on the port it advertises.
    for name, (_, port) in advertised.items():
        assert listeners[name][1] == port, f"{name} advertises {port}, listens on {listeners[name]}"
    # The host-facing listener is published 1:1 and advertised as localhost.
    host_facing = [n for n, (host, _) in advertised.items() if host == "localhost"]
    assert len(host_facing) == 1
    assert (advertised[host_facing[0]][1],) * 2 in _port_pairs(kafka)
    # The in-network listener is advertised under the service name containers resolve.
    in_network = {n: a for n, a in advertised.items() if n not in host_facing}
    assert [host for host, _ in in_network.values()] == ["kafka"]
    node, _, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].partition("@")
    assert node == str(env["KAFKA_NODE_ID"])
    assert _host_port(voter) == ("kafka", listeners[controller][1])
    assert "kafka-data:/var/lib/kafka/data" in kafka["volumes"]
    assert env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"


def test_kafka_message_limits_are_raised_together(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    env = _env(services["kafka"])
    message_max = int(env["KAFKA_MESSAGE_MAX_BYTES"])
    assert message_max == 32 * MiB
    assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= message_max
    assert int(env["KAFKA_SOCKET_REQUEST_MAX_BYTES"]) > message_max
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    client_max = int(
        compose["x-conveyor-service"]["environment"]["CONVEYOR_KAFKA_MAX_MESSAGE_BYTES"]
    )
    assert 0 < client_max < message_max


def test_conveyor_service_template_points_at_the_infrastructure(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    template = compose["x-conveyor-service"]
    assert template["build"]["dockerfile"] == "infra/Dockerfile"
    assert (ROOT / template["build"]["context"] / template["build"]["dockerfile"]).is_file()
    env = {k: str(v) for k, v in template["environment"].items()}

    kafka_env = _env(services["kafka"])
    advertised = _listeners(kafka_env["KAFKA_ADVERTISED_LISTENERS"])
    internal = advertised[kafka_env["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    assert _host_port(env["CONVEYOR_KAFKA_BOOTSTRAP"]) == internal

    s3_host, s3_port = _host_port(env["CONVEYOR_STORAGE_S3_ENDPOINT"])
    assert s3_host == "minio" and s3_port in container_ports(services["minio"])
    minio_env = _env(services["minio"])
    assert env["CONVEYOR_STORAGE_S3_ACCESS_KEY"] == minio_env["MINIO_ROOT_USER"]
    assert env["CONVEYOR_STORAGE_S3_SECRET_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    bucket = _env(services["minio-init"])["CONVEYOR_BUCKET"]
    assert env["CONVEYOR_STORAGE_URI"] == f"s3://{bucket}"

    otlp_host, otlp_port = _host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert (otlp_host, otlp_port) == ("jaeger", 4318)
    assert otlp_port in container_ports(services["jaeger"])

    telemetry_port = int(env["CONVEYOR_TELEMETRY_HTTP_PORT"])
    assert env["CONVEYOR_TELEMETRY_HTTP_HOST"] == "0.0.0.0"
    assert {int(p) for p in template["expose"]} == {telemetry_port}
    assert f":{telemetry_port}/healthz" in " ".join(template["healthcheck"]["test"])
    assert set(template["depends_on"]) <= set(services)


def test_minio_init_creates_the_bucket(services: dict[str, Any]) -> None:
    init = services["minio-init"]
    script = " ".join(init["command"])
    assert "mc mb --ignore-existing" in script and "$$CONVEYOR_BUCKET" in script
    assert "http://minio:9000" in script
    assert 9000 in container_ports(services["minio"])
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def test_prometheus_scrapes_compose_services_on_their_ports(services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    config_path = _host_path(prometheus, "/etc/prometheus/prometheus.yml")
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = _load(config_path)
    targets = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                targets[job["job_name"]] = _host_port(target)
    assert targets == {
        "prometheus": ("prometheus", 9090),
        "jaeger": ("jaeger", 8888),
        "minio": ("minio", 9000),
    }
    for host, port in targets.values():
        assert port in container_ports(services[host]), f"{host} does not expose {port}"
    assert _env(services["minio"])["MINIO_PROMETHEUS_AUTH_TYPE"] == "public"


@pytest.fixture(scope="module")
def datasources(services: dict[str, Any]) -> list[dict[str, Any]]:
    directory = _host_path(services["grafana"], "/etc/grafana/provisioning/datasources")
    files = sorted(directory.glob("*.yml"))
    assert files, "no datasource provisioning files"
    return [ds for f in files for ds in _load(f)["datasources"]]


def test_grafana_datasources_point_at_compose_services(
    services: dict[str, Any], datasources: list[dict[str, Any]]
) -> None:
    by_type = {ds["type"]: ds for ds in datasources}
    assert set(by_type) == {"prometheus", "jaeger"}
    assert _host_port(by_type["prometheus"]["url"]) == ("prometheus", 9090)
    assert _host_port(by_type["jaeger"]["url"]) == ("jaeger", 16686)
    for ds in datasources:
        host, port = _host_port(ds["url"])
        assert port in container_ports(services[host])
    assert len({ds["uid"] for ds in datasources}) == len(datasources)


@pytest.fixture(scope="module")
def dashboards(services: dict[str, Any]) -> list[dict[str, Any]]:
    grafana = services["grafana"]
    directory = _host_path(grafana, "/etc/grafana/provisioning/dashboards")
    providers = [p for f in sorted(directory.glob("*.yml")) for p in _load(f)["providers"]]
    assert [p["type"] for p in providers] == ["file"]
    dashboard_dir = _host_path(grafana, providers[0]["options"]["path"])
    files = sorted(dashboard_dir.glob("*.json"))
    assert files, f"no dashboards in {dashboard_dir}"
    home = _host_path(grafana, _env(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home in files
    return [json.loads(f.read_text()) for f in files]


def test_dashboard_panels_query_conveyor_metrics(
    dashboards: list[dict[str, Any]], datasources: list[dict[str, Any]]
) -> None:
    uids = {ds["uid"] for ds in datasources}
    metrics: set[str] = set()
    for dashboard in dashboards:
        panels = dashboard["panels"]
        assert panels, f"dashboard {dashboard['title']!r} has no panels"
        assert len({p["id"] for p in panels}) == len(panels)
        for panel in panels:
            assert panel["datasource"]["uid"] in uids
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                found = re.findall(r"\bconveyor_[a-z0-9_]+", target["expr"])
                assert found, f"panel {panel['title']!r} queries no conveyor_ metric"
                metrics.update(found)
    assert {"conveyor_bus_consumer_lag_records", "conveyor_bus_dead_letters_total"} <= metrics


def test_jaeger_config_matches_published_ports(services: dict[str, Any]) -> None:
    jaeger = services["jaeger"]
    assert jaeger["command"] == ["--config", "/etc/jaeger/config.yaml"]
    config = _load(_host_path(jaeger, "/etc/jaeger/config.yaml"))
    otlp = config["receivers"]["otlp"]["protocols"]
    endpoints = {
        "otlp grpc": otlp["grpc"]["endpoint"],
        "otlp http": otlp["http"]["endpoint"],
        "query http": config["extensions"]["jaeger_query"]["http"]["endpoint"],
        "health": config["extensions"]["healthcheckv2"]["http"]["endpoint"],
    }
    assert {k: _host_port(v) for k, v in endpoints.items()} == {
        "otlp grpc": ("0.0.0.0", 4317),
        "otlp http": ("0.0.0.0", 4318),
        "query http": ("0.0.0.0", 16686),
        "health": ("0.0.0.0", 13133),
    }
    reader = config["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]
    assert (reader["prometheus"]["host"], reader["prometheus"]["port"]) == ("0.0.0.0", 8888)
    assert {4317, 4318, 16686, 8888, 13133} <= container_ports(jaeger)
    assert "http://127.0.0.1:13133/status" in jaeger["healthcheck"]["test"]
    storage = config["extensions"]["jaeger_query"]["storage"]["traces"]
    assert storage in config["extensions"]["jaeger_storage"]["backends"]
    assert config["exporters"]["jaeger_storage_exporter"]["trace_storage"] == storage


def test_dockerfile_builds_a_non_root_conveyor_image() -> None:
    lines = [
        line.strip()
        for line in (ROOT / "infra" / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "FROM python:3.11-slim"
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert lines[-2:] == ['ENTRYPOINT ["conveyor"]', 'CMD ["--help"]']
    assert any(line.startswith("RUN pip install .") for line in lines)
    copied = [src for line in lines if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert copied == ["pyproject.toml", "README.md", "libs", "services", "cli"]
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    ignore = (ROOT / "infra" / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1 :][:5] == [
        "!pyproject.toml", "!README.md", "!libs/", "!services/", "!cli/",
    ]  # fmt: skip
