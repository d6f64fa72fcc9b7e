"""The aggregator writes a job's checkpoints and model only inside the operator's output roots.

Jobs are put on the jobs topic directly (``submitted`` then ``planned``, as if the gateway and
the sharder had not looked): the aggregator, against the real broker and a real S3 endpoint,
fails each job whose ``checkpoint.uri`` lies outside with the reason, and writes nothing there.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from job_events import job_event
from serving import running
from storage_backends import raw_client, s3_settings

from conveyor.platform.bus import Producer, create_topology, ensure_topics
from conveyor.platform.config import KafkaSettings, TelemetrySettings, TopologySettings
from conveyor.platform.messages import Topics
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.service import AggregatorService
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import JobPlan

DIGITS_SAMPLES = 1797


def spec_writing_to(checkpoint_uri: str) -> dict[str, Any]:
    return {
        "name": "roots",
        "model": {"name": "small_cnn", "num_classes": 10, "channels": [4, 8]},
        "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.2},
        "training": {
            "epochs": 1, "global_batch_size": 64, "micro_batch_size": 32,
            "optimizer": {"name": "sgd", "lr": 0.1},
        },
        "distribution": {"trainers": 1, "aggregator_shards": 1},
        "checkpoint": {"uri": checkpoint_uri},
    }  # fmt: skip


async def submit_planned(kafka: KafkaSettings, job_id: str, spec: dict[str, Any]) -> None:
    """What the gateway and the sharder would do: the job's topics, ``submitted``, ``planned``."""
    topics = Topics(kafka.topic_prefix)
    plan = JobPlan.from_spec(job_id, JobSpec.from_dict(spec), DIGITS_SAMPLES)
    planned = {
        "num_train": plan.num_train, "num_eval": plan.num_eval, "num_classes": 10,
        "sample_shape": [1, 8, 8], "train_batches_per_epoch": plan.train_batches_per_epoch,
        "eval_batches_per_epoch": plan.eval_batches_per_epoch,
        "steps_per_epoch": plan.steps_per_epoch(2), "shards_per_epoch": plan.tasks_per_epoch,
        "batches_topic": topics.batches(job_id), "control_topic": topics.control(job_id),
        "batches_partitions": 1,
    }  # fmt: skip
    await ensure_topics(kafka, topics.job_topic_specs(job_id, batches_partitions=1, slices=1))
    async with Producer(kafka) as producer:
        for event, data in (("submitted", {"spec": spec}), ("planned", planned)):
            await producer.publish(topics.jobs, job_event(job_id, event, **data), key=job_id)


def state_of(service: AggregatorService, job_id: str) -> str | None:
    job = service.view.get(job_id)
    return None if job is None else job.state


@pytest.fixture
def output_tree(tmp_path: Path) -> Path:
    """``out/``, ``secret/`` and ``out/leak`` -> secret."""
    tmp = tmp_path.resolve()
    for directory in ("out", "secret"):
        (tmp / directory).mkdir()
    (tmp / "out" / "leak").symlink_to(tmp / "secret")
    return tmp


async def test_checkpoint_places_outside_the_output_roots_fail_the_job_unwritten(
    kafka_settings: KafkaSettings, s3_server: dict[str, str], s3_bucket: str, output_tree: Path
) -> None:
    tmp = output_tree
    storage = s3_settings(s3_server).model_copy(
        update={"uri": f"s3://{s3_bucket}/stack", "output_roots": (f"file://{tmp}/out",)}
    )
    refused = {
        "sibling": f"s3://{s3_bucket}/stack2",  # a sibling prefix of the object store
        "bucket": f"s3://other-{s3_bucket}/stack",  # another bucket
        "dotdot": f"file://{tmp}/out/../escaped",  # a '..' escape
        "link": f"file://{tmp}/out/leak/ckpt",  # a symbolic link escape
    }
    inside = {"in-dir": f"file://{tmp}/out/ckpt", "in-store": f"s3://{s3_bucket}/stack/own"}
    await create_topology(kafka_settings, TopologySettings(jobs_partitions=1))
    job_ids = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in (*refused, *inside)}
    for name, uri in {**refused, **inside}.items():
        await submit_planned(kafka_settings, job_ids[name], spec_writing_to(uri))
    service = AggregatorService(
        settings=AggregatorSettings(tick_s=0.05),
        kafka=kafka_settings,
        storage=storage,
        telemetry=TelemetrySettings(otlp_endpoint=None),
    )
    async with running(service):
        # The service's own view of the jobs topic shows the events it published.
        deadline = time.monotonic() + 60
        while not (
            all(state_of(service, job_ids[name]) == "failed" for name in refused)
            and all(job_ids[name] in service.job_aggregators for name in inside)
        ):
            states = {name: state_of(service, job_id) for name, job_id in job_ids.items()}
            assert time.monotonic() < deadline, states
            await asyncio.sleep(0.05)
        for name in refused:
            reason = service.view.get(job_ids[name]).reason  # type: ignore[union-attr]
            assert reason is not None and reason.startswith("checkpoint.uri: "), reason
            assert (
                f"is outside the allowed output roots (s3://{s3_bucket}/stack, file://{tmp}/out)"
                in reason
            )
        assert [state_of(service, job_ids[name]) for name in inside] == ["planned", "planned"]
    assert sorted(p.name for p in tmp.iterdir()) == ["out", "secret"]
    assert not any((tmp / "secret").iterdir())
    client = raw_client(s3_server)
    assert not client.bucket_exists(f"other-{s3_bucket}")
    written = [o.object_name for o in client.list_objects(s3_bucket, recursive=True)]
    assert not [key for key in written if not key.startswith("stack/")], written
