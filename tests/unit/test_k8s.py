"""infra/k8s: the kustomizations render, every document validates against the Kubernetes API
schemas (offline: the schemas kubernetes-validate ships), and the manifests agree with the
services, the image and the compose file.

The kustomizations are rendered by a Python renderer of the subset they use (resources,
components, namespace, images, JSON 6902 patches), which refuses anything else; where kubectl is
installed, its kustomize renders them too and must give the same documents.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from compose_model import environment, load_compose

from conveyor.embedded import registry
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.service import Service
from conveyor.services.trainer.config import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
"""The oldest Kubernetes release still widely run, and the newest the package knows."""
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}

Document = dict[str, Any]


# -- a renderer for the subset of kustomize the manifests use ---------------------------------


def _load_all(path: Path) -> list[Document]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _apply_json6902(document: Document, operations: list[dict[str, Any]]) -> None:
    for operation in operations:
        *parents, last = _pointer(operation["path"])
        node: Any = document
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        op = operation["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op == "add":
                node.insert(index, copy.deepcopy(operation["value"]))
            elif op == "replace":
                node[index] = copy.deepcopy(operation["value"])
            elif op == "remove":
                del node[index]
            else:
                raise AssertionError(f"unsupported JSON patch op {op!r}")
        elif op in ("add", "replace"):
            assert op == "add" or last in node, f"replace of missing {operation['path']}"
            node[last] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del node[last]
        else:
            raise AssertionError(f"unsupported JSON patch op {op!r}")


def _matches(document: Document, target: dict[str, str]) -> bool:
    group, _, version = document["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": document["kind"],
              "name": document["metadata"]["name"]}  # fmt: skip
    unknown = set(target) - set(wanted)
    assert not unknown, f"unsupported patch target keys {unknown}"
    return all(wanted[key] == value for key, value in target.items())


def render(directory: Path) -> list[Document]:
    """The documents ``kustomize build directory`` prints, for the subset used here."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "namespace", "resources", "components", "images", "patches"}
    unsupported = set(kustomization) - known
    assert not unsupported, f"{directory}: the test's renderer does not support {unsupported}"
    documents: list[Document] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        documents += render(path) if path.is_dir() else _load_all(path)
    for component in kustomization.get("components", []):
        component_dir = (directory / component).resolve()
        component_doc = yaml.safe_load((component_dir / "kustomization.yaml").read_text())
        assert component_doc["kind"] == "Component"
        _patch(documents, component_doc, component_dir)
    _patch(documents, kustomization, directory)
    for image in kustomization.get("images", []):
        for document in documents:
            for container in _containers(document):
                name, _, _tag = container["image"].partition(":")
                if name == image["name"]:
                    new = image.get("newName", name)
                    tag = image.get("newTag", _tag)
                    container["image"] = f"{new}:{tag}" if tag else new
    if "namespace" in kustomization:
        for document in documents:
            if document["kind"] not in CLUSTER_SCOPED:
                document["metadata"]["namespace"] = kustomization["namespace"]
    return documents


def _patch(documents: list[Document], kustomization: dict[str, Any], directory: Path) -> None:
    unsupported = set(kustomization) - {"apiVersion", "kind", "patches", "resources",
                                        "components", "images", "namespace"}  # fmt: skip
    assert not unsupported, f"{directory}: unsupported {unsupported}"
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"target", "patch"}, f"{directory}: only inline JSON 6902 patches"
        operations = yaml.safe_load(patch["patch"])
        targets = [d for d in documents if _matches(d, patch["target"])]
        assert len(targets) == 1, f"{directory}: patch target {patch['target']} matches {targets}"
        _apply_json6902(targets[0], operations)


def _containers(document: Document) -> list[dict[str, Any]]:
    if document["kind"] != "Deployment":
        return []
    containers: list[dict[str, Any]] = document["spec"]["template"]["spec"]["containers"]
    return containers


def _by_kind(documents: list[Document], kind: str) -> dict[str, Document]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


@pytest.fixture(scope="module")
def base() -> list[Document]:
    return render(BASE)


@pytest.fixture(scope="module")
def gpu() -> list[Document]:
    return render(GPU)


# -- the renderer and the schemas -------------------------------------------------------------


def _identity(document: Document) -> tuple[str, str, str]:
    return document["kind"], document["metadata"].get("namespace", ""), document["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
@pytest.mark.parametrize("directory", [BASE, GPU], ids=["base", "gpu"])
def test_the_renderer_gives_what_kustomize_gives(directory: Path) -> None:
    done = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    expected = sorted(_load_all_text(done.stdout), key=_identity)
    assert sorted(render(directory), key=_identity) == expected


def _load_all_text(text: str) -> list[Document]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_validates_against_the_kubernetes_schemas(
    base: list[Document], gpu: list[Document], version: str
) -> None:
    assert len(base) >= 3 + 2 * len(registry.deployed_services())
    # The overlay's documents that differ from the base's (test_the_gpu_overlay_... pins that
    # the others are equal).
    changed = [document for document in gpu if document not in base]
    assert [_identity(d) for d in changed] == [("Deployment", "conveyor", "trainer")]
    for document in base + changed:
        # strict: a field the API does not know (a typo) is an error, not silently dropped.
        kubernetes_validate.validate(document, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field(base: list[Document]) -> None:
    deployment = copy.deepcopy(_by_kind(base, "Deployment")["trainer"])
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["httpGett"] = probe.pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


# -- what the manifests promise ----------------------------------------------------------------


def _config(documents: list[Document]) -> dict[str, str]:
    """The variables every container gets (ConfigMap and Secret of envFrom)."""
    config: dict[str, str] = dict(_by_kind(documents, "ConfigMap")["conveyor"]["data"])
    config.update(_by_kind(documents, "Secret")["conveyor-s3"]["stringData"])
    return config


def test_a_deployment_runs_every_registered_service(base: list[Document]) -> None:
    deployments = _by_kind(base, "Deployment")
    # Adding a service to the registry (checkpointer, autoscaler) fails here until it has one.
    assert set(deployments) == set(registry.deployed_services())
    port = int(_config(base)["CONVEYOR_TELEMETRY_HTTP_PORT"])
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+)$", dockerfile, flags=re.MULTILINE)
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        # The image's entrypoint is `conveyor`: the container only passes its arguments.
        assert "command" not in container and container["args"] == ["service", name]
        assert container["image"] == "conveyor:0.1.0"
        assert container["ports"] == [{"name": "http", "containerPort": port}]
        probes = {
            kind: container[f"{kind}Probe"]["httpGet"]
            for kind in ("startup", "liveness", "readiness")
        }
        assert probes == {
            "startup": {"path": "/healthz", "port": "http"},
            "liveness": {"path": "/healthz", "port": "http"},
            "readiness": {"path": "/readyz", "port": "http"},
        }, name
        resources = container["resources"]
        assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}, name
        assert container["envFrom"] == [
            {"configMapRef": {"name": "conveyor"}},
            {"secretRef": {"name": "conveyor-s3"}},
        ]
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] and str(security["runAsUser"]) == user
        # Only the autoscaler talks to the Kubernetes API (rbac.yaml).
        account = "conveyor-autoscaler" if name == "autoscaler" else "conveyor"
        assert pod["spec"]["serviceAccountName"] == account, name
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port), name


def test_pods_get_the_time_a_graceful_stop_takes(base: list[Document]) -> None:
    defaults = Service.__init__.__kwdefaults__
    assert defaults is not None
    needed_s = max(defaults["drain_timeout_s"], TrainerSettings().drain_timeout_s)
    needed_s += defaults["stop_timeout_s"]
    for deployment in _by_kind(base, "Deployment").values():
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed_s


def test_services_select_their_deployments(base: list[Document]) -> None:
    deployments = _by_kind(base, "Deployment")
    services = _by_kind(base, "Service")
    assert set(services) == set(deployments)
    for name, service in services.items():
        selector = service["spec"]["selector"].items()
        selected = [
            d for d in deployments.values()
            if selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert [d["metadata"]["name"] for d in selected] == [name]
        port_names = {p["name"] for c in _containers(selected[0]) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
        # Headless (DNS names every pod, for scraping) except the gateway's, which serves the API.
        assert (service["spec"].get("clusterIP") == "None") == (name != "gateway"), name
    assert [p["port"] for p in services["gateway"]["spec"]["ports"]] == [8080]


def test_the_config_is_valid_conveyor_settings_like_the_compose_template(
    base: list[Document], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(base)
    compose_env = environment(load_compose()["x-conveyor-service"])
    # The same variables as a compose container, the endpoints aside (traces are opt-in here).
    assert set(config) == set(compose_env) - {"OTEL_EXPORTER_OTLP_ENDPOINT"}
    import os

    for key in [k for k in os.environ if k.startswith(("CONVEYOR_", "OTEL_"))]:
        monkeypatch.delenv(key)
    for key, value in config.items():
        monkeypatch.setenv(key, value)
    storage, telemetry = StorageSettings(), TelemetrySettings()
    settings = {"kafka": KafkaSettings(), "storage": storage, "telemetry": telemetry}
    # Each variable is a field of these settings: a misspelt one would be ignored silently.
    read = {
        f"CONVEYOR_{group.upper()}_{field.upper()}"
        for group, model in settings.items()
        for field in model.model_fields_set
    }
    assert read == set(config)
    assert storage.uri.startswith("s3://") and storage.s3_endpoint
    assert telemetry.http_host == "0.0.0.0"


def test_the_autoscaler_may_scale_deployments_in_its_namespace_only(
    base: list[Document],
) -> None:
    assert not [d for d in base if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    accounts = _by_kind(base, "ServiceAccount")
    assert accounts["conveyor"]["automountServiceAccountToken"] is False
    role = _by_kind(base, "Role")["conveyor-autoscaler"]
    grants = {
        (resource, verb)
        for rule in role["rules"]
        if rule["apiGroups"] == ["apps"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert grants == {
        ("deployments", "get"), ("deployments", "list"), ("deployments", "watch"),
        ("deployments/scale", "get"), ("deployments/scale", "update"),
        ("deployments/scale", "patch"),
    }  # fmt: skip
    binding = _by_kind(base, "RoleBinding")["conveyor-autoscaler"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "conveyor-autoscaler"}  # fmt: skip
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts
    assert subject["namespace"] == role["metadata"]["namespace"] == "conveyor"


def test_the_gpu_overlay_gives_each_trainer_a_gpu(
    base: list[Document], gpu: list[Document]
) -> None:
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(base)
    base_deployments, gpu_deployments = _by_kind(base, "Deployment"), _by_kind(gpu, "Deployment")
    for name in set(base_deployments) - {"trainer"}:
        assert gpu_deployments[name] == base_deployments[name]
    pod = gpu_deployments["trainer"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["env"] == [{"name": "CONVEYOR_TRAINER_DEVICE", "value": "cuda"}]
    assert container["image"] == "conveyor:0.1.0-cuda"
    # The same image the compose file's gpu profile builds.
    assert container["image"] == load_compose()["services"]["trainer-gpu"]["image"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
