"""In-process harness for tests of the gradient plane with the real services.

The real sharder, a preprocessor and two aggregators (:func:`pipeline`) and trainers
(:func:`trainer`) run in the test's event loop against the real broker; :class:`Jobs` sees every
event of the jobs topic; :func:`follow` captures a job topic while the job runs (a job's topics
are deleted when it ends).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from job_events import job_event
from ledger_check import assert_exactly_once as check_ledger
from ledger_check import train_split
from serving import Servable, running

from conveyor.platform.bus import Producer, TopicTail, create_topology
from conveyor.platform.config import (
    KafkaSettings,
    StorageSettings,
    TelemetrySettings,
    TopologySettings,
)
from conveyor.platform.messages import JobEvent, Topics
from conveyor.services.aggregator.config import AggregatorSettings
from conveyor.services.aggregator.service import AggregatorService
from conveyor.services.preprocessor.config import PreprocessorSettings
from conveyor.services.preprocessor.service import PreprocessorService
from conveyor.services.sharder.config import SharderSettings
from conveyor.services.sharder.service import SharderService
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.service import TrainerService
from conveyor.training.datasets import open_dataset
from conveyor.training.joblog import JobLogReader
from conveyor.training.jobspec import JobSpec
from conveyor.training.jobview import JobsView, JobView

MEMBER_TIMEOUT_S = 3.0


def telemetry() -> TelemetrySettings:
    return TelemetrySettings(otlp_endpoint=None)


def trainer(
    kafka: KafkaSettings, name: str, *, simulated_step_delay_s: float = 0.0
) -> TrainerService:
    """A trainer service; ``simulated_step_delay_s`` slows each micro-batch (a slower device)."""
    settings = TrainerSettings(
        worker_id=name,
        progress_interval_s=0.2,
        heartbeat_interval_s=0.5,
        member_timeout_s=MEMBER_TIMEOUT_S,
        simulated_step_delay_s=simulated_step_delay_s,
    )
    return TrainerService(settings=settings, kafka=kafka, telemetry=telemetry())


@asynccontextmanager
async def pipeline(
    kafka: KafkaSettings, objects: Path, *, topics_grace_s: float = 0.0
) -> AsyncIterator[None]:
    """Sharder, a preprocessor and two aggregators, ready. ``topics_grace_s``: how long the
    sharder keeps a finished job's topics (for a test that reads all of them)."""
    storage = StorageSettings(uri=f"file://{objects}")
    aggregator_settings = AggregatorSettings(
        member_timeout_s=MEMBER_TIMEOUT_S, tick_s=0.05, progress_interval_s=0.2
    )
    services: list[Servable] = [
        SharderService(
            settings=SharderSettings(tick_s=0.1, finished_topics_grace_s=topics_grace_s),
            topology=TopologySettings(), kafka=kafka, storage=storage,
            telemetry=telemetry(),
        ),
        PreprocessorService(
            settings=PreprocessorSettings(), kafka=kafka, storage=storage, telemetry=telemetry()
        ),
        *(
            AggregatorService(
                settings=aggregator_settings.model_copy(update={"worker_id": f"agg-{k}"}),
                kafka=kafka, storage=storage, telemetry=telemetry(),
            )
            for k in range(2)
        ),
    ]  # fmt: skip
    async with (
        running(services[0]),
        running(services[1]),
        running(services[2]),
        running(services[3]),
    ):
        yield


class Jobs:
    """The jobs topic as the test sees it: every event of every job."""

    def __init__(self, kafka: KafkaSettings, topic: str) -> None:
        self.events: list[JobEvent] = []
        self.changed = asyncio.Event()
        self.failure: BaseException | None = None
        self.reader = JobLogReader(
            kafka, topic, JobsView(), service="trainer_test", on_applied=self._on_applied
        )

    def _on_applied(self, job: JobView, event: JobEvent) -> None:
        self.events.append(event)
        self.changed.set()

    def of(self, name: str, job_id: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e.details()
            for e in self.events
            if name == e.EVENT
            and e.job_id == job_id
            and all(e.details().get(k) == v for k, v in match.items())
        ]

    async def read(self) -> None:
        """Run the reader until cancelled; a failure wakes the waiters, which raise it."""
        try:
            await self.reader.run()
        except Exception as exc:
            self.failure = exc
            self.changed.set()
            raise

    async def wait_for(self, predicate: Callable[[], Any], timeout_s: float = 150.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                if self.failure is not None:
                    raise AssertionError("the jobs topic reader failed") from self.failure
                self.changed.clear()
                await self.changed.wait()


@asynccontextmanager
async def job_log(kafka: KafkaSettings) -> AsyncIterator[tuple[Topics, Jobs]]:
    topics = Topics(kafka.topic_prefix)
    await create_topology(kafka, TopologySettings(jobs_partitions=2))
    jobs = Jobs(kafka, topics.jobs)
    await jobs.reader.start()
    reading = asyncio.create_task(jobs.read())
    try:
        yield topics, jobs
    finally:
        reading.cancel()
        await jobs.reader.stop()


async def submit(kafka: KafkaSettings, topics: Topics, job_id: str, spec: dict[str, Any]) -> None:
    async with Producer(kafka) as producer:
        data = JobSpec.from_dict(spec).to_dict()
        message = job_event(job_id, "submitted", spec=data, idempotency_key=None)
        await producer.publish(topics.jobs, message, key=job_id)


async def follow(kafka: KafkaSettings, topic: str, into: list[Any]) -> None:
    """Append every message of ``topic`` to ``into`` until cancelled. Reads at the gradient
    plane's short fetch wait: a job's topics are deleted when it ends, tens of milliseconds
    after its last records, and a reader at the 200 ms default wait could still be a fetch
    behind then."""
    async with TopicTail(kafka.for_gradient_plane(), topic) as tail:
        while True:
            into += [r.message for r in await tail.get_many(0.5)]


def assert_exactly_once(objects: Path, job_id: str, spec: dict[str, Any]) -> None:
    """The job's ledger (in the ``file://`` store at ``objects``) against the plan of
    ``spec``: every train sample went into exactly one applied update in each epoch, nothing
    else did (:func:`ledger_check.assert_exactly_once`)."""
    num_samples = open_dataset(spec["dataset"]["uri"]).num_samples
    fraction, seed = spec["dataset"]["eval_fraction"], spec["training"].get("seed", 0)
    ledger = json.loads((objects / f"jobs/{job_id}/ledger.json").read_text())
    check_ledger(ledger, train_split(num_samples, fraction, seed), spec["training"]["epochs"])
