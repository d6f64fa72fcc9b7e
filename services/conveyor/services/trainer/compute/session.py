"""Everything a trainer builds when it joins a job: spec, plan, topics, device, model, engine.

:func:`prepare_job` is blocking (it builds the model): call it from the compute thread. Any
problem that no retry can fix (an invalid spec or plan, an unknown model option, a model with
state the gradient plane cannot carry, no CUDA where the job demands it) raises
:class:`JobFailure` with a reason for the ``failed`` event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.platform.messages import JobPlanned, Topics
from conveyor.services.trainer.compute.engine import (
    Engine,
    Normalizer,
    apply_resources,
    resolve_device,
)
from conveyor.services.trainer.compute.inner import InnerOptimizer
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.plane.gradients import SliceEncoder
from conveyor.training.jobhost import JobFailure
from conveyor.training.jobspec import JobSpec
from conveyor.training.jobview import JobView
from conveyor.training.slicing import ParamLayout, build_job_model


@dataclass(kw_only=True, slots=True)
class JobSession:
    """A joined job's fixed parts."""

    job_id: str
    incarnation: int
    """The job's resumes so far: names its topics and groups (``Topics``)."""
    spec: JobSpec
    plan: JobPlanned
    topics: Topics
    device: torch.device
    model: nn.Module
    """The trainer's working copy; its parameters are overwritten by every version loaded."""
    layout: ParamLayout
    bounds: list[tuple[int, int]]
    """Slice p of the flat parameters/gradients = ``[start, stop)`` (K slices)."""
    engine: Engine
    max_in_flight: int
    """Unacknowledged batches the consumer may hold (see :func:`max_in_flight`)."""

    @property
    def num_slices(self) -> int:
        return len(self.bounds)

    @property
    def grads_topic(self) -> str:
        return self.topics.grads(self.job_id, incarnation=self.incarnation)

    @property
    def params_topic(self) -> str:
        return self.topics.params(self.job_id, incarnation=self.incarnation)


def max_in_flight(spec: JobSpec, plan: JobPlanned, settings: TrainerSettings) -> int:
    """Batches delivered but not yet acknowledged that the trainer must be able to hold.

    A batch is acknowledged once the control log shows its effect, so the consumer must hold:
    what the sharder may release ahead of what was applied (its lead plus one shard: tasks are
    released whole; later-epoch batches wait here), one epoch of eval batches, the batches of
    the contributions that may be outstanding (ssp: staleness + 1 of them, plus one being
    computed; local mode: windows of ``sync_every_steps`` steps), the prefetch depth and a margin.
    """
    shard_batches = math.ceil(spec.shard_size / spec.training.micro_batch_size)
    staleness = spec.distribution.staleness if spec.distribution.mode == "ssp" else 0
    window = spec.distribution.sync_every_steps or 1  # local mode: H steps per contribution
    return (
        spec.lead_batches
        + shard_batches
        + plan.eval_batches_per_epoch
        + (staleness + 2) * window * spec.micro_batches_per_step
        + settings.prefetch_batches
        + settings.in_flight_margin_batches
    )


def prepare_job(job: JobView, settings: TrainerSettings, topics: Topics) -> JobSession:
    """Parse the job's spec and plan, set the device up, build the model and its engine.

    The model starts at version 0 (seeded by ``spec.training.seed``), as the aggregator's;
    the trainer still loads every version, 0 included, from the params topic. Raises
    :class:`JobFailure`.
    """
    plan = job.plan
    if plan is None:
        raise JobFailure("invalid job: it has no plan yet")
    try:
        spec = JobSpec.from_dict(job.spec)
    except ValueError as exc:
        raise JobFailure(f"invalid job: {exc}") from exc
    try:
        device = resolve_device(settings.device or spec.resources.device)
        apply_resources(spec.resources, device, deterministic=spec.distribution.deterministic)
        model = build_job_model(spec, num_classes=plan.num_classes, sample_shape=plan.shape).to(
            device
        )
        layout = ParamLayout.from_model(model)
        bounds = layout.slice_bounds(spec.distribution.aggregator_shards)
        normalizer = Normalizer(spec.preprocess.normalize, plan.shape[0], device)
        engine = Engine(
            model,
            device,
            bf16=spec.training.precision == "bf16",
            normalizer=normalizer,
            layout=layout,
            encoder=SliceEncoder.for_job(spec, bounds),
            inner=(
                InnerOptimizer(spec, model, train_batches_per_epoch=plan.train_batches_per_epoch)
                if spec.distribution.mode == "local"
                else None
            ),
            simulated_delay_s=settings.simulated_step_delay_s,
        )
    except (ValueError, TypeError, RuntimeError) as exc:
        # TypeError: a model option of the wrong kind; RuntimeError: torch (CUDA OOM, ...).
        raise JobFailure(f"cannot set up training: {exc}") from exc
    return JobSession(
        job_id=job.job_id,
        incarnation=job.incarnation,
        spec=spec,
        plan=plan,
        topics=topics,
        device=device,
        model=model,
        layout=layout,
        bounds=bounds,
        engine=engine,
        max_in_flight=max_in_flight(spec, plan, settings),
    )
