"""The embedded stack for real, through its CLI: `conveyor up`, `status` and `down` as
subprocesses with a real Tansu broker; stale records replaced, a missing broker binary, an
external Kafka, the S3 store's bucket, a foreground stack stopped on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from stack_harness import _pid_gone

from conveyor.embedded import registry
from conveyor.embedded.report import probe_stack
from conveyor.embedded.stack import stop_stack
from conveyor.embedded.state import load_state


def _env() -> dict[str, str]:
    """The caller's environment minus Conveyor settings that would change what `up` does."""
    keep = {"CONVEYOR_TANSU_BIN"}
    return {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") or k in keep}


def conveyor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=120,
    )


# Only the gateway beside the broker and the store: the tests that pass these check the stack's
# bookkeeping (stale records, external Kafka, the S3 bucket, foreground stop), which is the
# same for one service as for all; test_up_status_round_trip_idempotent_down runs every service.
GATEWAY_ONLY = tuple(
    arg for name in registry.SERVICES if name != "gateway" for arg in ("--scale", f"{name}=0")
)


async def _round_trip(bootstrap: str) -> list[bytes]:
    topic = f"stack-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        topics = await admin.list_topics()
    finally:
        await admin.close()
    assert topic in topics
    async with AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all") as producer:
        for i in range(3):
            await producer.send_and_wait(topic, f"m{i}".encode())
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    async with consumer:
        got: list[bytes] = []
        while len(got) < 3:
            batch = await consumer.getmany(timeout_ms=5000)
            got += [r.value for records in batch.values() for r in records if r.value]
    return got


def test_up_status_round_trip_idempotent_down(tmp_path: Path) -> None:
    state_dir = str(tmp_path / "state")
    started = conveyor("up", "--state-dir", state_dir)
    assert started.returncode == 0, started.stderr
    state = load_state(Path(state_dir))
    assert state is not None and state.broker is not None
    assert state.bootstrap in started.stdout
    assert state.storage_uri == f"file://{(tmp_path / 'state' / 'objects').resolve()}"
    assert (tmp_path / "state" / "objects").is_dir()

    status = conveyor("status", "--state-dir", state_dir, "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert report["running"] is True and report["healthy"] is True
    broker = report["components"][0]
    assert (broker["name"], broker["pid"], broker["alive"]) == ("broker", state.broker.pid, True)
    # the registered services create their shared topics (jobs, shards, dlq) at start
    topics_before = int(broker["detail"].removesuffix(" topics"))

    assert asyncio.run(_round_trip(state.bootstrap)) == [b"m0", b"m1", b"m2"]
    status = json.loads(conveyor("status", "--state-dir", state_dir, "--json").stdout)
    # services may still be creating their topics; ours must be counted on top
    assert int(status["components"][0]["detail"].removesuffix(" topics")) >= topics_before + 1

    again = conveyor("up", "--state-dir", state_dir, "--json")
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert second["already_running"] is True
    assert second["stack"]["broker"]["pid"] == state.broker.pid

    stopped = conveyor("down", "--state-dir", state_dir, "--json")
    assert stopped.returncode == 0, stopped.stderr
    # services are stopped first, the broker last
    terminated = json.loads(stopped.stdout)["terminated"]
    assert sorted(terminated[:-1]) == sorted(service.process.pid for service in state.services)
    assert terminated[-1] == state.broker.pid
    assert _pid_gone(state.broker.pid)
    assert not (tmp_path / "state" / "stack.json").exists()

    after = conveyor("status", "--state-dir", state_dir)
    assert after.returncode == 1
    assert "No Conveyor stack is running" in after.stdout
    assert conveyor("down", "--state-dir", state_dir).returncode == 0


def test_stale_stack_is_reported_then_replaced(tmp_path: Path) -> None:
    state_dir = str(tmp_path)
    assert conveyor("up", "--state-dir", state_dir, *GATEWAY_ONLY).returncode == 0
    first = load_state(tmp_path)
    assert first is not None and first.broker is not None
    os.kill(first.broker.pid, signal.SIGKILL)
    assert _pid_gone(first.broker.pid)

    status = conveyor("status", "--state-dir", state_dir, "--json")
    assert status.returncode == 1
    broker = json.loads(status.stdout)["components"][0]
    assert (broker["alive"], broker["healthy"]) == (False, False)

    again = conveyor("up", "--state-dir", state_dir, *GATEWAY_ONLY, "--json")
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert second["replaced_stale"] is True and second["already_running"] is False
    assert second["stack"]["broker"]["pid"] != first.broker.pid
    assert conveyor("down", "--state-dir", state_dir).returncode == 0
    assert _pid_gone(second["stack"]["broker"]["pid"])


def test_missing_broker_binary_is_a_message(tmp_path: Path) -> None:
    env = {**_env(), "CONVEYOR_TANSU_BIN": str(tmp_path / "no-such-tansu")}
    result = conveyor("up", "--state-dir", str(tmp_path), env=env)
    assert result.returncode == 1
    assert "is not an executable file" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "stack.json").exists()


def test_external_kafka_is_used_not_started(tmp_path: Path, kafka_bootstrap: str) -> None:
    state_dir = str(tmp_path)
    started = conveyor(
        "up", "--state-dir", state_dir, "--kafka", kafka_bootstrap, *GATEWAY_ONLY, "--json"
    )
    assert started.returncode == 0, started.stderr
    stack = json.loads(started.stdout)["stack"]
    assert (stack["bootstrap"], stack["broker"]) == (kafka_bootstrap, None)
    status = json.loads(conveyor("status", "--state-dir", state_dir, "--json").stdout)
    assert status["healthy"] is True
    assert status["components"][0]["name"] == "kafka (external)"
    assert conveyor("down", "--state-dir", state_dir).returncode == 0
    assert asyncio.run(_round_trip(kafka_bootstrap)) == [b"m0", b"m1", b"m2"]


def test_s3_store_gets_its_bucket(tmp_path: Path, s3_server: dict[str, str]) -> None:
    from minio import Minio

    bucket = f"stack-{uuid.uuid4().hex[:8]}"
    args = [
        *("--s3", s3_server["endpoint"]),
        *("--s3-access-key", s3_server["access_key"]),
        *("--s3-secret-key", s3_server["secret_key"]),
        *("--s3-region", s3_server["region"]),
        *("--storage-uri", f"s3://{bucket}/runs"),
    ]
    started = conveyor("up", "--state-dir", str(tmp_path), *args, *GATEWAY_ONLY, "--json")
    assert started.returncode == 0, started.stderr
    stack = json.loads(started.stdout)["stack"]
    assert (stack["storage_uri"], stack["storage_endpoint"]) == (
        f"s3://{bucket}/runs",
        s3_server["endpoint"],
    )
    assert s3_server["secret_key"] not in (tmp_path / "stack.json").read_text()
    client = Minio(
        s3_server["endpoint"],
        access_key=s3_server["access_key"],
        secret_key=s3_server["secret_key"],
        region=s3_server["region"],
        secure=False,
    )
    assert client.bucket_exists(bucket)
    assert conveyor("down", "--state-dir", str(tmp_path)).returncode == 0


def test_foreground_stops_the_stack_on_sigterm(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor",
            "up",
            "--state-dir",
            str(tmp_path),
            "--foreground",
            *GATEWAY_ONLY,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        # Generous: the gateway imports torch (tens of seconds on two busy cores).
        deadline = time.monotonic() + 120
        while (state := load_state(tmp_path)) is None or not probe_stack(state).healthy:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert state.broker is not None
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert _pid_gone(state.broker.pid)
        assert load_state(tmp_path) is None
    finally:
        # On a failure, leave no stack behind (pytest later deletes its record, orphaning it).
        if process.poll() is None:
            process.kill()
            process.wait()
        stop_stack(tmp_path, timeout_s=5.0)
