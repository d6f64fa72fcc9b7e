"""docker-compose.yml run without Docker: every Conveyor service of the file runs as a local
process with exactly the entrypoint, command and environment compose would give its container,
and a job trains through the gateway's published port.

What stands in for Docker:
- **Containers** are processes, each with its own loopback address (127.A.B.n, one per
  container), so every replica binds the same port the file gives it (9100) as containers do.
  Inside a container ``0.0.0.0``, ``127.0.0.1`` and ``localhost`` are the container itself: they
  become its address. Compose's DNS becomes a rewrite of service names in ``host:port``
  positions (``kafka:19092`` -> ``127.A.B.1:19092``); a name that is not a service of the file
  stays as it is and fails to resolve, as it would in compose.
- **Infrastructure**: Kafka is the embedded broker (Tansu) on the address and port of the
  inter-broker listener the file advertises; MinIO is a moto S3 server on MinIO's API port, the
  bucket made as ``minio-init`` would with the credentials of the ``minio`` service; Jaeger is
  an OTLP/HTTP receiver on its OTLP port; the Docker Engine the autoscaler drives (the socket
  the file mounts) is a stand-in Engine API (tests/engine_servers.py) that lists the emulated
  preprocessor containers with their compose labels.
- ``depends_on`` runs in the file's order, ``service_healthy`` by running the service's own
  healthcheck command until it passes; ``--scale preprocessor=2 --scale trainer=2``.

So a wrong command, variable, host name or port in the file fails here: a service that does not
start or become healthy, a broker or store it cannot reach, a gateway not on its published port,
a replica Prometheus cannot scrape on the port its configuration names, no traces at Jaeger's.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from compose_model import (
    ROOT,
    PublishedPort,
    conveyor_services,
    default_services,
    environment,
    load_compose,
    published_ports,
    start_order,
)
from e2e_stack import ACTIVE, digits_spec, metric_values, pack_dataset, wait_for, write_digits_npz
from engine_servers import DockerEngine, serving
from otlp_receiver import OtlpReceiver
from trace_chain import PROBES, Spans, batch_chain

from conveyor.cli.client import TERMINAL_STATES, GatewayClient
from conveyor.embedded import registry
from conveyor.embedded.broker import EmbeddedBroker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCALE = {"preprocessor": 2, "trainer": 2}
"""`docker compose up --scale preprocessor=2 --scale trainer=2`."""
MINIO_API_PORT = 9000
"""MinIO's default --address (the file's `minio` command does not change it)."""
JAEGER_OTLP_HTTP_PORT = 4318
HEALTH_DEADLINE_S = 180.0
"""Longest wait for one service to turn healthy on two loaded cores (compose would allow
start_period + retries x interval = 110 s; the shared test machine is slower)."""
_OWN_ADDRESS = re.compile(r"(?<![\w.])(?:0\.0\.0\.0|127\.0\.0\.1|localhost)(?![\w.])")


class Network:
    """The compose network: one loopback address per container, names resolved to them."""

    def __init__(self) -> None:
        # A random 127.A.B.0/24 per run: concurrent runs on one machine do not collide.
        self._prefix = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
        self._last = 0
        self.addresses: dict[str, list[str]] = {}
        """Name (service or alias) -> the addresses of its containers, as compose's DNS."""

    def attach(self, *names: str) -> str:
        self._last += 1
        assert self._last < 255, "more containers than one /24 holds"
        address = f"{self._prefix}.{self._last}"
        for name in names:
            self.addresses.setdefault(name, []).append(address)
        return address

    def rewrite(self, text: str, own: str | None = None) -> str:
        """``text`` as seen from the container at ``own``: service names in ``host:port``
        positions resolved, the container's own addresses replaced by ``own``."""
        if own is not None:
            text = _OWN_ADDRESS.sub(own, text)
        names = sorted(self.addresses, key=len, reverse=True)
        if not names:
            return text
        pattern = re.compile(rf"(?<![\w.-])({'|'.join(map(re.escape, names))})(?=:\d)")
        return pattern.sub(lambda m: self.addresses[m[1]][0], text)


@dataclass
class Container:
    """One replica of a Conveyor service, run as a process."""

    name: str
    service: str
    address: str
    env: dict[str, str]
    workdir: Path
    process: subprocess.Popen[bytes]

    @property
    def log_path(self) -> Path:
        return self.workdir / "container.log"


@dataclass
class ComposeRun:
    """The Conveyor services of the file, running; ``log_tails`` feeds failure reports."""

    state_dir: Path
    compose: dict[str, Any]
    network: Network
    jaeger: OtlpReceiver
    docker_url: str
    """The stand-in Docker Engine API that replaces the socket the autoscaler mounts."""
    containers: list[Container] = field(default_factory=list)

    def log_tails(self, lines: int = 40) -> str:
        parts = []
        for container in self.containers:
            path = container.log_path
            tail = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            parts.append(f"----- {container.name} ({container.address})\n" + "\n".join(tail))
        return "\n".join(parts)

    def of(self, service: str) -> list[Container]:
        return [c for c in self.containers if c.service == service]

    def kill(self) -> None:
        """SIGKILL whatever still runs (a failed test's leftovers)."""
        for container in self.containers:
            if container.process.poll() is None:
                os.killpg(container.process.pid, signal.SIGKILL)
                container.process.wait()


def image_entrypoint() -> list[str]:
    """The ENTRYPOINT of infra/Dockerfile (exec form)."""
    lines = (ROOT / "infra" / "Dockerfile").read_text().splitlines()
    (line,) = [line for line in lines if line.startswith("ENTRYPOINT ")]
    entrypoint: list[str] = json.loads(line.removeprefix("ENTRYPOINT "))
    return entrypoint


def container_base_env(workdir: Path) -> dict[str, str]:
    """What the image gives every container before compose's variables: a PATH on which
    ``conveyor`` and ``python`` are this project's, a home. Nothing else from this process's
    environment, except the OpenBLAS settings this machine needs (ENVIRONMENT notes)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir)}
    env.update({k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")})
    return env


def run_healthcheck(container: Container, healthcheck: dict[str, Any], network: Network) -> bool:
    """One run of the service's healthcheck inside ``container``; True when it passes."""
    test = healthcheck["test"]
    assert test[0] == "CMD", f"{container.service}: only exec-form healthchecks are emulated"
    argv = [network.rewrite(arg, container.address) for arg in test[1:]]
    timeout_s = float(str(healthcheck["timeout"]).removesuffix("s"))
    try:
        done = subprocess.run(
            argv, env=container.env, cwd=container.workdir, capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def wait_healthy(container: Container, healthcheck: dict[str, Any], network: Network) -> None:
    deadline = time.monotonic() + HEALTH_DEADLINE_S
    while not run_healthcheck(container, healthcheck, network):
        code = container.process.poll()
        assert code is None, f"{container.name} exited with {code} before it was healthy"
        assert time.monotonic() < deadline, f"{container.name} not healthy in time"
        time.sleep(1.0)


@pytest.fixture
def compose_run(tmp_path: Path) -> Iterator[ComposeRun]:
    compose = load_compose()
    services = compose["services"]
    network = Network()

    # -- infrastructure -------------------------------------------------------------------
    kafka = environment(services["kafka"])
    listeners = dict(
        item.split("://", 1) for item in kafka["KAFKA_ADVERTISED_LISTENERS"].split(",")
    )
    internal = listeners[kafka["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    internal_host, _, internal_port = internal.rpartition(":")
    assert internal_host == "kafka"
    kafka_address = network.attach("kafka")
    minio_address = network.attach("minio")
    jaeger_address = network.attach("jaeger")
    from moto.server import ThreadedMotoServer

    ready = {"kafka": "service_healthy", "minio-init": "service_completed_successfully",
             "jaeger": "service_started"}  # fmt: skip
    with contextlib.ExitStack() as cleanup:
        kafka_log = tmp_path / "kafka.log"
        cleanup.enter_context(
            EmbeddedBroker(host=kafka_address, port=int(internal_port), log_path=kafka_log)
        )
        s3 = ThreadedMotoServer(ip_address=minio_address, port=MINIO_API_PORT, verbose=False)
        s3.start()
        cleanup.callback(s3.stop)
        receiver = cleanup.enter_context(
            OtlpReceiver(host=jaeger_address, port=JAEGER_OTLP_HTTP_PORT)
        )
        engine = DockerEngine()
        project = environment(services["autoscaler"])["CONVEYOR_AUTOSCALER_DOCKER_PROJECT"]
        for number in range(1, SCALE["preprocessor"] + 1):
            engine.add(project=project, service="preprocessor", number=number)
        docker_url = cleanup.enter_context(serving(engine))
        run = ComposeRun(state_dir=tmp_path, compose=compose, network=network, jaeger=receiver,
                         docker_url=docker_url)  # fmt: skip
        ACTIVE.append(run)  # type: ignore[arg-type]  # duck-typed: state_dir and log_tails()
        cleanup.callback(ACTIVE.remove, run)  # type: ignore[arg-type]
        cleanup.callback(run.kill)
        yield from _start_services(run, ready)


def _start_services(run: ComposeRun, ready: dict[str, str]) -> Iterator[ComposeRun]:
    """Create the bucket as minio-init would, start the Conveyor services in depends_on order
    (scaled by :data:`SCALE`) and wait until every one is healthy; yield the run."""
    compose, network, tmp_path = run.compose, run.network, run.state_dir
    services = compose["services"]
    minio_address = network.addresses["minio"][0]
    minio = environment(services["minio"])
    from minio import Minio

    Minio(
        f"{minio_address}:{MINIO_API_PORT}",
        access_key=minio["MINIO_ROOT_USER"],
        secret_key=minio["MINIO_ROOT_PASSWORD"],
        secure=False,
    ).make_bucket(environment(services["minio-init"])["CONVEYOR_BUCKET"])

    # The Conveyor services, in depends_on order.
    conveyor = {
        name: service
        for name, service in conveyor_services(compose).items()
        if name in default_services(compose)
    }
    order = [name for name in start_order(services) if name in conveyor]
    entrypoint = image_entrypoint()
    for name in order:
        service = conveyor[name]
        for dependency, spec in service["depends_on"].items():
            if dependency in conveyor:
                assert spec["condition"] == "service_healthy"
                for container in run.of(dependency):
                    wait_healthy(container, conveyor[dependency]["healthcheck"], network)
            else:
                assert ready.get(dependency) == spec["condition"], (
                    f"{name} waits for {dependency}: {spec['condition']}, not emulated"
                )
        networks = service["networks"]
        aliases = networks["conveyor"].get("aliases", []) if isinstance(networks, dict) else []
        replicas = SCALE.get(name, 1)
        for index in range(1, replicas + 1):
            address = network.attach(name, *aliases)
            instance = f"{name}-{index}"
            workdir = tmp_path / instance
            workdir.mkdir()
            env = container_base_env(workdir)
            compose_env = environment(service)
            env.update({k: network.rewrite(v, address) for k, v in compose_env.items()})
            if name == "autoscaler":
                assert env["CONVEYOR_AUTOSCALER_DOCKER_URL"] == "unix:///var/run/docker.sock"
                env["CONVEYOR_AUTOSCALER_DOCKER_URL"] = run.docker_url
            argv = [network.rewrite(arg, address) for arg in [*entrypoint, *service["command"]]]
            with open(workdir / "container.log", "ab") as log:
                process = subprocess.Popen(
                    argv, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            run.containers.append(Container(instance, name, address, env, workdir, process))
    for container in run.containers:  # `docker compose up --wait`
        wait_healthy(container, conveyor[container.service]["healthcheck"], network)
    yield run


def test_compose_services_train_a_job_through_the_published_gateway_port(
    compose_run: ComposeRun, tmp_path: Path
) -> None:
    run, network, compose = compose_run, compose_run.network, compose_run.compose
    (gateway,) = run.of("gateway")
    (published,) = published_ports(compose["services"]["gateway"])
    assert published == PublishedPort("127.0.0.1", 8080, published.container_port)
    gateway_url = f"http://{gateway.address}:{published.container_port}"

    # A user packs the dataset into the stack's object store (the image carries no
    # scikit-learn) and trains it: the digits, one epoch, two trainers.
    template = environment(compose["x-conveyor-service"])
    store_env = {
        k: network.rewrite(v) for k, v in template.items() if k.startswith("CONVEYOR_STORAGE_")
    }
    bucket = template["CONVEYOR_STORAGE_URI"].removeprefix("s3://")
    uri = pack_dataset(
        write_digits_npz(tmp_path / "digits.npz"), f"s3://{bucket}/datasets/digits",
        shard_size=300, env=store_env,
    )  # fmt: skip
    assert uri == f"npz://s3://{bucket}/datasets/digits"
    spec = digits_spec("digits-compose", epochs=1)
    spec["dataset"] = {"uri": uri, "eval_fraction": 0.2}
    spec["distribution"] = {"trainers": 2, "aggregator_shards": 1, "mode": "sync"}

    with GatewayClient(gateway_url) as client:
        job_id = str(client.submit(spec)["id"])
        job = wait_for(
            lambda: (j := client.job(job_id))["state"] in TERMINAL_STATES and j,
            timeout_s=300, interval_s=0.5, what=f"job {job_id} to finish",
        )  # fmt: skip
    assert job["state"] == "completed", job.get("reason")
    (epoch,) = job["epochs"]
    print(f"compose job: eval_accuracy={epoch['eval_accuracy']:.3f}")
    assert epoch["eval_accuracy"] >= 0.5, epoch  # 10 classes: chance is 0.1

    # Prometheus: every replica of every Conveyor service answers on the port and path its
    # scrape configuration names, under the name its DNS discovery resolves.
    config = yaml.safe_load((ROOT / "infra" / "prometheus" / "prometheus.yml").read_text())
    (job_config,) = [j for j in config["scrape_configs"] if "dns_sd_configs" in j]
    (sd,) = job_config["dns_sd_configs"]
    scraped: dict[str, float] = {}
    for name in sd["names"]:
        for address in network.addresses[name]:
            response = httpx.get(f"http://{address}:{sd['port']}/metrics", timeout=5)
            assert response.status_code == 200, f"{name} at {address}"
            values = metric_values(response.text)
            assert any(sample.startswith("conveyor_") for sample, _ in values), name
            scraped[f"{name}@{address}"] = sum(
                v for (sample, _), v in values.items() if sample.endswith("_batches_total")
            )
    assert (
        len(scraped)
        == len(run.containers)
        == sum(SCALE.get(n, 1) for n in registry.deployed_services())
    )
    for service in ("preprocessor", "trainer"):
        assert sum(v for k, v in scraped.items() if k.startswith(f"{service}@")) > 0, scraped

    # `docker compose down`: SIGTERM, then every service exits 0 within its stop_grace_period.
    grace_s = float(compose["x-conveyor-service"]["stop_grace_period"].removesuffix("s"))
    for container in reversed(run.containers):
        os.killpg(container.process.pid, signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for container in run.containers:
        try:
            codes[container.name] = container.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            codes[container.name] = None
    assert set(codes.values()) == {0}, codes

    # Jaeger: each service exported its spans to the OTLP endpoint the file gives it.
    traced = {span.service_name for span in run.jaeger.spans}
    assert set(registry.deployed_services()) <= traced, traced
    assert_traces(Spans(run.jaeger.spans), job_id)


def assert_traces(spans: Spans, job_id: str) -> None:
    """One batch's chain crosses every pipeline service with a parent at each hop; fan-ins are
    links; names are templated; probes are not traced; the job's submission is a span that
    its shard releases link to."""
    chain = batch_chain(spans)
    (trace_id,) = {span.trace_id for span in chain.values()}
    services = {stage: span.service_name for stage, span in chain.items()}
    assert set(services.values()) == {"sharder", "preprocessor", "trainer", "aggregator"}
    assert services["aggregate"] == "aggregator" and services["load params"] == "trainer"
    print(f"compose traces: one batch's trace {trace_id}, stages {list(chain)}")
    # Fan-in: each aggregation of two trainers' gradients continues one and links the other.
    grad_sends = {s.span_id for s in spans.named("send conveyor.job.{id}.grads")}
    aggregates = spans.named("aggregate")
    assert any(a.links for a in aggregates)
    assert all(span_id in grad_sends for a in aggregates for _, span_id in a.links)
    # Names: the destination template, never a job id.
    assert not [s.name for s in spans.all if job_id in s.name]
    for span in spans.all:
        if template := span.attributes.get("messaging.destination.template"):
            assert span.name.endswith(f" {template}"), span
    # The healthchecks polled /readyz and the test scraped /metrics: no span of theirs.
    assert not [s.name for s in spans.all if any(probe in s.name for probe in PROBES)]
    # The submission: a span of the gateway's request, in the trace that plans the job, which
    # the batch's shard release links to.
    (submit,) = [s for s in spans.named("submit job") if s.attributes["conveyor.job_id"] == job_id]
    request = spans.parent(submit)
    assert request is not None and request.name == "POST /v1/jobs", request
    (plan,) = [s for s in spans.named("plan job") if s.trace_id == submit.trace_id]
    assert chain["release shard"].links == [(plan.trace_id, plan.span_id)]
