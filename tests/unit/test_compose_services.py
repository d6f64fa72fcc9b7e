"""Static checks of docker-compose.yml and infra/worker-node.compose.yml (no Docker on the build
machines): the services and the image they run from.

Each test pins a concrete relation that `docker compose up` depends on: the compose
specification's schema, pinned images, every registered Conveyor service in the file and
scalable, unique host ports on 127.0.0.1, dependencies, healthchecks and grace periods, mounts
of files that exist, an image that installs its locked dependencies before its code.
tests/e2e/test_compose_stack.py runs the Conveyor services of the file for real.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from compose_files import ROOT, TELEMETRY_PORT, _mounts, _port_pairs
from compose_model import (
    COMPOSE_FILE,
    WORKER_FILE,
    PublishedPort,
    conveyor_services,
    default_services,
    environment,
    load_compose,
    published_ports,
)
from jsonschema import Draft202012Validator

from conveyor.embedded import registry


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
    assert len(sources) == 5
    for source in sources:
        assert (ROOT / source).exists(), f"mounted {source} does not exist"


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
