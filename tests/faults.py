"""Faults injected into a real trainer, so that tests can show the checks catch them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from conveyor.services.trainer.plane.sending import Computed
from conveyor.services.trainer.runner import JobRunner, LastPass


@dataclass
class BatchComputedTwice:
    """Makes trainer ``worker_id`` run the first micro-batch of its first non-empty step a
    second time into the same gradient, and report honestly what it computed: the batch id
    once (so no batch-id check can see it), its sample ids twice. Every other step, and every
    other trainer of the process, runs as usual. :meth:`install` patches
    :meth:`JobRunner._gather` for the test's duration."""

    worker_id: str
    batch_id: str | None = None
    """The batch computed twice, once it happened."""
    sample_ids: list[int] = field(default_factory=list)
    """Its sample ids."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = JobRunner._gather
        fault = self

        async def gather(
            runner: JobRunner, wanted: int, patience_s: float, *, last_pass: LastPass | None = None
        ) -> tuple[list[Computed], float]:
            armed = fault.batch_id is None and runner.settings.worker_id == fault.worker_id
            # The pass added here must go into the gradient, so the step it joins sends its
            # slices after the backward, not during it.
            computed, wait_s = await original(
                runner, wanted, patience_s, last_pass=None if armed else last_pass
            )
            if computed and armed:
                batch = computed[0].batch
                again = await runner._compute(runner.session.engine.accumulate, batch.x, batch.y)
                computed.append(Computed(batch, again))
                fault.batch_id, fault.sample_ids = batch.batch_id, list(batch.sample_ids)
            return computed, wait_s

        monkeypatch.setattr(JobRunner, "_gather", gather)
