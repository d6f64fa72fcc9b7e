"""What one gradient-plane test job put on the wire: :class:`Plane` trains a job with two fresh
trainers on the shared pipeline and captures its control, batches, grads and params topics
into a :class:`Run` (see test_gradient_plane.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from plane_harness import Jobs, follow, submit, trainer
from serving import running

from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    AppliedContribution,
    Batch,
    Contribution,
    GradSlice,
    Message,
    ParamSlice,
    Rejection,
    StepClose,
    Topics,
)

CAPTURE_TIMEOUT_S = 15.0
IDLE_TIMEOUT_S = 10.0


@dataclass(slots=True)
class Run:
    """One finished job: its spec, plan, summary and what its topics held (first record of
    each key wins, as the services fold them)."""

    job_id: str
    spec: dict[str, Any]
    planned: dict[str, Any]
    summary: dict[str, Any]
    closes: dict[int, StepClose]
    contributions: dict[str, Contribution]
    rejections: list[Rejection]
    batches: dict[str, Batch]
    grads: dict[tuple[str, int], GradSlice]
    params: dict[tuple[int, int], ParamSlice]

    @property
    def num_slices(self) -> int:
        return int(self.spec["distribution"]["aggregator_shards"])

    @property
    def final_version(self) -> int:
        return int(self.summary["versions"])

    def flat_params(self, version: int) -> torch.Tensor:
        """fp32 [N]: the published slices of ``version``, concatenated."""
        return torch.cat([self.params[(p, version)].values for p in range(self.num_slices)])

    def applied(self) -> list[AppliedContribution]:
        """Every applied contribution entry of every StepClose, in version order."""
        return [entry for v in sorted(self.closes) for entry in self.closes[v].contributions]


def fold(run: Run, messages: Iterable[Message]) -> None:
    for message in messages:
        if isinstance(message, StepClose):
            run.closes.setdefault(message.version, message)
        elif isinstance(message, Contribution):
            run.contributions.setdefault(message.contribution_id, message)
        elif isinstance(message, Rejection):
            run.rejections.append(message)
        elif isinstance(message, Batch):
            held = run.batches.setdefault(message.batch_id, message)
            assert torch.equal(held.x, message.x) and torch.equal(held.y, message.y)
        elif isinstance(message, GradSlice):
            run.grads.setdefault((message.contribution_id, message.slice_index), message)
        elif isinstance(message, ParamSlice):
            run.params.setdefault((message.slice_index, message.version), message)


def capture_gaps(run: Run) -> list[str]:
    """What of the finished job was not read yet (empty: every version's close and slices,
    every applied batch and gradient slice)."""
    versions = range(run.final_version + 1)
    closes = [v for v in versions if v > 0 and v not in run.closes]
    params = [(p, v) for v in versions for p in range(run.num_slices) if (p, v) not in run.params]
    batches = [b for c in run.closes.values() for b in c.batch_ids if b not in run.batches]
    grads = [
        (entry.contribution_id, p)
        for entry in run.applied()
        if entry.num_samples > 0
        for p in range(run.num_slices)
        if (entry.contribution_id, p) not in run.grads
    ]
    named: dict[str, list[Any]] = {
        "closes": closes,
        "params": params,
        "batches": batches,
        "grads": grads,
    }
    return [
        f"{len(missing)} {kind} (first {missing[0]})" for kind, missing in named.items() if missing
    ]


class Plane:
    """The shared pipeline; :meth:`run` trains one job with two fresh trainers (once per
    name: later calls get the same :class:`Run`)."""

    def __init__(self, kafka: KafkaSettings, topics: Topics, jobs: Jobs, objects: Path) -> None:
        self.kafka, self.topics, self.jobs, self.objects = kafka, topics, jobs, objects
        self._runs: dict[str, Run] = {}
        self._lock = asyncio.Lock()

    async def run(
        self, name: str, spec: dict[str, Any], *, slow: dict[str, float] | None = None
    ) -> Run:
        async with self._lock:
            if name not in self._runs:
                started = time.monotonic()
                self._runs[name] = await self._train(name, spec, slow or {})
                print(f"job {name}: {time.monotonic() - started:.1f} s")
            return self._runs[name]

    async def _train(self, job_id: str, spec: dict[str, Any], slow: dict[str, float]) -> Run:
        kafka, topics, jobs = self.kafka, self.topics, self.jobs
        trainers = [
            trainer(kafka, name, simulated_step_delay_s=slow.get(name, 0.0))
            for name in ("t-a", "t-b")
        ]
        async with running(trainers[0]), running(trainers[1]):
            await submit(kafka, topics, job_id, spec)
            await jobs.wait_for(lambda: jobs.of("planned", job_id))
            # Read while the job runs: its topics are deleted when it ends (after the grace
            # the test's sharder gives them).
            captured: list[list[Any]] = [[], [], [], []]
            names = (topics.control, topics.batches, topics.grads, topics.params)
            following = [
                asyncio.create_task(follow(kafka, name(job_id), into))
                for name, into in zip(names, captured, strict=True)
            ]
            try:
                await jobs.wait_for(
                    lambda: jobs.of("completed", job_id) or jobs.of("failed", job_id)
                )
                assert not jobs.of("failed", job_id), jobs.of("failed", job_id)
                run = Run(
                    job_id=job_id, spec=spec, planned=jobs.of("planned", job_id)[0],
                    summary=jobs.of("completed", job_id)[0]["summary"], closes={},
                    contributions={}, rejections=[], batches={}, grads={}, params={},
                )  # fmt: skip
                deadline = time.monotonic() + CAPTURE_TIMEOUT_S
                while True:
                    for into in captured:
                        fold(run, into)
                        into.clear()
                    gaps = capture_gaps(run)
                    if not gaps:
                        break
                    ended = {
                        name.__name__: task.exception()
                        for name, task in zip(names, following, strict=True)
                        if task.done() and not task.cancelled()
                    }
                    assert time.monotonic() < deadline and not ended, (
                        f"the topics were not read in time: missing {gaps}; readers ended: {ended}"
                    )
                    await asyncio.sleep(0.1)
            finally:
                for task in following:
                    task.cancel()
                await asyncio.gather(*following, return_exceptions=True)
            # Leaving a finished job (whose topics are gone) must not hold a trainer up: it
            # is free for the next job at once.
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while busy := [t.settings.worker_id for t in trainers if t.current_job is not None]:
                assert time.monotonic() < deadline, f"{busy} still in job {job_id}"
                await asyncio.sleep(0.1)
        return run
