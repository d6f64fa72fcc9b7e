"""The autoscaler service: measures, decides (:class:`~.policy.ScalingPolicy`), acts through
its driver, and publishes every decision.

A reader folds the preprocessors' busy reports (``PreprocessorLoad`` on ``Topics.autoscaler``,
read from the topic's end: only recent reports count) into a :class:`~.measure.PoolLoad`.
Every ``interval_s``: the driver restarts what died (the local driver; each restart is a
``ServiceRestarted`` record), the :class:`~.measure.Meter` looks at the work, the policy decides,
the driver carries the decision out, and a ``ScalingDecision`` with every input goes to
``Topics.autoscaler`` (changes always; a ``hold`` at most every ``report_every_s``, so the
gateway always has a recent state), to the log and to the metrics. With a trainer driver
(``trainer_max_replicas`` > 0), the same measurement also sizes the trainer pool
(:class:`~.trainers.TrainerPolicy`: what the queued and running jobs ask for), published as
decisions of service ``trainer``.

A driver or broker failure is logged and tried again at the next interval; the pool keeps its
size meanwhile. One autoscaler per pool: two would act on the same measurements twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import AsyncExitStack

from conveyor.platform.bus import BusError, Producer, TopicTail, wait_for_topics
from conveyor.platform.bus.group_lag import GroupLagReader
from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.messages import (
    Message,
    PreprocessorLoad,
    ScalingDecision,
    ServiceRestarted,
    Topics,
)
from conveyor.platform.service import Service
from conveyor.platform.telemetry import counter, gauge
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.drivers import POOL, TRAINERS, DriverError, Restart, ScaleDriver
from conveyor.services.autoscaler.measure import Measurement, Meter, PoolLoad
from conveyor.services.autoscaler.policy import ScalingPolicy, Signals, Verdict
from conveyor.services.autoscaler.trainers import TrainerPolicy
from conveyor.training.joblog import JobLogReader
from conveyor.training.jobview import JobsView

logger = logging.getLogger(__name__)


_DECISIONS_KEPT = 1024
"""Decisions kept in memory: one per pool at least every report interval, for months."""
_DECISIONS = counter("autoscaler", "decisions_total", "Decisions that changed the pool.",
                     ["service", "action"])  # fmt: skip
_REPLICAS = gauge("autoscaler", "replicas", "Replicas of the pool after the last decision.",
                  ["service"])  # fmt: skip
_WAIT = gauge("autoscaler", "data_wait_ratio", "Largest running job's trainers' data wait.")
_BUSY = gauge("autoscaler", "preprocessor_busy_ratio",
              "Mean busy ratio of the preprocessors that reported recently.")  # fmt: skip
_SHARDS_LAG = gauge("autoscaler", "shards_lag", "Shard tasks waiting for the preprocessors.")
_RESTARTS = counter("autoscaler", "restarts_total", "Dead services started again.", ["service"])
_FAILURES = counter("autoscaler", "failures_total", "Intervals lost to a broker/driver error.")


class AutoscalerService(Service):
    """One autoscaler process around ``driver`` (built by the entry point)."""

    name = "autoscaler"

    def __init__(
        self,
        *,
        settings: AutoscalerSettings,
        driver: ScaleDriver,
        kafka: KafkaSettings,
        telemetry: TelemetrySettings,
        trainer_driver: ScaleDriver | None = None,
    ) -> None:
        """``trainer_driver``: sizes the trainer pool (required when the settings scale it,
        refused when they do not)."""
        super().__init__(telemetry=telemetry)
        if (trainer_driver is not None) != (settings.trainer_pool() is not None):
            raise ValueError("a trainer driver goes with trainer_max_replicas > 0, and only then")
        self.settings = settings
        self.driver = driver
        self.trainer_driver = trainer_driver
        trainer_pool = settings.trainer_pool()
        self.trainer_policy = TrainerPolicy(trainer_pool) if trainer_pool is not None else None
        self.kafka = kafka
        self.topics = Topics(kafka.topic_prefix)
        self.policy = ScalingPolicy(settings.policy())
        self.view = JobsView(serving=False, ended_specs=False)  # it serves no job through the API
        self.load = PoolLoad()
        self.decisions: deque[ScalingDecision] = deque(maxlen=_DECISIONS_KEPT)
        """The latest decisions this process published (tests read them; the topic has all)."""
        self._last_report_at: dict[str, float] = {}
        """Pool -> when its last decision was published."""
        self._producer: Producer | None = None

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            await self.driver.close()
            if self.trainer_driver is not None:
                await self.trainer_driver.close()

    async def _run(self) -> None:
        topics = self.topics
        # The supervisor restarts what died while the broker is still being waited for.
        waiting = asyncio.create_task(wait_for_topics(
            self.kafka, [topics.jobs, topics.shards, topics.autoscaler]
        ))  # fmt: skip
        try:
            while not waiting.done():
                await self._supervise()
                await asyncio.wait([waiting], timeout=self.settings.interval_s)
            await waiting
        finally:
            waiting.cancel()
        reader = JobLogReader(self.kafka, topics.jobs, self.view, service=self.name)
        await reader.start()
        async with AsyncExitStack() as stack, asyncio.TaskGroup() as group:
            stack.push_async_callback(reader.stop)
            self._producer = await stack.enter_async_context(Producer(self.kafka))
            lags = await stack.enter_async_context(GroupLagReader(self.kafka))
            group.create_task(reader.run(), name="autoscaler.jobs")
            loads = await stack.enter_async_context(
                TopicTail(self.kafka, topics.autoscaler, start="last")
            )
            loads_read = asyncio.Event()
            group.create_task(self._follow_loads(loads, loads_read), name="autoscaler.loads")
            # The first look sees the jobs topic and the preprocessors' last reports as they
            # are: without the reports, a backlog alone would scale up beside idle ones.
            await reader.wait_ready()
            await loads_read.wait()
            meter = Meter(lags=lags, view=self.view, load=self.load, topics=topics,
                          max_age_s=self.settings.signal_max_age_s)  # fmt: skip
            first = True
            while True:
                await self._supervise()
                await self._step(meter, first=first)
                first = False
                await asyncio.sleep(self.settings.interval_s)

    async def _follow_loads(self, tail: TopicTail, read: asyncio.Event) -> None:
        """Fold the preprocessors' reports until cancelled (the topic's other records are the
        autoscaler's own); ``read`` is set once the last ones at start are folded. A broker
        error ends the service: its supervisor restarts it."""
        while True:
            if tail.caught_up:
                read.set()
            for record in await tail.get_many(1.0):
                if isinstance(record.message, PreprocessorLoad):
                    self.load.apply(record.message)

    async def _supervise(self) -> None:
        try:
            restarts = await self.driver.supervise()
        except DriverError as exc:
            _FAILURES.inc()
            logger.warning("supervisor: %s", exc)
            return
        for restart in restarts:
            await self._restarted(restart)

    async def _step(self, meter: Meter, *, first: bool) -> None:
        try:
            replicas = await self.driver.replicas()
            measured = await meter.measure(time.time())
            signals = Signals(at=measured.at, replicas=replicas, partitions=measured.partitions,
                              shards_lag=measured.shards_lag, jobs=measured.jobs,
                              busy_ratio=measured.busy_ratio)  # fmt: skip
            verdict = self.policy.decide(signals)
            if verdict.target != replicas:
                await self.driver.scale(verdict.target)
        except (DriverError, BusError) as exc:
            _FAILURES.inc()
            logger.warning("autoscaler: no decision this interval: %s", exc)
            return
        settings = self.settings
        await self._decided(POOL, self.driver, verdict, replicas, measured, first=first,
                            bounds=(settings.min_replicas, settings.max_replicas))  # fmt: skip
        if self.trainer_policy is not None and self.trainer_driver is not None:
            await self._step_trainers(self.trainer_policy, self.trainer_driver, measured,
                                      first=first)  # fmt: skip

    async def _step_trainers(
        self, policy: TrainerPolicy, driver: ScaleDriver, measured: Measurement, *, first: bool
    ) -> None:
        try:
            replicas = await driver.replicas()
            verdict = policy.decide(
                at=measured.at,
                replicas=replicas,
                asked=measured.trainers_asked,
                queued=measured.jobs_queued,
            )
            if verdict.target != replicas:
                await driver.scale(verdict.target)
        except DriverError as exc:
            _FAILURES.inc()
            logger.warning("autoscaler: no trainer decision this interval: %s", exc)
            return
        config = policy.config
        await self._decided(TRAINERS, driver, verdict, replicas, measured, first=first,
                            bounds=(config.min_replicas, config.max_replicas))  # fmt: skip

    async def _decided(
        self,
        pool: str,
        driver: ScaleDriver,
        verdict: Verdict,
        replicas: int,
        measured: Measurement,
        *,
        first: bool,
        bounds: tuple[int, int],
    ) -> None:
        if first and verdict.action == "hold":
            verdict = Verdict(action="start", target=verdict.target, reason=verdict.reason)
        if pool == POOL:
            waits = [j.data_wait_ratio for j in measured.jobs if j.data_wait_ratio is not None]
            _WAIT.set(max(waits, default=0.0))
            _SHARDS_LAG.set(measured.shards_lag)
            _BUSY.set(measured.busy_ratio or 0.0)
        _REPLICAS.labels(service=pool).set(verdict.target)
        changed = verdict.target != replicas
        last = self._last_report_at.get(pool)
        due = last is None or measured.at - last >= self.settings.report_every_s
        if not (changed or due or verdict.action == "start"):
            return
        self._last_report_at[pool] = measured.at
        decision = ScalingDecision(
            worker_id=self.settings.worker_id, service=pool, driver=driver.name,
            action=verdict.action, replicas_before=replicas, replicas_after=verdict.target,
            min_replicas=bounds[0], max_replicas=bounds[1],
            partitions=measured.partitions, reason=verdict.reason,
            shards_lag=measured.shards_lag, shards_per_second=measured.shards_per_second,
            jobs=measured.jobs, busy_ratio=measured.busy_ratio,
            preprocessors_reporting=measured.preprocessors_reporting, decided_at=measured.at,
        )  # fmt: skip
        self.decisions.append(decision)
        if changed:
            _DECISIONS.labels(service=pool, action=verdict.action).inc()
            logger.info("%s %s: %d -> %d replicas: %s (shards lag %d, busy %s, jobs %s)",
                        verdict.action, pool, replicas, verdict.target, verdict.reason,
                        measured.shards_lag, measured.busy_ratio,
                        [(j.job_id, j.data_wait_ratio, j.batches_lag)
                         for j in measured.jobs])  # fmt: skip
        await self._publish(decision)

    async def _restarted(self, restart: Restart) -> None:
        _RESTARTS.labels(service=restart.service).inc()
        logger.warning("restarted %s (pid %d died; now pid %d, restart %d, after %.1f s)",
                       restart.instance, restart.old_pid, restart.new_pid, restart.restarts,
                       restart.backoff_s)  # fmt: skip
        await self._publish(ServiceRestarted(
            worker_id=self.settings.worker_id, instance=restart.instance,
            old_pid=restart.old_pid, new_pid=restart.new_pid, restarts=restart.restarts,
            backoff_s=restart.backoff_s,
        ))  # fmt: skip

    async def _publish(self, message: Message) -> None:
        if self._producer is None:  # the broker's topics are not there yet: the log has it
            return
        try:
            await self._producer.publish(self.topics.autoscaler, message)
        except BusError as exc:
            logger.warning("could not publish %s: %s", type(message).__name__, exc)
