"""Joining a job: the plan as the trainer reads it, the model and optimizer it builds, the
consumer bound it derives, and the reasons a job fails before training."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conveyor.libs.jobview import JobView
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.jobwatch import JobPlan
from conveyor.services.trainer.session import JobFailed, prepare_job
from conveyor.services.trainer.tally import EvalTally, JobTally

PLAN: dict[str, Any] = {
    "num_train": 1438,
    "num_eval": 359,
    "num_classes": 10,
    "sample_shape": [1, 8, 8],
    "train_batches_per_epoch": 45,
    "eval_batches_per_epoch": 12,
    "steps_per_epoch": 23,
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
    "checkpoint": {"every_steps": 5},
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
        plan=plan,
    )


def test_plan_fields_are_parsed_and_checked() -> None:
    plan = JobPlan.from_event_data(PLAN)
    assert plan.sample_shape == (1, 8, 8) and plan.train_batches_per_epoch == 45
    with pytest.raises(ValueError, match="sample_shape"):
        JobPlan.from_event_data({**PLAN, "sample_shape": [8, 8]})
    with pytest.raises(ValueError, match="'num_classes'"):
        JobPlan.from_event_data({**PLAN, "num_classes": 0})


def test_prepare_builds_a_seeded_model_and_the_consumer_bound() -> None:
    session = prepare_job(
        job(), TrainerSettings(worker_id="w", prefetch_batches=4, in_flight_margin_batches=8)
    )
    again = prepare_job(job(), TrainerSettings(worker_id="w"))
    for a, b in zip(session.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)  # weights come from the job's seed
    assert isinstance(session.optimizer, torch.optim.SGD)
    assert session.group_id == "conveyor-trainer.j1" and session.micro_batches_per_step == 2
    assert session.checkpoint_every_steps == 5  # the spec's, not the setting's default 20
    # 2 intervals of 5 steps x 2 micro-batches + lead 10 + 1 shard (2) + eval 12 + 4 + 8
    assert session.max_in_flight == 20 + 10 + 2 + 12 + 4 + 8


@pytest.mark.parametrize(
    ("spec", "plan", "reason"),
    [
        ({**SPEC, "model": {"name": "mlp", "width": 3}}, PLAN, "unknown option(s) ['width']"),
        ({**SPEC, "model": {"name": "transformer"}}, PLAN, "unknown model 'transformer'"),
        ({**SPEC, "training": {"epochs": 0}}, PLAN, "invalid job"),
        (SPEC, {**PLAN, "batches_topic": ""}, "batches_topic"),
        (SPEC, None, "invalid job"),
    ],
)
def test_jobs_that_cannot_be_trained_fail_with_a_reason(
    spec: dict[str, Any], plan: dict[str, Any] | None, reason: str
) -> None:
    with pytest.raises(JobFailed) as failed:
        prepare_job(job(spec, plan), TrainerSettings(worker_id="w"))
    assert reason in str(failed.value)


def test_cuda_demanded_without_cuda_fails_the_job() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(JobFailed, match="CUDA is not available"):
        prepare_job(job({**SPEC, "resources": {"device": "cuda"}}), TrainerSettings(worker_id="w"))


def test_tally_round_trips_and_closes_epochs() -> None:
    tally = JobTally(step=7, consumed_batches=20, epoch_loss_sum=6.0, epoch_samples=3)
    assert tally.close_train_epoch(0, with_eval=True) == 2.0
    tally.evals[0].add(loss_sum=4.0, correct=3, samples=4)
    restored = JobTally.from_json(tally.to_json())
    assert restored == tally and restored.evals[0] == EvalTally(loss_sum=4.0, correct=3, samples=4)
    assert restored.close_eval(0) == {"train_loss": 2.0, "eval_loss": 1.0, "eval_accuracy": 0.75}
    assert restored.last_result()["eval_accuracy"] == 0.75
