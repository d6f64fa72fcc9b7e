"""Static checks of docker-compose.yml, infra/worker-node.compose.yml and infra/ (no Docker on
the build machines).

Each test pins a concrete relation that `docker compose up` depends on: the compose
specification's schema, pinned images, every registered Conveyor service in the file and
scalable, unique host ports on 127.0.0.1, listeners that match ports, scrape targets and
datasource URLs that name real services and ports, mounts of files that exist, dashboards that
query Conveyor's metrics, an image that installs its locked dependencies before its code.
tests/e2e/test_compose_stack.py runs the Conveyor services of the file for real.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from compose_model import (
    COMPOSE_FILE,
    WORKER_FILE,
    InterpolationError,
    PublishedPort,
    container_ports,
    conveyor_services,
    default_services,
    environment,
    load_compose,
    published_ports,
)
from jsonschema import Draft202012Validator

from conveyor.embedded import registry

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
TELEMETRY_PORT = 9100


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker-compose.yml as compose reads it with no variables set (every default applies)."""
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


_env = environment


def _port_pairs(service: dict[str, Any]) -> list[tuple[int, int]]:
    """(host port, container port) of every published port."""
    pairs = []
    for port in published_ports(service):
        assert port.host_port is not None, f"publish ports as HOST:CONTAINER, got {port}"
        pairs.append((port.host_port, port.container_port))
    return pairs


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
    assert {8080, 9092, 9000, 16686, 4317, 4318, 9090, 3000} <= set(published)


def test_ports_are_published_on_localhost_unless_asked_otherwise(
    services: dict[str, Any],
) -> None:
    ports = [port for service in services.values() for port in published_ports(service)]
    assert ports and {port.host_ip for port in ports} == {"127.0.0.1"}
    opened = load_compose(env={"PUBLISH_ADDRESS": "0.0.0.0", "GATEWAY_PORT": "18080"})
    reopened = [p for s in opened["services"].values() for p in published_ports(s)]
    assert {port.host_ip for port in reopened} == {"0.0.0.0"}
    gateway = published_ports(opened["services"]["gateway"])
    assert [(p.host_port, p.container_port) for p in gateway] == [(18080, TELEMETRY_PORT)]


@pytest.mark.parametrize(
    ("path", "env"),
    [
        (COMPOSE_FILE, {}),
        (COMPOSE_FILE, {"PUBLISH_ADDRESS": "0.0.0.0", "KAFKA_ADVERTISED_HOST": "stack.lan"}),
        (WORKER_FILE, {"STACK_HOST": "stack.lan"}),
    ],
    ids=["compose", "compose-published", "worker-node"],
)
def test_compose_files_follow_the_compose_specification(path: Path, env: dict[str, str]) -> None:
    # The schema of the compose specification as check-jsonschema vendors it (its
    # `check-compose-spec` hook): the file as compose validates it, after interpolation.
    source = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((source / "compose-spec.json").read_text())
    validator = Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(load_compose(path, env)), key=lambda e: e.json_path)
    assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_the_schema_check_catches_a_misspelt_key() -> None:
    source = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    validator = Draft202012Validator(json.loads((source / "compose-spec.json").read_text()))
    broken = load_compose()
    broken["services"]["trainer"]["healthchek"] = broken["services"]["trainer"].pop("healthcheck")
    assert [e.json_path for e in validator.iter_errors(broken)] == ["$.services.trainer"]


def test_every_registered_service_runs_from_the_one_image(compose: dict[str, Any]) -> None:
    conveyor = conveyor_services(compose)
    by_default = set(conveyor) & set(default_services(compose))
    # Adding a service to the registry (checkpointer, autoscaler) fails here until it is added.
    assert by_default == set(registry.deployed_services())
    template = compose["x-conveyor-service"]
    for name, service in conveyor.items():
        command = service["command"]
        assert command[0] == "service" and len(command) == 2, f"{name}: {command}"
        registry.resolve(command[1])  # a registered service, or UnknownServiceError
        assert command[1] == name.removesuffix("-gpu"), f"{name} runs {command[1]}"
        assert service["build"]["context"] == "." and service["image"].startswith("conveyor:")
        assert "container_name" not in service, f"{name} cannot scale with a container_name"
        assert service["healthcheck"] == template["healthcheck"]
        assert service["stop_grace_period"] == template["stop_grace_period"]
        if name != "gateway":
            assert "ports" not in service, f"{name} publishes a port: it could not scale"
        env = environment(service)
        assert environment(template).items() <= env.items(), f"{name} changes the template env"
    images = {service["image"] for service in conveyor.values() if not service.get("profiles")}
    assert images == {template["image"]}


def test_conveyor_services_wait_for_the_infrastructure_and_the_sharder(
    compose: dict[str, Any],
) -> None:
    for name, service in conveyor_services(compose).items():
        conditions = {target: spec["condition"] for target, spec in service["depends_on"].items()}
        expected = {
            "kafka": "service_healthy",
            "minio-init": "service_completed_successfully",
            "jaeger": "service_started",
        }
        if name != "sharder":  # the sharder creates the topics the others wait for
            expected["sharder"] = "service_healthy"
        assert conditions == expected, name


def test_the_gateway_publishes_its_api_port(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    (port,) = published_ports(gateway)
    assert port == PublishedPort("127.0.0.1", 8080, TELEMETRY_PORT)
    # The gateway serves its API on the telemetry port unless CONVEYOR_GATEWAY_PORT is set.
    assert "CONVEYOR_GATEWAY_PORT" not in environment(gateway)
    assert int(environment(gateway)["CONVEYOR_TELEMETRY_HTTP_PORT"]) == TELEMETRY_PORT


def test_gpu_profile_reserves_nvidia_devices_for_trainers(compose: dict[str, Any]) -> None:
    profiled = {n: s for n, s in compose["services"].items() if s.get("profiles")}
    assert {name: s["profiles"] for name, s in profiled.items()} == {"trainer-gpu": ["gpu"]}
    gpu = profiled["trainer-gpu"]
    assert gpu["command"] == ["service", "trainer"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert environment(gpu)["CONVEYOR_TRAINER_DEVICE"] == "cuda"
    assert "cu" in gpu["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1]
    assert gpu["image"] != compose["services"]["trainer"]["image"]
    # Scraped with the CPU trainers: the alias is the name Prometheus resolves.
    assert gpu["networks"]["conveyor"]["aliases"] == ["trainer"]
    assert not any("deploy" in s for n, s in compose["services"].items() if n != "trainer-gpu")


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, f"unsupported duration {duration!r}"
    return int(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match[2]]


def test_stop_grace_period_covers_drain_and_stop(compose: dict[str, Any]) -> None:
    from conveyor.platform.service import Service
    from conveyor.services.trainer.config import TrainerSettings

    defaults = Service.__init__.__kwdefaults__
    assert defaults is not None
    drain_s = max(defaults["drain_timeout_s"], TrainerSettings().drain_timeout_s)
    grace_s = _seconds(compose["x-conveyor-service"]["stop_grace_period"])
    assert grace_s > drain_s + defaults["stop_timeout_s"]


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
    assert telemetry_port == TELEMETRY_PORT
    assert env["CONVEYOR_TELEMETRY_HTTP_HOST"] == "0.0.0.0"
    assert {int(p) for p in template["expose"]} == {telemetry_port}
    assert f"http://127.0.0.1:{telemetry_port}/readyz" in " ".join(template["healthcheck"]["test"])
    assert set(template["depends_on"]) <= set(services)


def test_worker_node_joins_the_stack_through_its_published_ports(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    worker = load_compose(WORKER_FILE, {"STACK_HOST": "stack.lan"})
    template = environment(compose["x-conveyor-service"])
    published = {
        name: {p.container_port: p.host_port for p in published_ports(service)}
        for name, service in services.items()
    }
    kafka_env = _env(services["kafka"])
    advertised = _listeners(kafka_env["KAFKA_ADVERTISED_LISTENERS"])
    host_listener = [a for a in advertised.values() if a[0] == "localhost"]
    assert len(host_listener) == 1
    expected = {
        **template,
        # The stack's host-facing Kafka listener, MinIO's API and Jaeger's OTLP/HTTP port.
        "CONVEYOR_KAFKA_BOOTSTRAP": f"stack.lan:{published['kafka'][host_listener[0][1]]}",
        "CONVEYOR_STORAGE_S3_ENDPOINT": f"stack.lan:{published['minio'][9000]}",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://stack.lan:{published['jaeger'][4318]}",
    }
    for name, service in worker["services"].items():
        env = environment(service)
        assert {k: v for k, v in env.items() if k != "CONVEYOR_TRAINER_DEVICE"} == expected, name
        assert service["command"] in (["service", "trainer"], ["service", "preprocessor"]), name
        assert service["build"] == {**compose["x-conveyor-service"]["build"], "context": "..",
                                    **({"args": service["build"]["args"]}
                                       if "args" in service["build"] else {})}  # fmt: skip
        assert "ports" not in service and "container_name" not in service
        healthcheck = compose["x-conveyor-service"]["healthcheck"]
        assert service["healthcheck"]["test"] == healthcheck["test"], name
    assert set(worker["services"]) == {"trainer", "preprocessor", "trainer-gpu"}
    gpu = worker["services"]["trainer-gpu"]
    assert gpu["deploy"] == compose["services"]["trainer-gpu"]["deploy"]
    assert gpu["build"]["args"] == compose["services"]["trainer-gpu"]["build"]["args"]


def test_worker_node_refuses_to_start_without_the_stack_address() -> None:
    with pytest.raises(InterpolationError, match="STACK_HOST"):
        load_compose(WORKER_FILE)


def test_kafka_advertises_the_host_name_worker_nodes_use() -> None:
    kafka = load_compose(env={"KAFKA_ADVERTISED_HOST": "stack.lan"})["services"]["kafka"]
    advertised = _listeners(_env(kafka)["KAFKA_ADVERTISED_LISTENERS"])
    assert ("stack.lan", 9092) in advertised.values()


def test_minio_init_creates_the_bucket(services: dict[str, Any]) -> None:
    init = services["minio-init"]
    script = " ".join(init["command"])
    # After interpolation: `$$` in the file is the `$` the container's shell expands.
    assert "mc mb --ignore-existing" in script and '"store/$CONVEYOR_BUCKET"' in script
    assert "http://minio:9000" in script
    assert 9000 in container_ports(services["minio"])
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def prometheus_config(services: dict[str, Any]) -> dict[str, Any]:
    prometheus = services["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    return _load(_host_path(prometheus, "/etc/prometheus/prometheus.yml"))


def test_prometheus_scrapes_compose_services_on_their_ports(services: dict[str, Any]) -> None:
    config = prometheus_config(services)
    targets = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
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


def test_prometheus_discovers_every_replica_of_every_conveyor_service(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    (job,) = [j for j in prometheus_config(services)["scrape_configs"] if "dns_sd_configs" in j]
    assert "static_configs" not in job
    (sd,) = job["dns_sd_configs"]
    # Type A: compose's DNS answers a service name with the address of each of its replicas.
    assert sd["type"] == "A"
    conveyor = conveyor_services(compose)
    assert set(sd["names"]) == set(conveyor) & set(default_services(compose))
    for name, service in conveyor.items():
        assert int(environment(service)["CONVEYOR_TELEMETRY_HTTP_PORT"]) == sd["port"], name
        assert sd["port"] in container_ports(service)
        networks = service["networks"]
        aliases = networks["conveyor"]["aliases"] if isinstance(networks, dict) else []
        assert name in sd["names"] or set(aliases) & set(sd["names"]), f"{name} is not scraped"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert {"source_labels": ["__meta_dns_name"], "target_label": "service"} in job[
        "relabel_configs"
    ]


def test_promtool_accepts_the_scrape_configuration(services: dict[str, Any]) -> None:
    if shutil.which("promtool") is None:
        # .ci/run installs Debian's prometheus and sets CONVEYOR_REQUIRE_SERVERS: no skip there.
        if os.environ.get("CONVEYOR_REQUIRE_SERVERS"):
            pytest.fail("promtool (Debian's prometheus) is required here but not installed")
        pytest.skip("promtool (Prometheus) not installed: apt-get install prometheus")
    path = _host_path(services["prometheus"], "/etc/prometheus/prometheus.yml")
    done = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


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
                # A metric by name, or a family by name pattern (the services' build_info).
                found = re.findall(
                    r'\bconveyor_[a-z0-9_]+|__name__=~"conveyor_[^"]+"', target["expr"]
                )
                assert found, f"panel {panel['title']!r} queries no conveyor_ metric"
                metrics.update(found)
    assert {
        "conveyor_bus_consumer_lag_records",
        "conveyor_bus_dead_letters_total",
        "conveyor_trainer_samples_total",
        "conveyor_trainer_data_wait_ratio",
        "conveyor_trainer_gpu_utilization_ratio",
        "conveyor_checkpointer_checkpoint_seconds_bucket",
        "conveyor_autoscaler_replicas",
        "conveyor_gateway_request_seconds_bucket",
    } <= metrics


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


def _dockerfile_lines() -> list[str]:
    return [
        line.strip()
        for line in (ROOT / "infra" / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_builds_a_non_root_conveyor_image() -> None:
    lines = _dockerfile_lines()
    assert lines[0] == "FROM python:3.11-slim"
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert lines[-2:] == ['ENTRYPOINT ["conveyor"]', 'CMD ["--help"]']
    copied = [src for line in lines if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert copied == ["requirements.lock", "pyproject.toml", "README.md", "libs", "services", "cli"]
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    ignore = (ROOT / "infra" / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1 :][:6] == [
        "!requirements.lock", "!pyproject.toml", "!README.md", "!libs/", "!services/", "!cli/",
    ]  # fmt: skip


def test_dockerfile_installs_locked_dependencies_before_the_code() -> None:
    lines = _dockerfile_lines()

    def index(prefix: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert len(found) == 1, f"expected one line starting {prefix!r}, got {len(found)}"
        return found[0]

    torch = index('RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"')
    lock = index("RUN pip install -r requirements.lock")
    code = index("COPY libs ")
    install = index("RUN pip install --no-deps . && pip check")
    # Layer caching: torch, then the locked dependencies, then the code; a code change
    # rebuilds only the last layers and the code's install resolves nothing.
    assert torch < index("COPY requirements.lock ") < lock < index("COPY pyproject.toml ") < code
    assert code < install
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in lines
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in lines
