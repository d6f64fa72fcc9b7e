"""What an aggregator knows about a job before it serves it: spec, plan, layout, version 0.

:func:`prepare_job` is blocking (it builds the model): call it in a thread. A job that cannot
be served (invalid spec or plan, a model that cannot be built or has buffers) raises
:class:`JobFailure` with the reason for the job's ``failed`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from conveyor.platform.errors import ConveyorError
from conveyor.platform.messages import JobPlanned
from conveyor.training.jobhost import JobFailure
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import JobPlan
from conveyor.training.slicing import ParamLayout, build_job_model


class AggregatorError(ConveyorError):
    """Base of the aggregator's own errors."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobContext:
    """A served job's fixed parts."""

    job_id: str
    spec: JobSpec
    planned: JobPlanned
    """The sharder's announcement of the plan (shapes, batch counts, topics)."""
    plan: JobPlan
    """The deterministic plan itself, checked against the announcement."""
    layout: ParamLayout
    bounds: list[tuple[int, int]]
    """[start, stop) of each slice of the flat parameters."""
    initial: torch.Tensor
    """fp32 [N] parameters at version 0."""
    incarnation: int = 0
    """The job's resumes so far: names its topics and groups (``Topics``)."""

    @property
    def num_slices(self) -> int:
        return len(self.bounds)

    @property
    def num_classes(self) -> int:
        return self.planned.num_classes

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self.planned.shape

    @property
    def train_batches_per_epoch(self) -> int:
        return self.planned.train_batches_per_epoch

    @property
    def eval_batches_per_epoch(self) -> int:
        return self.planned.eval_batches_per_epoch

    @property
    def dataset_samples(self) -> int:
        """Samples of the dataset, train and eval: sample ids are in ``[0, dataset_samples)``."""
        return self.planned.num_train + self.planned.num_eval

    @property
    def batches_partitions(self) -> int:
        """Partitions of the job's batches topic."""
        return self.planned.batches_partitions

    def build_model(self) -> torch.nn.Module:
        """A fresh model (version 0) of the job, on the CPU."""
        return build_job_model(
            self.spec, num_classes=self.num_classes, sample_shape=self.sample_shape
        )


def warm_up() -> None:
    """Pay the first-optimizer cost of the process (torch imports ``torch._dynamo`` lazily on
    the first ``Optimizer`` built: seconds, more on a loaded machine) before any job needs it.
    Blocking: call it in a thread at service start."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def prepare_job(
    job_id: str, spec_data: dict[str, Any], planned: JobPlanned, *, incarnation: int = 0
) -> JobContext:
    """Parse the job's spec, check the announced plan against it and build version 0.
    Raises JobFailure."""
    try:
        spec = JobSpec.from_dict(spec_data)
        plan = JobPlan.from_spec(job_id, spec, planned.num_train + planned.num_eval)
        counts = (planned.train_batches_per_epoch, planned.eval_batches_per_epoch)
        if counts != (plan.train_batches_per_epoch, plan.eval_batches_per_epoch):
            raise ValueError("the planned batch counts do not match the job's plan")
    except ValueError as exc:
        raise JobFailure(f"invalid job: {exc}") from exc
    try:
        model = build_job_model(spec, num_classes=planned.num_classes, sample_shape=planned.shape)
    except (ValueError, RuntimeError) as exc:
        raise JobFailure(f"cannot build the model: {exc}") from exc
    layout = ParamLayout.from_model(model)
    return JobContext(
        job_id=job_id,
        spec=spec,
        planned=planned,
        plan=plan,
        layout=layout,
        bounds=layout.slice_bounds(spec.distribution.aggregator_shards),
        initial=layout.flatten_params(model),
        incarnation=incarnation,
    )
