"""The job host's rules on the real broker: which jobs it takes, how many at once, and what
the end of a job's work means (done, failed, retried, let go on cancel, ended meanwhile).

A tiny host stands in for the trainer and the aggregator: its work for a job is chosen by the
job's name, and it records every attempt."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from job_events import job_event
from plane_harness import job_log, telemetry
from serving import running

from conveyor.platform.bus import BusError, Producer
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import Topics
from conveyor.training.jobhost import JobFailure, JobHostService
from conveyor.training.jobview import JobView


class Flaky(BusError):
    retriable = True


class Scripted(JobHostService[str]):
    """Work by the job's name: ``done`` returns, ``fail`` and ``unbuildable`` raise
    JobFailure (in run_job, in prepare_job), ``flaky`` raises a retriable error on its first
    attempt, anything else waits until let go."""

    name = "scripted"
    max_jobs: ClassVar[int | None] = 1
    publishes_cancelled: ClassVar[bool] = True

    def __init__(self, kafka: KafkaSettings) -> None:
        super().__init__(
            kafka=kafka, telemetry=telemetry(), worker_id="host-1", retry_backoff_s=0.2
        )
        self.prepared: list[str] = []
        self.attempts: list[str] = []
        self.let_go: list[str] = []
        self.release = asyncio.Event()

    async def prepare_job(self, job: JobView) -> str:
        if job.name == "unbuildable":
            raise JobFailure("cannot build it")
        self.prepared.append(job.job_id)
        return job.name

    async def run_job(self, job: JobView, prepared: str) -> None:
        self.attempts.append(job.job_id)
        if prepared == "done":
            return
        if prepared == "fail":
            raise JobFailure("it broke")
        if prepared == "flaky" and self.attempts.count(job.job_id) == 1:
            raise Flaky("the broker went away")
        if prepared == "flaky":
            return
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.let_go.append(job.job_id)
            raise


async def publish(kafka: KafkaSettings, job_id: str, name: str, **fields: Any) -> None:
    async with Producer(kafka) as producer:
        await producer.publish(
            Topics(kafka.topic_prefix).jobs, job_event(job_id, name, **fields), key=job_id
        )


async def eventually(predicate: Any, timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` (the host's own records change without a jobs-topic event)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the host's own lists have no event to await
            await asyncio.sleep(0.05)


async def submit(kafka: KafkaSettings, job_id: str, name: str) -> None:
    await publish(kafka, job_id, "submitted", spec={"name": name})
    await publish(kafka, job_id, "planned")


async def test_one_job_at_a_time_oldest_first_with_the_outcome_of_each(
    kafka_settings: KafkaSettings,
) -> None:
    host = Scripted(kafka_settings)
    async with job_log(kafka_settings) as (_, jobs), running(host):
        await submit(kafka_settings, "j-wait", "wait")
        await submit(kafka_settings, "j-done", "done")
        await submit(kafka_settings, "j-fail", "fail")
        await submit(kafka_settings, "j-unbuildable", "unbuildable")
        await submit(kafka_settings, "j-flaky", "flaky")
        # max_jobs = 1: only the oldest is taken while it runs. Once the host's view holds
        # every job (a fixed sleep was no proof of that on a loaded machine), and a while after.
        ids = ("j-wait", "j-done", "j-fail", "j-unbuildable", "j-flaky")

        def all_known() -> bool:
            return all((job := host.view.get(i)) is not None and job.servable for i in ids)

        await eventually(all_known)
        await eventually(lambda: host.attempts == ["j-wait"])
        await asyncio.sleep(0.5)
        assert host.attempts == ["j-wait"] and host.hosted_jobs == ["j-wait"]

        await publish(kafka_settings, "j-wait", "cancel_requested", reason="test")
        await jobs.wait_for(lambda: jobs.of("cancelled", "j-wait"), 20)
        assert jobs.of("cancelled", "j-wait")[0] == {
            "reason": "cancel requested", "worker_id": "host-1",
        }  # fmt: skip
        assert host.let_go == ["j-wait"]

        # Then the others, oldest first; each one's end decides its event.
        await jobs.wait_for(lambda: jobs.of("failed", "j-unbuildable"), 20)
        await eventually(lambda: host.attempts.count("j-flaky") == 2)
        # The two failures are keyed by job: they may sit on different partitions of the jobs
        # topic, and the reader here need not have folded the earlier one yet.
        await jobs.wait_for(lambda: jobs.of("failed", "j-fail"), 20)
        assert jobs.of("failed", "j-fail") == [{"reason": "it broke", "worker_id": "host-1"}]
        assert jobs.of("failed", "j-unbuildable")[0]["reason"] == "cannot build it"
        assert not jobs.of("failed", "j-done") and not jobs.of("failed", "j-flaky")
        assert host.attempts == ["j-wait", "j-done", "j-fail", "j-flaky", "j-flaky"]
        # Prepared again for the retry; never for the job that could not be built.
        assert host.prepared == ["j-wait", "j-done", "j-fail", "j-flaky", "j-flaky"]
        # The flaky job's second attempt was counted as it began: its task ends after.
        await eventually(lambda: host.hosted_jobs == [])
        await asyncio.sleep(0.3)
        assert host.hosted_jobs == []  # nothing is taken twice
        assert host.attempts == ["j-wait", "j-done", "j-fail", "j-flaky", "j-flaky"]


async def test_a_job_that_ends_is_let_go_and_a_stop_leaves_the_running_one(
    kafka_settings: KafkaSettings,
) -> None:
    host = Scripted(kafka_settings)
    async with job_log(kafka_settings) as (_, jobs), running(host) as serving:
        await submit(kafka_settings, "j-a", "wait")
        await eventually(lambda: host.attempts == ["j-a"])
        await publish(kafka_settings, "j-a", "completed")  # another process finished it
        await eventually(lambda: host.let_go == ["j-a"])
        assert not jobs.of("cancelled", "j-a")  # let go, not cancelled

        await submit(kafka_settings, "j-b", "wait")
        await eventually(lambda: host.attempts == ["j-a", "j-b"])
        host.request_stop()
        assert await asyncio.wait_for(serving, 30) == 0
        assert host.let_go == ["j-a", "j-b"]
        assert not jobs.of("cancelled", "j-b") and not jobs.of("failed", "j-b")


async def test_a_stop_that_meets_a_change_of_the_jobs_still_ends_the_host(
    kafka_settings: KafkaSettings,
) -> None:
    """Python 3.11's ``asyncio.wait_for`` returned the awaited result when a cancel met its
    completion, dropping the cancel: the host's loop went on waiting for changes, and a stop
    that met a job event never ended (a service's stop in the suite ran out its 30 s)."""
    host = Scripted(kafka_settings)
    async with job_log(kafka_settings):
        hosting = asyncio.create_task(host.run())
        try:
            await host.view_ready()
            await asyncio.sleep(0.2)  # waiting for a change now
            host._wake()  # a change arrives ...
            hosting.cancel()  # ... as the stop cancels run()
            await asyncio.wait({hosting}, timeout=10)
            assert hosting.cancelled()
        finally:
            hosting.cancel()
            await asyncio.wait({hosting}, timeout=10)
