"""The gateway against the real broker and a real HTTP server (uvicorn on a free port): jobs
submitted, listed, queued, cancelled, their lifecycle folded into the view and streamed, the view
rebuilt on restart, and checkpoints listed, requested and the model served."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gateway_harness import (
    SPEC,
    Gateway,
    jobs_topic_events,
    publish,
    running_gateway,
    serving_gateway,
    wait_for_queue,
    wait_for_state,
    wait_ready,
)

from conveyor.cli.client import GatewayClient
from conveyor.cli.jobs import why_queued
from conveyor.platform.bus import Producer, TopicAdmin, TopicTail, create_topology, ensure_topics
from conveyor.platform.config import KafkaSettings, StorageSettings, TopologySettings
from conveyor.platform.messages import CheckpointRequest, Topics, TrainerPresence
from conveyor.platform.storage import open_store
from conveyor.services.gateway.service import job_id_for
from conveyor.training.checkpoint import CheckpointStore, DataCursor, Manifest, SliceState


async def test_not_ready_until_the_jobs_topic_exists(kafka_settings: KafkaSettings) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    async with serving_gateway(kafka_settings) as gw:
        await asyncio.sleep(1.5)
        assert (await gw.client.get("/readyz")).status_code == 503
        assert (await gw.client.get("/v1/jobs")).status_code == 503
        async with TopicAdmin(kafka_settings) as admin:
            assert topics.jobs not in await admin.list_topics()  # the gateway creates none
        await create_topology(kafka_settings, TopologySettings())
        await wait_ready(gw, timeout_s=10)
        assert (await gw.client.get("/v1/jobs")).json()["jobs"] == []


async def test_submit_returns_pending_and_publishes_the_spec(
    gateway: Gateway, kafka_settings: KafkaSettings
) -> None:
    response = await gateway.client.post("/v1/jobs", json=SPEC)
    assert response.status_code == 201
    job = response.json()
    assert job["state"] == "pending" and job["name"] == "digits-cnn"
    assert len(job["id"]) == 32 and response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["spec"] == SPEC and job["idempotency_key"] is None
    # read-your-writes: visible at once
    assert (await gateway.client.get(f"/v1/jobs/{job['id']}")).json()["id"] == job["id"]
    [event] = await jobs_topic_events(kafka_settings)
    assert (event.job_id, event.EVENT) == (job["id"], "submitted")
    assert event.details() == {"spec": SPEC, "idempotency_key": None}


async def test_idempotency_key(gateway: Gateway, kafka_settings: KafkaSettings) -> None:
    headers = {"Idempotency-Key": "nightly-42"}
    first = await gateway.client.post("/v1/jobs", json=SPEC, headers=headers)
    again = await gateway.client.post("/v1/jobs", json=SPEC, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] == job_id_for("nightly-42")
    other_spec = {**SPEC, "name": "another-name"}
    conflict = await gateway.client.post("/v1/jobs", json=other_spec, headers=headers)
    assert conflict.status_code == 409 and "nightly-42" in conflict.json()["detail"]
    concurrent = await asyncio.gather(
        *(gateway.client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "c"})
          for _ in range(4))
    )  # fmt: skip
    assert sorted(r.status_code for r in concurrent) == [200, 200, 200, 201]
    events = await jobs_topic_events(kafka_settings)  # partitions: no order across jobs
    keys = {e.job_id: e.details()["idempotency_key"] for e in events}
    assert len(events) == 2 and keys == {
        job_id_for("nightly-42"): "nightly-42",
        job_id_for("c"): "c",
    }


async def test_list_get_and_not_found(gateway: Gateway, kafka_settings: KafkaSettings) -> None:
    ids = []
    for name in ("job-a", "job-b", "job-c"):
        response = await gateway.client.post("/v1/jobs", json={**SPEC, "name": name})
        ids.append(response.json()["id"])
    await publish(kafka_settings, ids[1], ("failed", {"reason": "dataset unreadable"}))
    await wait_for_state(gateway, ids[1], "failed")
    listing = (await gateway.client.get("/v1/jobs")).json()
    assert [job["id"] for job in listing["jobs"]] == ids[::-1] and listing["count"] == 3
    pending = (await gateway.client.get("/v1/jobs", params={"state": "pending"})).json()
    assert [job["id"] for job in pending["jobs"]] == [ids[2], ids[0]]
    limited = (await gateway.client.get("/v1/jobs", params={"limit": 1})).json()
    assert [job["id"] for job in limited["jobs"]] == [ids[2]]
    failed = (await gateway.client.get(f"/v1/jobs/{ids[1]}")).json()
    assert failed["state"] == "failed" and failed["reason"] == "dataset unreadable"
    missing = await gateway.client.get("/v1/jobs/nope")
    assert missing.status_code == 404 and missing.json() == {"detail": "job 'nope' not found"}
    # The pages for people: the list links every job, a job's page shows its state and reason.
    page = await gateway.client.get("/jobs")
    assert page.headers["content-type"].startswith("text/html")
    assert [f'href="/jobs/{job_id}"' in page.text for job_id in ids] == [True] * 3
    failed_page = (await gateway.client.get(f"/jobs/{ids[1]}")).text
    assert 'id="job-state">failed</span>' in failed_page and "dataset unreadable" in failed_page
    assert (await gateway.client.get("/jobs/nope")).status_code == 404
    bad_filter = await gateway.client.get("/v1/jobs", params={"state": "sleeping"})
    assert bad_filter.status_code == 422


async def test_queue_shows_the_schedule_of_the_trainer_pool(
    gateway: Gateway, kafka_settings: KafkaSettings
) -> None:
    """Three planned jobs asking 2, 1 and 1 trainers (the third with a higher priority): with no
    trainer all wait, by priority then submission; with two, the urgent one gets one and the big
    one heads the queue, holding the small one back (no overtaking) while a trainer idles."""
    ids = {}
    for name, trainers, priority in (("big", 2, 0), ("small", 1, 0), ("urgent", 1, 5)):
        spec = {**SPEC, "name": name, "priority": priority,
                "distribution": {**SPEC["distribution"], "trainers": trainers}}  # fmt: skip
        ids[name] = (await gateway.client.post("/v1/jobs", json=spec)).json()["id"]
        await publish(kafka_settings, ids[name], ("planned", {}))
    await wait_for_state(gateway, ids["urgent"], "queued")
    empty = await wait_for_queue(gateway, lambda q: len(q["queued"]) == 3)  # every plan folded
    assert empty["pool_size"] == 0 and empty["placed"] == []
    assert [(q["id"], q["position"]) for q in empty["queued"]] == [
        (ids["urgent"], 1), (ids["big"], 2), (ids["small"], 3)]  # fmt: skip

    async with Producer(kafka_settings) as producer:
        for worker in ("trainer-a", "trainer-b"):
            presence = TrainerPresence(worker_id=worker, job_id=None, ttl_s=60.0)
            await producer.publish(Topics(kafka_settings.topic_prefix).jobs, presence, key=worker)
    # The presences are keyed by worker: the view can show trainer-a alone for a moment, with
    # urgent already planned on it. Wait for both in the pool; then the schedule is settled.
    queue = await wait_for_queue(gateway, lambda q: q["pool_size"] == 2)
    body = await wait_for_state(gateway, ids["urgent"], "planned")
    assert body["queue_position"] is None and body["trainers"] == ["trainer-a"]
    assert queue["pool_size"] == 2 and queue["idle_trainers"] == ["trainer-b"]
    # big (2 trainers) heads the queue now and holds small back: FIFO within a priority.
    assert [(q["id"], q["position"], q["min_trainers"]) for q in queue["queued"]] == [
        (ids["big"], 1, 2), (ids["small"], 2, 1)]  # fmt: skip
    (placed,) = queue["placed"]
    assert (placed["id"], placed["priority"], placed["trainers"]) == (
        ids["urgent"],
        5,
        ["trainer-a"],
    )
    queued = (await gateway.client.get("/v1/jobs", params={"state": "queued"})).json()
    assert [job["id"] for job in queued["jobs"]] == [ids["small"], ids["big"]]  # newest first
    big = (await gateway.client.get(f"/v1/jobs/{ids['big']}")).json()
    assert (big["state"], big["queue_position"], big["trainers"]) == ("queued", 1, [])
    # What `conveyor run` and `conveyor job --wait` print while a job waits (a blocking client:
    # in a thread, beside the gateway serving on this loop).
    with GatewayClient(str(gateway.client.base_url)) as client:
        line = await asyncio.to_thread(why_queued, client, ids["big"], 1)
    assert f"job {ids['big']}: queued at position 1 for 2 trainer(s); " in line
    assert "the trainer pool has 2 (1 idle)" in line


async def test_cancel(gateway: Gateway, kafka_settings: KafkaSettings) -> None:
    job_id = (await gateway.client.post("/v1/jobs", json=SPEC)).json()["id"]
    response = await gateway.client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 202
    assert response.json()["cancel_requested"] is True and response.json()["state"] == "pending"
    repeat = await gateway.client.post(f"/v1/jobs/{job_id}/cancel")
    assert repeat.status_code == 202
    events = await jobs_topic_events(kafka_settings)
    assert [(e.job_id, e.EVENT) for e in events] == [
        (job_id, "submitted"), (job_id, "cancel_requested"),
    ]  # fmt: skip
    await publish(kafka_settings, job_id, ("cancelled", {"reason": "cancelled by sharder"}))
    await wait_for_state(gateway, job_id, "cancelled")
    finished = await gateway.client.post(f"/v1/jobs/{job_id}/cancel")
    assert finished.status_code == 409 and "already cancelled" in finished.json()["detail"]
    assert (await gateway.client.post("/v1/jobs/nope/cancel")).status_code == 404


LIFECYCLE: list[tuple[str, dict[str, Any]]] = [
    ("planned", {"num_train": 1437, "num_eval": 360, "steps_per_epoch": 22, "num_classes": 10}),
    ("running", {"worker_id": "trainer-0"}),
    ("progress", {"worker_id": "trainer-0", "epoch": 0, "step": 10, "samples_trained": 640,
                  "loss": 1.1,
                  "samples_per_second": 900.0, "data_wait_ratio": 0.02,
                  "stage_latency_s": {"compute": 0.004, "queue_wait": 0.010}}),
    ("progress", {"worker_id": "trainer-0", "epoch": 0, "step": 20, "samples_trained": 1280,
                  "loss": 0.6,
                  "samples_per_second": 1000.0, "data_wait_ratio": 0.01,
                  "stage_latency_s": {"compute": 0.006, "queue_wait": 0.020}}),
    ("epoch_completed", {"epoch": 0, "train_loss": 0.7, "eval_loss": 0.5, "eval_accuracy": 0.9}),
    ("completed", {"summary": {"eval_accuracy": 0.95, "steps": 110, "epochs": 5}}),
]  # fmt: skip


async def read_sse(
    lines: AsyncIterator[str], count: int | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of every frame until the server ends the stream, or of the first
    ``count``."""
    frames: list[tuple[str, dict[str, Any]]] = []
    event = ""
    async for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            frames.append((event, json.loads(line.removeprefix("data: "))))
            if len(frames) == count:
                break
    return frames


async def test_lifecycle_events_fold_into_the_view_and_stream(
    gateway: Gateway, kafka_settings: KafkaSettings
) -> None:
    # The two trainers it asks for in the pool: it is placed, so its stream shows the view's
    # states.
    for worker in ("trainer-0", "trainer-1"):
        await publish_presence(kafka_settings, worker)
    await wait_for_queue(gateway, lambda q: q["pool_size"] == 2)
    job = (await gateway.client.post("/v1/jobs", json=SPEC)).json()
    job_id = job["id"]
    async with gateway.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.aiter_lines()
        assert await anext(lines) == "event: snapshot"  # subscribed: now feed the events
        _, data, blank = [await anext(lines) for _ in range(3)]
        assert json.loads(data.removeprefix("data: ")) == job and blank == ""
        await publish(kafka_settings, job_id, *LIFECYCLE)
        rest = await asyncio.wait_for(read_sse(lines), 10)  # ends after the terminal event
    assert [event for event, _ in rest] == [name for name, _ in LIFECYCLE]
    assert [data["state"] for _, data in rest] == [
        "planned", "running", "running", "running", "running", "completed",
    ]  # fmt: skip
    assert [data["seq"] for _, data in rest] == [2, 3, 4, 5, 6, 7]
    assert rest[3][1]["progress"]["samples_trained"] == 1280
    job = (await gateway.client.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] == "completed"
    assert job["summary"] == {"eval_accuracy": 0.95, "steps": 110, "epochs": 5}
    assert job["progress"]["step"] == 20 and job["progress"]["total_steps"] == 110
    assert job["epochs"] == [
        {"epoch": 0, "train_loss": 0.7, "eval_loss": 0.5, "eval_accuracy": 0.9}
    ]
    stages = (await gateway.client.get(f"/v1/jobs/{job_id}/stages")).json()
    assert set(stages["stages"]) == {"compute", "queue_wait"}
    assert stages["stages"]["compute"]["p50"] == pytest.approx(0.005)
    assert stages["stages"]["queue_wait"]["max"] == pytest.approx(0.020)
    assert stages["stages"]["compute"]["count"] == 2
    # A stream opened on a finished job sends the snapshot and ends.
    async with gateway.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        frames = await asyncio.wait_for(read_sse(stream.aiter_lines()), 10)
    assert [(event, data["state"]) for event, data in frames] == [("snapshot", "completed")]
    assert (await gateway.client.get("/v1/jobs/nope/events")).status_code == 404


async def test_a_queued_jobs_stream_says_queued_while_its_aggregators_report(
    gateway: Gateway, kafka_settings: KafkaSettings
) -> None:
    """The aggregators host every planned job and report its progress (which makes the view's
    state running) before any trainer is placed on it: the stream, like the API, says queued,
    with the job's place, as long as the schedule leaves it waiting."""
    spec = {**SPEC, "distribution": {**SPEC["distribution"], "trainers": 2}}
    await publish_presence(kafka_settings, "trainer-0")  # one trainer: too few
    await wait_for_queue(gateway, lambda q: q["pool_size"] == 1)
    job_id = (await gateway.client.post("/v1/jobs", json=spec)).json()["id"]
    async with gateway.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        lines = stream.aiter_lines()
        await publish(kafka_settings, job_id, ("planned", {}), ("progress", {"step": 0}))
        frames = await asyncio.wait_for(read_sse(lines, 3), 10)
    assert [event for event, _ in frames] == ["snapshot", "planned", "progress"]
    assert [(data["state"], data["queue_position"]) for _, data in frames[1:]] == [
        ("queued", 1), ("queued", 1)]  # fmt: skip
    shown = (await gateway.client.get(f"/v1/jobs/{job_id}")).json()
    assert (shown["state"], shown["queue_position"]) == ("queued", 1)


async def publish_presence(kafka_settings: KafkaSettings, worker: str) -> None:
    async with Producer(kafka_settings) as producer:
        presence = TrainerPresence(worker_id=worker, job_id=None, ttl_s=60.0)
        await producer.publish(Topics(kafka_settings.topic_prefix).jobs, presence, key=worker)


async def test_idle_stream_sends_keepalive_comments(kafka_settings: KafkaSettings) -> None:
    async with running_gateway(kafka_settings, sse_keepalive_s=0.1) as gw:
        job_id = (await gw.client.post("/v1/jobs", json=SPEC)).json()["id"]
        async with gw.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
            lines = stream.aiter_lines()
            seen = [await anext(lines) for _ in range(6)]
    assert seen[0] == "event: snapshot" and ": keepalive" in seen[3:]


async def test_restart_rebuilds_the_same_view(kafka_settings: KafkaSettings) -> None:
    async with running_gateway(kafka_settings) as first:
        done = (await first.client.post("/v1/jobs", json=SPEC)).json()["id"]
        keyed = await first.client.post(
            "/v1/jobs", json={**SPEC, "name": "keyed"}, headers={"Idempotency-Key": "k1"}
        )
        pending = keyed.json()["id"]
        cancelling = (await first.client.post("/v1/jobs", json={**SPEC, "name": "c"})).json()
        await first.client.post(f"/v1/jobs/{cancelling['id']}/cancel")
        await publish(kafka_settings, done, *LIFECYCLE)
        await wait_for_state(first, done, "completed")
        before = (await first.client.get("/v1/jobs")).json()
        stages_before = (await first.client.get(f"/v1/jobs/{done}/stages")).json()
    async with running_gateway(kafka_settings) as second:
        after = (await second.client.get("/v1/jobs")).json()
        assert after == before
        assert [job["state"] for job in after["jobs"]] == ["pending", "pending", "completed"]
        assert (await second.client.get(f"/v1/jobs/{done}/stages")).json() == stages_before
        again = await second.client.post(
            "/v1/jobs", json={**SPEC, "name": "keyed"}, headers={"Idempotency-Key": "k1"}
        )
        assert again.status_code == 200 and again.json()["id"] == pending


async def test_stop_ends_open_progress_streams(kafka_settings: KafkaSettings) -> None:
    async with running_gateway(kafka_settings) as gw:
        job_id = (await gw.client.post("/v1/jobs", json=SPEC)).json()["id"]
        async with gw.client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
            lines = stream.aiter_lines()
            assert await anext(lines) == "event: snapshot"
            started = time.monotonic()
            gw.service.request_stop()
            rest = [line async for line in lines]  # the server ends the stream on drain
            assert time.monotonic() - started < 5
    assert rest[0].startswith("id: ") and rest[-1] == ""


async def test_checkpoints_are_listed_requested_and_the_model_served(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    objects = tmp_path / "objects"
    async with running_gateway(kafka_settings, StorageSettings(uri=f"file://{objects}")) as gw:
        job_id = (await gw.client.post("/v1/jobs", json=SPEC)).json()["id"]
        assert (await gw.client.get(f"/v1/jobs/{job_id}/checkpoints")).json()["count"] == 0
        pending = await gw.client.post(f"/v1/jobs/{job_id}/checkpoints")
        assert pending.status_code == 409 and "pending" in pending.json()["detail"]

        # Planned: the request goes to the job's control topic for its coordinator.
        topics = Topics(kafka_settings.topic_prefix)
        await ensure_topics(kafka_settings, topics.job_topic_specs(job_id, batches_partitions=1,
                                                                   slices=1))  # fmt: skip
        await publish(kafka_settings, job_id, ("planned", {}))
        await wait_for_state(gw, job_id, "queued")  # planned, and no trainer in the pool
        accepted = await gw.client.post(f"/v1/jobs/{job_id}/checkpoints")
        assert accepted.status_code == 202 and accepted.json()["id"] == job_id
        async with TopicTail(kafka_settings, topics.control(job_id)) as control:
            records = await control.get_many(5.0)
        (request,) = [r.message for r in records]
        assert isinstance(request, CheckpointRequest) and request.reason == "request"

        # Two checkpoints in the store, the newer one not committed.
        checkpoints = CheckpointStore(open_store(f"file://{objects}"), job_id)
        for version, commit in ((4, True), (8, False)):
            state = SliceState(slice_index=0, version=version, values=torch.ones(3),
                               optimizer={}, grads_offset=0)  # fmt: skip
            entry = checkpoints.write_slice(state)
            if commit:
                checkpoints.commit(Manifest(
                    job_id=job_id, version=version, step=version, trigger="every_steps",
                    created_at=123.0, files=[entry], data_cursor=DataCursor(epoch=0),
                    rng={}, spec=SPEC, model={},
                ))  # fmt: skip
        listed = (await gw.client.get(f"/v1/jobs/{job_id}/checkpoints")).json()
        rows = [(c["version"], c["state"], c["step"], c["latest"]) for c in listed["checkpoints"]]
        assert rows == [(8, "incomplete", None, False), (4, "committed", 4, True)]
        assert listed["checkpoints"][1]["size_bytes"] > 0

        missing = await gw.client.get(f"/v1/jobs/{job_id}/model/model.safetensors")
        assert missing.status_code == 404 and "no exported model" in missing.json()["detail"]
        store = open_store(f"file://{objects}")
        store.put_bytes(f"jobs/{job_id}/model.safetensors", b"weights")
        store.put_bytes(f"jobs/{job_id}/config.json", b'{"format": 1}')
        weights = await gw.client.get(f"/v1/jobs/{job_id}/model/model.safetensors")
        assert weights.status_code == 200 and weights.content == b"weights"
        config = await gw.client.get(f"/v1/jobs/{job_id}/model/config.json")
        assert config.json() == {"format": 1}
        other = await gw.client.get(f"/v1/jobs/{job_id}/model/ledger.json")
        assert other.status_code == 404 and "config.json" in other.json()["detail"]
        assert (await gw.client.get("/v1/jobs/nope/checkpoints")).status_code == 404
