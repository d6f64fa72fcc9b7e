"""The autoscaler's measurements: the running jobs' data wait (their trainers' progress events
on ``conveyor.jobs``, folded into a :class:`JobsView`), the preprocessors' busy ratio (their
``PreprocessorLoad`` reports on ``conveyor.autoscaler``, folded into a :class:`PoolLoad`), the
consumer lag of the preprocessor group and of each job's trainers, and the preprocessor group's
throughput."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.platform.bus.group_lag import GroupLagReader
from conveyor.platform.messages import JobSignals, PreprocessorLoad, Topics
from conveyor.training.jobview import JobsView, JobView

RUNNING_STATES = ("planned", "running")


@dataclass(kw_only=True, slots=True, frozen=True)
class Measurement:
    """One look at the pool's work (lags in records, times in unix seconds)."""

    at: float
    partitions: int
    """Partitions of the shards topic."""
    shards_lag: int
    shards_per_second: float | None
    """Shard tasks committed by the preprocessor group per second since the last look."""
    jobs: list[JobSignals]
    busy_ratio: float | None
    """Mean busy ratio of the preprocessors that reported within the age limit (None: none)."""
    preprocessors_reporting: int
    trainers_asked: int
    """Trainers the servable jobs (running or queued) ask for (``distribution.trainers``)."""
    jobs_queued: int
    """Jobs waiting in the scheduler's queue."""


class PoolLoad:
    """The preprocessors' latest busy reports, by worker: a fold with no I/O."""

    def __init__(self) -> None:
        self._last: dict[str, PreprocessorLoad] = {}

    def apply(self, load: PreprocessorLoad) -> None:
        """Fold one report; an older one read late does not replace a newer one."""
        previous = self._last.get(load.worker_id)
        if previous is None or load.at >= previous.at:
            self._last[load.worker_id] = load

    def busy(self, *, now: float, max_age_s: float) -> tuple[float | None, int]:
        """(mean busy ratio, reports counted) over the reports younger than ``max_age_s``
        seconds at ``now`` (unix seconds) from preprocessors that did not say they leave."""
        fresh = [load.busy_ratio for load in self._last.values()
                 if not load.leaving and now - load.at <= max_age_s]  # fmt: skip
        return (sum(fresh) / len(fresh) if fresh else None), len(fresh)


def job_signals(job: JobView, *, now: float, max_age_s: float, batches_lag: int) -> JobSignals:
    """The job's trainers' mean recent data wait over the reports younger than ``max_age_s``."""
    fresh = [
        worker.data_wait_ratio
        for worker in job.workers.values()
        if now - worker.at <= max_age_s and worker.data_wait_ratio is not None
    ]
    ratio = min(1.0, max(0.0, sum(fresh) / len(fresh))) if fresh else None
    return JobSignals(job_id=job.job_id, trainers=len(fresh), data_wait_ratio=ratio,
                      batches_lag=batches_lag)  # fmt: skip


class Meter:
    """Takes :class:`Measurement` s; keeps the last committed total for the throughput."""

    def __init__(
        self,
        *,
        lags: GroupLagReader,
        view: JobsView,
        load: PoolLoad,
        topics: Topics,
        max_age_s: float,
    ) -> None:
        self._lags = lags
        self._view = view
        self._load = load
        self._topics = topics
        self._max_age_s = max_age_s
        self._last: tuple[float, int] | None = None
        """(at, shard tasks committed) of the previous look."""

    async def measure(self, now: float) -> Measurement:
        """Raises BusError when the broker cannot be read."""
        topics = self._topics
        shards = await self._lags.progress(topics.preprocessor_group, topics.shards)
        # Every unfinished job, however many ended ones the view holds.
        unfinished = self._view.unfinished()
        running = [job for job in unfinished if job.state in RUNNING_STATES]
        jobs = []
        for job in running:
            batches = await self._lags.progress(topics.trainer_group(job.job_id),
                                                topics.batches(job.job_id))  # fmt: skip
            jobs.append(job_signals(job, now=now, max_age_s=self._max_age_s,
                                    batches_lag=batches.lag))  # fmt: skip
        done, rate = shards.committed, None
        if self._last is not None and now > self._last[0]:
            rate = max(0.0, (done - self._last[1]) / (now - self._last[0]))
        self._last = (now, done)
        busy, reporting = self._load.busy(now=now, max_age_s=self._max_age_s)
        servable = [job.demand for job in unfinished
                    if job.servable and job.demand is not None]  # fmt: skip
        return Measurement(at=now, partitions=shards.partitions, shards_lag=shards.lag,
                           shards_per_second=rate, jobs=jobs, busy_ratio=busy,
                           preprocessors_reporting=reporting,
                           trainers_asked=sum(demand.wanted for demand in servable),
                           jobs_queued=len(self._view.schedule().queue))  # fmt: skip
