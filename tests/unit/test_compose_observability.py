"""Static checks of docker-compose.yml and infra/ (no Docker on the build machines): the
observability stack. Scrape targets and datasource URLs that name real services and ports, every
replica of every Conveyor service scraped, a configuration promtool accepts, dashboards that query
Conveyor's metrics, and Jaeger's ports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Any

import pytest
from compose_files import _env, _host_path, _host_port, _load
from compose_model import container_ports, conveyor_services, default_services, environment


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
