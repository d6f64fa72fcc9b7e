"""Everything a trainer builds when it joins a job: spec, plan, device, model, optimizer.

:func:`prepare_job` is blocking (it builds the model): call it from the compute thread. Any
problem that no retry can fix (an invalid spec or plan, an unknown model option, no CUDA where
the job demands it) raises :class:`JobFailed` with a reason for the ``failed`` event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from conveyor.libs.errors import ConveyorError
from conveyor.libs.jobspec import JobSpec
from conveyor.libs.jobview import JobView
from conveyor.libs.models import build_model
from conveyor.services.trainer.compute import (
    Engine,
    LocalUpdater,
    Normalizer,
    apply_resources,
    build_optimizer,
    resolve_device,
)
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.jobwatch import JobPlan


class TrainerError(ConveyorError):
    """Base of the trainer's own errors."""


class JobFailed(TrainerError):
    """The job cannot be trained; ``str(exc)`` is the reason published with ``failed``."""

    retriable: ClassVar[bool] = False


@dataclass(kw_only=True, slots=True)
class JobSession:
    """A joined job's fixed parts."""

    job_id: str
    spec: JobSpec
    plan: JobPlan
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    engine: Engine
    updater: LocalUpdater
    checkpoint_every_steps: int
    """Steps between trainer-state checkpoints (the spec's, else the trainer's setting)."""
    max_in_flight: int
    """Unacknowledged batches the consumer may hold (see :func:`max_in_flight`)."""

    @property
    def group_id(self) -> str:
        return f"conveyor-trainer.{self.job_id}"

    @property
    def micro_batches_per_step(self) -> int:
        return self.spec.micro_batches_per_step


def max_in_flight(spec: JobSpec, plan: JobPlan, settings: TrainerSettings, every: int) -> int:
    """Batches delivered but not yet acknowledged that the trainer must be able to hold.

    A batch is acknowledged once a durable checkpoint holds its effect, so the consumer must
    hold: two checkpoint intervals (a write may still be in flight when the next interval
    fills), the lead the sharder may release ahead of what was consumed plus one shard (tasks
    are released whole), one epoch of eval batches, the prefetch depth and a margin.
    """
    micro = spec.training.micro_batch_size
    shard_batches = math.ceil(spec.shard_size / micro)
    return (
        2 * every * spec.micro_batches_per_step
        + spec.flow.max_lead_batches
        + shard_batches
        + plan.eval_batches_per_epoch
        + settings.prefetch_batches
        + settings.in_flight_margin_batches
    )


def prepare_job(job: JobView, settings: TrainerSettings) -> JobSession:
    """Parse the job's spec and plan, set the device up and build model and optimizer.

    Weights are initialised from ``torch.manual_seed(spec.training.seed)``; a resumed job
    overwrites them from its checkpoint afterwards. Raises :class:`JobFailed`.
    """
    try:
        spec = JobSpec.from_dict(job.spec)
        plan = JobPlan.from_event_data(job.plan or {})
    except ValueError as exc:
        raise JobFailed(f"invalid job: {exc}") from exc
    try:
        device = resolve_device(settings.device or spec.resources.device)
        apply_resources(spec.resources, device)
        channels, height, width = plan.sample_shape
        torch.manual_seed(spec.training.seed)
        options = dict(spec.model.options)
        # The spec may restate what the dataset already says; it must agree with it.
        for key, actual in (("num_classes", plan.num_classes), ("in_channels", channels)):
            stated = options.pop(key, actual)
            if stated != actual:
                raise ValueError(f"model.{key} is {stated} but the dataset has {actual}")
        model = build_model(
            spec.model.name,
            in_channels=channels,
            num_classes=plan.num_classes,
            image_size=(height, width),
            **options,
        ).to(device)
        normalizer = Normalizer(spec.preprocess.normalize, channels, device)
        optimizer = build_optimizer(spec.training.optimizer, list(model.parameters()))
    except (ValueError, TypeError, RuntimeError) as exc:
        # TypeError: a model option of the wrong kind; RuntimeError: torch (CUDA OOM, ...).
        raise JobFailed(f"cannot set up training: {exc}") from exc
    every = spec.checkpoint.every_steps or settings.checkpoint_every_steps
    return JobSession(
        job_id=job.job_id,
        spec=spec,
        plan=plan,
        device=device,
        model=model,
        optimizer=optimizer,
        engine=Engine(
            model,
            device,
            bf16=spec.training.precision == "bf16",
            normalizer=normalizer,
            simulated_delay_s=settings.simulated_step_delay_s,
        ),
        updater=LocalUpdater(model, optimizer),
        checkpoint_every_steps=every,
        max_in_flight=max_in_flight(spec, plan, settings, every),
    )
