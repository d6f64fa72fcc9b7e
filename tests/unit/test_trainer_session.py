"""Joining a job: the planned event's checks, the model, layout and encoder it builds,
the consumer bound it derives, and the reasons a job fails before training."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conveyor.platform.messages import JobPlanned, Topics
from conveyor.services.trainer.compute.session import prepare_job
from conveyor.services.trainer.config import TrainerSettings
from conveyor.training.jobhost import JobFailure
from conveyor.training.jobview import JobView

TOPICS = Topics("c.")

PLAN: dict[str, Any] = {
    "num_train": 1438,
    "num_eval": 359,
    "num_classes": 10,
    "sample_shape": [1, 8, 8],
    "train_batches_per_epoch": 45,
    "eval_batches_per_epoch": 12,
    "steps_per_epoch": 23,
    "shards_per_epoch": 28,
    "batches_topic": "c.job.j1.batches",
    "control_topic": "c.job.j1.control",
    "batches_partitions": 2,
}
SPEC: dict[str, Any] = {
    "name": "digits",
    "model": {"name": "mlp", "hidden_sizes": [16]},
    "dataset": {"uri": "builtin://sklearn-digits"},
    "training": {
        "epochs": 2,
        "global_batch_size": 64,
        "micro_batch_size": 32,
        "seed": 3,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    },
    "distribution": {
        "trainers": 2,
        "aggregator_shards": 3,
        "mode": "ssp",
        "staleness": 2,
        "compression": {"kind": "topk", "ratio": 0.1},
    },
    "resources": {"device": "cpu"},
    "flow": {"max_lead_batches": 10, "shard_size": 64},
}


def job(spec: dict[str, Any] = SPEC, plan: dict[str, Any] | None = PLAN) -> JobView:
    return JobView(
        job_id="j1",
        name="digits",
        spec=spec,
        idempotency_key=None,
        submitted_at=0.0,
        updated_at=0.0,
        stage_window=8,
        state="planned",
        plan=None if plan is None else JobPlanned(job_id="j1", **plan),
    )


def test_the_planned_event_checks_its_fields() -> None:
    plan = JobPlanned(job_id="j1", **PLAN)
    assert plan.shape == (1, 8, 8) and plan.train_batches_per_epoch == 45
    with pytest.raises(ValueError, match="sample_shape"):
        JobPlanned(job_id="j1", **{**PLAN, "sample_shape": [8, 8]})
    with pytest.raises(ValueError, match="num_classes"):
        JobPlanned(job_id="j1", **{**PLAN, "num_classes": 0})
    with pytest.raises(ValueError, match="topic"):
        JobPlanned(job_id="j1", **{**PLAN, "batches_topic": ""})


def test_prepare_builds_the_seeded_version_0_its_slices_and_the_consumer_bound() -> None:
    settings = TrainerSettings(worker_id="w", prefetch_batches=4, in_flight_margin_batches=8)
    session = prepare_job(job(), settings, TOPICS)
    again = prepare_job(job(), TrainerSettings(worker_id="w"), TOPICS)
    for a, b in zip(session.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)  # weights come from the job's seed
    assert session.grads_topic == "c.job.j1.grads" and session.params_topic == "c.job.j1.params"
    assert session.num_slices == 3 and session.bounds[-1][1] == session.layout.numel
    assert session.engine.encoder.encoding == "topk" and session.engine.encoder.error_feedback
    # lead 10 + 1 shard (2) + eval 12 + (staleness 2 + 2) x 2 micro-batches + 4 + 8
    assert session.max_in_flight == 10 + 2 + 12 + 8 + 4 + 8


def test_statistics_with_compressed_gradients_are_refused() -> None:
    spec = {**SPEC, "model": {"name": "resnet18", "width": 8, "norm": "batch"}}  # SPEC: top-k
    with pytest.raises(JobFailure, match="uncompressed"):
        prepare_job(job(spec), TrainerSettings(worker_id="w"), TOPICS)


@pytest.mark.parametrize(
    ("spec", "plan", "reason"),
    [
        ({**SPEC, "model": {"name": "mlp", "width": 3}}, PLAN, "unknown option(s) ['width']"),
        ({**SPEC, "model": {"name": "transformer"}}, PLAN, "unknown model 'transformer'"),
        ({**SPEC, "training": {"epochs": 0}}, PLAN, "invalid job"),
        (SPEC, None, "invalid job"),
    ],
)
def test_jobs_that_cannot_be_trained_fail_with_a_reason(
    spec: dict[str, Any], plan: dict[str, Any] | None, reason: str
) -> None:
    with pytest.raises(JobFailure) as failed:
        prepare_job(job(spec, plan), TrainerSettings(worker_id="w"), TOPICS)
    assert reason in str(failed.value)


def test_cuda_demanded_without_cuda_fails_the_job() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(JobFailure, match="CUDA is not available"):
        prepare_job(
            job({**SPEC, "resources": {"device": "cuda"}}), TrainerSettings(worker_id="w"), TOPICS
        )
