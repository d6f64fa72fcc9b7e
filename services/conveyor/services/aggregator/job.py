"""What an aggregator knows about a job before it serves it: spec, plan, layout, version 0.

:func:`prepare_job` is blocking (it builds the model): call it in a thread. A job that cannot
be served (invalid spec or plan, a model that cannot be built or has buffers) raises
:class:`JobFailed` with the reason for the job's ``failed`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from conveyor.platform.errors import ConveyorError
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import JobPlan
from conveyor.training.slicing import ParamLayout, build_job_model


class AggregatorError(ConveyorError):
    """Base of the aggregator's own errors."""


class JobFailed(AggregatorError):
    """The job cannot be served; ``str(exc)`` is the reason published with ``failed``."""

    retriable: ClassVar[bool] = False


def _int(data: dict[str, Any], key: str, minimum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"plan field {key!r} must be an integer >= {minimum}: {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class JobContext:
    """A served job's fixed parts."""

    job_id: str
    spec: JobSpec
    plan: JobPlan
    """The sharder's deterministic plan (batch id -> sample ids, for the ledger)."""
    num_classes: int
    sample_shape: tuple[int, int, int]
    train_batches_per_epoch: int
    eval_batches_per_epoch: int
    batches_partitions: int | None
    """Partitions of the job's batches topic (None: the plan does not say; no routing)."""
    layout: ParamLayout
    bounds: list[tuple[int, int]]
    """[start, stop) of each slice of the flat parameters."""
    initial: torch.Tensor
    """fp32 [N] parameters at version 0."""

    @property
    def num_slices(self) -> int:
        return len(self.bounds)

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


def prepare_job(job_id: str, spec_data: dict[str, Any], plan_data: dict[str, Any]) -> JobContext:
    """Parse the job's spec and ``planned`` data and build version 0. Raises JobFailed."""
    try:
        spec = JobSpec.from_dict(spec_data)
        shape = plan_data.get("sample_shape")
        if not isinstance(shape, list) or len(shape) != 3:
            raise ValueError(f"plan field 'sample_shape' must be [C, H, W]: {shape!r}")
        sample_shape = (int(shape[0]), int(shape[1]), int(shape[2]))
        num_classes = _int(plan_data, "num_classes", 1)
        num_samples = _int(plan_data, "num_train", 1) + _int(plan_data, "num_eval", 0)
        plan = JobPlan.from_spec(job_id, spec, num_samples)
        train = _int(plan_data, "train_batches_per_epoch", 1)
        evaluation = _int(plan_data, "eval_batches_per_epoch", 0)
        if (train, evaluation) != (plan.train_batches_per_epoch, plan.eval_batches_per_epoch):
            raise ValueError("the planned batch counts do not match the job's plan")
        batches_partitions = (
            _int(plan_data, "batches_partitions", 1) if "batches_partitions" in plan_data else None
        )
    except ValueError as exc:
        raise JobFailed(f"invalid job: {exc}") from exc
    try:
        model = build_job_model(spec, num_classes=num_classes, sample_shape=sample_shape)
    except (ValueError, RuntimeError) as exc:
        raise JobFailed(f"cannot build the model: {exc}") from exc
    layout = ParamLayout.from_model(model)
    return JobContext(
        job_id=job_id,
        spec=spec,
        plan=plan,
        num_classes=num_classes,
        sample_shape=sample_shape,
        train_batches_per_epoch=train,
        eval_batches_per_epoch=evaluation,
        batches_partitions=batches_partitions,
        layout=layout,
        bounds=layout.slice_bounds(spec.distribution.aggregator_shards),
        initial=layout.flatten_params(model),
    )
