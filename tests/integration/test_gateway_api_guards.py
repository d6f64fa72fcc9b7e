"""The gateway against the real broker and a real HTTP server (uvicorn on a free port): what
guards and documents its API: bearer auth, the body limit, validation errors (422 with field
locations), locations outside the configured roots, /metrics and the OpenAPI document."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import SPEC, TOKEN, Gateway, jobs_topic_events, running_gateway

from conveyor.platform.config import KafkaSettings, StorageSettings


async def test_bearer_auth(kafka_settings: KafkaSettings) -> None:
    async with running_gateway(kafka_settings, api_token=TOKEN) as gw:
        missing = await gw.client.get("/v1/jobs")
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith(
            "Bearer"
        )
        wrong = await gw.client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert (await gw.client.get("/v1/jobs", headers=good)).status_code == 200
        assert (await gw.client.post("/v1/jobs", json=SPEC)).status_code == 401
        assert (await gw.client.post("/v1/jobs", json=SPEC, headers=good)).status_code == 201
        for open_path in ("/healthz", "/readyz", "/metrics"):
            assert (await gw.client.get(open_path)).status_code == 200
        # The job pages show the same data: the same token.
        assert (await gw.client.get("/jobs")).status_code == 401
        assert (await gw.client.get("/jobs", headers=good)).status_code == 200


async def test_body_limit(gateway: Gateway) -> None:
    big = b'{"name": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    response = await gateway.client.post(
        "/v1/jobs", content=big, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413 and "exceeds" in response.json()["detail"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: enforced while reading
        for _ in range(40):
            yield b" " * 64 * 1024

    streamed = await gateway.client.post(
        "/v1/jobs", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413
    # The server is fine afterwards.
    assert (await gateway.client.post("/v1/jobs", json=SPEC)).status_code == 201


async def test_validation_errors_are_422_with_field_locations(gateway: Gateway) -> None:
    bad = {**SPEC, "training": {**SPEC["training"], "micro_batch_size": 30}}
    response = await gateway.client.post("/v1/jobs", json=bad)
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "training", "micro_batch_size"]
    assert "multiple of micro_batch_size (30)" in error["msg"]
    broken_json = await gateway.client.post(
        "/v1/jobs", content=b'{"name": ', headers={"Content-Type": "application/json"}
    )
    assert broken_json.status_code == 422
    yaml_body = await gateway.client.post(
        "/v1/jobs", content=b"name: x\nmodel: {name: y}\n",
        headers={"Content-Type": "application/yaml"},
    )  # fmt: skip
    assert yaml_body.status_code == 422
    not_a_mapping = await gateway.client.post("/v1/jobs", json=[1, 2])
    assert not_a_mapping.status_code == 422
    empty_key = await gateway.client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": ""})
    assert empty_key.status_code == 422


ROOTS_REFUSED = [
    # (field, location, what must stay absent or empty afterwards)
    ("checkpoint", "file://{tmp}/elsewhere/ckpt", "elsewhere"),  # an absolute path elsewhere
    ("checkpoint", "file://{tmp}/out/../escaped", "escaped"),  # a '..' escape
    ("checkpoint", "file://{tmp}/out/sub/../../escaped", "escaped"),
    ("checkpoint", "file://{tmp}/out/leak/ckpt", "secret"),  # a symbolic link escape
    ("checkpoint", "file://{tmp}/out2", "out2"),  # a sibling directory sharing the prefix
    ("checkpoint", "s3://other-bucket/ckpt", None),  # another bucket
    ("checkpoint", "s3://roots-bkt/out2/ckpt", None),  # a sibling prefix
    ("checkpoint", "file://{tmp}/data/ckpt", "data/ckpt"),  # a dataset root is read-only
    ("dataset", "npz://{tmp}/elsewhere", "elsewhere"),
    ("dataset", "npz://{tmp}/data/../escaped", "escaped"),
    ("dataset", "mnist-idx://{tmp}/data/leak", "secret"),
    ("dataset", "npz://s3://other-bucket/set", None),
    ("dataset", "npz://s3://roots-bkt/data2", None),
]


ROOTS_ACCEPTED = [
    ("checkpoint", "file://{tmp}/out/ckpt"),
    ("checkpoint", "file://{tmp}/out/sub/../ckpt2"),
    ("checkpoint", "s3://roots-bkt/out/job"),
    ("checkpoint", "file://{tmp}/objects/ckpt"),  # the object store is always allowed
    ("dataset", "npz://{tmp}/data/set"),
    ("dataset", "npz://s3://roots-bkt/data/set"),
    ("dataset", "npz://{tmp}/objects/set"),
]


def spec_naming(field: str, location: str) -> dict[str, Any]:
    if field == "checkpoint":
        return {**SPEC, "checkpoint": {**SPEC["checkpoint"], "uri": location}}
    return {**SPEC, "dataset": {**SPEC["dataset"], "uri": location}}


@pytest.fixture
def roots_tree(tmp_path: Path) -> Path:
    """``objects/``, ``out/sub/``, ``data/``, ``secret/``; ``out/leak``, ``data/leak`` -> secret."""
    tmp = tmp_path.resolve()
    for directory in ("objects", "out/sub", "data", "secret"):
        (tmp / directory).mkdir(parents=True)
    (tmp / "out" / "leak").symlink_to(tmp / "secret")
    (tmp / "data" / "leak").symlink_to(tmp / "secret")
    return tmp


async def test_locations_outside_the_roots_are_422_and_nothing_is_published(
    kafka_settings: KafkaSettings, roots_tree: Path
) -> None:
    tmp = roots_tree
    storage = StorageSettings(
        uri=f"file://{tmp}/objects",
        output_roots=(f"{tmp}/out", "s3://roots-bkt/out"),
        dataset_roots=(f"file://{tmp}/data", "s3://roots-bkt/data"),
    )
    allowed = {
        "checkpoint": f"(file://{tmp}/objects, file://{tmp}/out, s3://roots-bkt/out)",
        "dataset": f"(file://{tmp}/objects, file://{tmp}/data, s3://roots-bkt/data)",
    }
    async with running_gateway(kafka_settings, storage) as gw:
        for field, template, target in ROOTS_REFUSED:
            location = template.format(tmp=tmp)
            response = await gw.client.post("/v1/jobs", json=spec_naming(field, location))
            assert response.status_code == 422, (location, response.text)
            [error] = response.json()["detail"]
            assert error["loc"] == ["body", field, "uri"], location
            assert error["type"] == "location_not_allowed"
            kind = "output" if field == "checkpoint" else "dataset"
            assert f"is outside the allowed {kind} roots {allowed[field]}" in error["msg"]
            if target is not None:
                path = tmp / target
                assert not path.exists() or not any(path.iterdir()), (location, target)
        both = {
            **spec_naming("checkpoint", f"file://{tmp}/secret"),
            "dataset": {"uri": f"npz://{tmp}/secret"},
        }
        response = await gw.client.post("/v1/jobs", json=both, headers={"Idempotency-Key": "r"})
        assert response.status_code == 422
        assert [e["loc"] for e in response.json()["detail"]] == [
            ["body", "checkpoint", "uri"], ["body", "dataset", "uri"],
        ]  # fmt: skip
        assert await jobs_topic_events(kafka_settings) == []  # nothing reached the services
        assert (await gw.client.get("/v1/jobs")).json()["count"] == 0

        for field, template in ROOTS_ACCEPTED:
            location = template.format(tmp=tmp)
            response = await gw.client.post("/v1/jobs", json=spec_naming(field, location))
            assert response.status_code == 201, (location, response.text)
            assert response.json()["spec"][field]["uri"] == location  # as the client wrote it
    submitted = await jobs_topic_events(kafka_settings)
    assert [e.EVENT for e in submitted] == ["submitted"] * len(ROOTS_ACCEPTED)
    assert sorted(p.name for p in tmp.iterdir()) == ["data", "objects", "out", "secret"]
    assert not any((tmp / "secret").iterdir())


async def test_metrics(gateway: Gateway) -> None:
    await gateway.client.post("/v1/jobs", json=SPEC)
    await gateway.client.get("/v1/jobs/nope")
    text = (await gateway.client.get("/metrics")).text
    assert 'conveyor_gateway_requests_total{code="201",route="/v1/jobs"}' in text
    assert 'conveyor_gateway_requests_total{code="404",route="/v1/jobs/{job_id}"}' in text
    assert 'conveyor_gateway_request_seconds_count{route="/v1/jobs"}' in text
    assert 'conveyor_gateway_build_info{python="' in text
    assert 'conveyor_gateway_jobs{state="pending"}' in text


async def test_openapi_documents_the_api(gateway: Gateway) -> None:
    schema = (await gateway.client.get("/openapi.json")).json()
    job = "/v1/jobs/{job_id}"
    expected = {"/v1/jobs", job, f"{job}/cancel", f"{job}/events", f"{job}/stages", "/v1/queue"}
    assert expected <= set(schema["paths"])
    components = schema["components"]["schemas"]
    assert "JobSpec" in components
    # Every field of the spec's sections says what it does (the field docstrings), so the
    # /docs page is a reference of the spec.
    sections = ("TrainingSpec", "DistributionSpec", "CheckpointSpec", "ResourcesSpec", "FlowSpec")
    for section in sections:
        fields = components[section]["properties"]
        assert fields and all(field.get("description") for field in fields.values()), section
    assert (
        "GPU memory" in components["ResourcesSpec"]["properties"]["memory_fraction"]["description"]
    )
