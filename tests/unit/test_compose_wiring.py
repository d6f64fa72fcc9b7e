"""Static checks of docker-compose.yml and infra/worker-node.compose.yml (no Docker on the build
machines): how the services reach each other. Kafka's listeners match its ports and its message
limits are raised together, the Conveyor service template points at the infrastructure, a worker
node joins the stack through its published ports, MinIO's init creates the bucket.
"""

from __future__ import annotations

from typing import Any

import pytest
from compose_files import ROOT, TELEMETRY_PORT, _env, _host_port, _listeners, _port_pairs
from compose_model import (
    WORKER_FILE,
    InterpolationError,
    container_ports,
    environment,
    load_compose,
    published_ports,
)

MiB = 1024 * 1024


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
