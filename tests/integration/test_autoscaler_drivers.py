"""The autoscaler's docker and kubernetes drivers against local HTTP servers that answer the
engines' documented API calls (tests/engine_servers.py): what each driver asks, and the pool
the engine ends up with."""

from __future__ import annotations

import pytest
from engine_servers import DockerEngine, KubernetesApi, serving

from conveyor.services.autoscaler.drivers import DriverError
from conveyor.services.autoscaler.drivers.docker import DockerDriver, engine_client
from conveyor.services.autoscaler.drivers.kubernetes import KubernetesDriver, api_client

PROJECT = "conveyor"


async def test_docker_driver_copies_and_removes_compose_containers() -> None:
    engine = DockerEngine()
    engine.add(project=PROJECT, service="preprocessor", number=1)
    engine.add(project=PROJECT, service="trainer", number=1)
    engine.add(project="other", service="preprocessor", number=1)  # another project's
    with serving(engine) as url:
        driver = DockerDriver(client=engine_client(url), project=PROJECT, service="preprocessor")
        try:
            assert await driver.replicas() == 1
            await driver.scale(3)
            assert await driver.replicas() == 3
            assert engine.running("preprocessor") == [
                "/conveyor-preprocessor-1", "/conveyor-preprocessor-2",
                "/conveyor-preprocessor-3", "/other-preprocessor-1",
            ]  # fmt: skip
            copy = next(c for c in engine.containers.values()
                        if c["Name"] == "/conveyor-preprocessor-3")  # fmt: skip
            # The copy is the template's container with its own number: compose owns it too.
            assert copy["Config"]["Labels"] == {
                "com.docker.compose.project": PROJECT,
                "com.docker.compose.service": "preprocessor",
                "com.docker.compose.container-number": "3",
            }
            assert copy["Config"]["Cmd"] == ["service", "preprocessor"]
            assert "Hostname" not in copy["Config"]
            assert copy["HostConfig"] == {"RestartPolicy": {"Name": "unless-stopped"}}
            assert copy["NetworkSettings"]["Networks"] == {
                "conveyor_conveyor": {"Aliases": ["preprocessor"]}
            }

            await driver.scale(1)
            assert await driver.replicas() == 1
            # The highest numbers went first, stopped (SIGTERM, the grace period) then removed.
            assert engine.running("preprocessor") == [
                "/conveyor-preprocessor-1", "/other-preprocessor-1",
            ]  # fmt: skip
            stops = [r for r in engine.requests if r.path.endswith("/stop")]
            assert len(stops) == 2 and all(r.query == {"t": ["30"]} for r in stops)
            deletes = [r for r in engine.requests if r.method == "DELETE"]
            assert [r.path for r in deletes] == [s.path.removesuffix("/stop") for s in stops]
            lists = [r for r in engine.requests if r.path == "/v1.41/containers/json"]
            assert lists[0].query["filters"] == [
                '{"label": ["com.docker.compose.project=conveyor", '
                '"com.docker.compose.service=preprocessor"]}'
            ]
        finally:
            await driver.close()


async def test_docker_driver_errors_are_driver_errors() -> None:
    engine = DockerEngine()  # no preprocessor container to copy
    with serving(engine) as url:
        driver = DockerDriver(client=engine_client(url), project=PROJECT, service="preprocessor")
        try:
            assert await driver.replicas() == 0
            with pytest.raises(DriverError, match="no container of compose service"):
                await driver.scale(2)
        finally:
            await driver.close()
    unreachable = DockerDriver(client=engine_client(url), project=PROJECT, service="preprocessor")
    with pytest.raises(DriverError, match="Docker Engine GET /containers/json"):
        await unreachable.replicas()
    await unreachable.close()


async def test_kubernetes_driver_reads_and_patches_the_deployment_scale() -> None:
    api = KubernetesApi(replicas={("conveyor", "preprocessor"): 2})
    with serving(api) as url:
        driver = KubernetesDriver(api=api_client(url), namespace="conveyor",
                                  deployment="preprocessor")  # fmt: skip
        try:
            assert await driver.replicas() == 2
            await driver.scale(5)
            assert api.replicas[("conveyor", "preprocessor")] == 5
            assert await driver.replicas() == 5
            patch = next(r for r in api.requests if r.method == "PATCH")
            assert patch.path == "/apis/apps/v1/namespaces/conveyor/deployments/preprocessor/scale"
            assert patch.body == {"spec": {"replicas": 5}}
            missing = KubernetesDriver(api=api_client(url), namespace="conveyor",
                                       deployment="nope")  # fmt: skip
            with pytest.raises(DriverError, match="404"):
                await missing.replicas()
            await missing.close()
        finally:
            await driver.close()
