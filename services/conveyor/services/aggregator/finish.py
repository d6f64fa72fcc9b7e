"""The end of a job: gather the final parameters, export the model and the ledger, summarise."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import torch

from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import ParamSlice, Topics
from conveyor.platform.storage import ObjectStore
from conveyor.services.aggregator.coordinator import Coordinator
from conveyor.services.aggregator.export import build_summary, export_model, write_ledger
from conveyor.services.aggregator.job import AggregatorError, JobContext
from conveyor.services.aggregator.params import last_param_slices

_POLL_S = 0.2


async def final_params(
    kafka: KafkaSettings, ctx: JobContext, version: int, *, timeout_s: float
) -> torch.Tensor:
    """fp32 [N]: the last ParamSlice of every partition of the job's params topic, once each
    is at ``version`` or later. Raises ``TimeoutError`` after ``timeout_s``."""
    topic = Topics(kafka.topic_prefix).params(ctx.job_id, incarnation=ctx.incarnation)
    async with asyncio.timeout(timeout_s):
        while True:
            last = await last_param_slices(kafka, topic)
            slices = [last.get(p) for p in range(ctx.num_slices)]
            if all(s is not None and s.version >= version for s in slices):
                break
            await asyncio.sleep(_POLL_S)
    parts: list[torch.Tensor] = []
    for index, ((start, stop), message) in enumerate(zip(ctx.bounds, slices, strict=True)):
        assert isinstance(message, ParamSlice)
        if message.values.numel() != stop - start:
            raise AggregatorError(
                f"ParamSlice {index} has {message.values.numel()} values, not {stop - start}"
            )
        parts.append(message.values.to(torch.float32))
    return torch.cat(parts) if parts else torch.zeros(0)


def write_outputs(
    store: ObjectStore, ctx: JobContext, flat: torch.Tensor, coordinator: Coordinator
) -> str:
    """Export the model at ``flat`` with the coordinator's per-step losses, and write its
    ledger (the sample ids the applied contributions were computed on; blocking). Returns the
    model's URI."""
    model = ctx.build_model()
    ctx.layout.load_flat(model, flat)
    uri = export_model(
        store,
        ctx.job_id,
        model,
        spec=ctx.spec,
        num_classes=ctx.num_classes,
        sample_shape=ctx.sample_shape,
        step=coordinator.steps,
        step_losses=coordinator.step_losses,
    )
    write_ledger(store, ctx.job_id, coordinator.ledger)
    return uri


def summarise(coordinator: Coordinator, model_uri: str) -> dict[str, Any]:
    """The ``completed`` summary: DESIGN section 7 fields plus the gradient plane's figures,
    and a language model's ``eval_perplexity`` (exp of its per-token eval loss)."""
    results = coordinator.epochs.results()
    last = results[-1] if results else None
    language: dict[str, float | None] = {}
    if coordinator.config.spec.language_model:
        loss = last.eval_loss if last else None
        language["eval_perplexity"] = math.exp(min(loss, 700.0)) if loss is not None else None
    started, ended = coordinator.first_started_at, coordinator.last_closed_at
    elapsed_s = (ended - started) if started is not None and ended is not None else 0.0
    steps = coordinator.steps
    run_samples = coordinator.samples_trained - coordinator.samples_before_resume  # this run's
    return build_summary(
        job_id=coordinator.config.job_id,
        epochs=len(coordinator.epochs.end_version),
        steps=steps,
        samples=coordinator.samples_trained,
        eval_accuracy=last.eval_accuracy if last else None,
        eval_loss=last.eval_loss if last else None,
        samples_per_second=run_samples / elapsed_s if elapsed_s > 0 else 0.0,
        data_wait_ratio=coordinator.members.data_wait_ratio(),
        checkpoint=model_uri,
        versions=coordinator.version,
        grad_bytes_total=coordinator.grad_bytes_total,
        grad_bytes_per_step=coordinator.grad_bytes_total / steps if steps else 0.0,
        max_staleness=coordinator.max_staleness,
        rejections=coordinator.rejected,
        finished_at=time.time(),
        **language,
    )
