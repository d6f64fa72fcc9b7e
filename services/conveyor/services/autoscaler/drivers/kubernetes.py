"""The ``kubernetes`` driver: a Deployment's ``scale`` subresource, with the official client.

``GET`` and ``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` (the RBAC in
``infra/k8s/base/autoscaler.yaml`` grants exactly these). The client is synchronous; its calls
run in a thread. The count is the Deployment's desired replicas (``spec.replicas``): what was
asked for, which the Deployment controller brings about.
"""

from __future__ import annotations

import asyncio

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from conveyor.services.autoscaler.drivers.base import DriverError, ScaleDriver


def api_client(api_url: str | None) -> k8s.ApiClient:
    """A client for ``api_url`` (no credentials: a local proxy such as ``kubectl proxy``), else
    the pod's service account, else the kubeconfig. DriverError when none is usable."""
    if api_url is not None:
        configuration = k8s.Configuration()
        configuration.host = api_url.rstrip("/")
        return k8s.ApiClient(configuration)
    try:
        k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except ConfigException:
        try:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as exc:
            raise DriverError(
                f"no Kubernetes configuration (in-cluster or kubeconfig): {exc}"
            ) from exc
    return k8s.ApiClient()


class KubernetesDriver(ScaleDriver):
    """Scales Deployment ``deployment`` in ``namespace``."""

    name = "kubernetes"

    def __init__(self, *, api: k8s.ApiClient, namespace: str, deployment: str) -> None:
        self._api = api
        self._apps = k8s.AppsV1Api(api)
        self._namespace = namespace
        self._deployment = deployment

    async def replicas(self) -> int:
        scale = await self._call(self._apps.read_namespaced_deployment_scale)
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    async def scale(self, replicas: int) -> None:
        await self._call(self._apps.patch_namespaced_deployment_scale,
                         {"spec": {"replicas": replicas}})  # fmt: skip

    async def close(self) -> None:
        await asyncio.to_thread(self._api.close)

    async def _call(self, method: object, *body: object) -> k8s.V1Scale:
        assert callable(method)
        try:
            result = await asyncio.to_thread(method, self._deployment, self._namespace, *body)
        except ApiException as exc:
            raise DriverError(
                f"Kubernetes deployments/{self._deployment}/scale in {self._namespace}: "
                f"{exc.status} {exc.reason}"
            ) from exc
        except OSError as exc:  # urllib3 connection errors derive from it
            raise DriverError(f"Kubernetes API unreachable: {exc}") from exc
        assert isinstance(result, k8s.V1Scale)
        return result
