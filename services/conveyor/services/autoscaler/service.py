"""The autoscaler service: measures, decides (:class:`~.policy.ScalingPolicy`), acts through
its driver, and publishes every decision.

Every ``interval_s``: the driver restarts what died (the local driver; each restart is a
``ServiceRestarted`` record), the :class:`~.measure.Meter` looks at the work, the policy decides,
the driver carries the decision out, and a ``ScalingDecision`` with every input goes to
``Topics.autoscaler`` (changes always; a ``hold`` at most every ``report_every_s``, so the
gateway always has a recent state), to the log and to the metrics.

A driver or broker failure is logged and tried again at the next interval; the pool keeps its
size meanwhile. One autoscaler per pool: two would act on the same measurements twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack

from conveyor.platform.bus import BusError, Producer, wait_for_topics
from conveyor.platform.bus.group_lag import GroupLagReader
from conveyor.platform.config import KafkaSettings, TelemetrySettings
from conveyor.platform.messages import Message, ScalingDecision, ServiceRestarted, Topics
from conveyor.platform.service import Service
from conveyor.platform.telemetry import counter, gauge
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.drivers import DriverError, Restart, ScaleDriver
from conveyor.services.autoscaler.measure import Measurement, Meter
from conveyor.services.autoscaler.policy import ScalingPolicy, Signals, Verdict
from conveyor.training.joblog import JobLogReader
from conveyor.training.jobview import JobsView

logger = logging.getLogger(__name__)

POOL = "preprocessor"
"""The pool the autoscaler sizes."""

_DECISIONS = counter("autoscaler", "decisions_total", "Decisions that changed the pool.",
                     ["service", "action"])  # fmt: skip
_REPLICAS = gauge("autoscaler", "replicas", "Replicas of the pool after the last decision.",
                  ["service"])  # fmt: skip
_WAIT = gauge("autoscaler", "data_wait_ratio", "Largest running job's trainers' data wait.")
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
    ) -> None:
        super().__init__(telemetry=telemetry)
        self.settings = settings
        self.driver = driver
        self.kafka = kafka
        self.topics = Topics(kafka.topic_prefix)
        self.policy = ScalingPolicy(settings.policy())
        self.view = JobsView()
        self.decisions: list[ScalingDecision] = []
        """Every decision published by this process (tests and the log read them)."""
        self._last_report_at: float | None = None
        self._producer: Producer | None = None

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            await self.driver.close()

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
            await reader.wait_ready()
            meter = Meter(lags=lags, view=self.view, topics=topics,
                          max_age_s=self.settings.signal_max_age_s)  # fmt: skip
            first = True
            while True:
                await self._supervise()
                await self._step(meter, first=first)
                first = False
                await asyncio.sleep(self.settings.interval_s)

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
                              shards_lag=measured.shards_lag, jobs=measured.jobs)  # fmt: skip
            verdict = self.policy.decide(signals)
            if verdict.target != replicas:
                await self.driver.scale(verdict.target)
        except (DriverError, BusError) as exc:
            _FAILURES.inc()
            logger.warning("autoscaler: no decision this interval: %s", exc)
            return
        if first and verdict.action == "hold":
            verdict = Verdict(action="start", target=verdict.target, reason=verdict.reason)
        await self._decided(verdict, replicas, measured)

    async def _decided(self, verdict: Verdict, replicas: int, measured: Measurement) -> None:
        waits = [j.data_wait_ratio for j in measured.jobs if j.data_wait_ratio is not None]
        _WAIT.set(max(waits, default=0.0))
        _SHARDS_LAG.set(measured.shards_lag)
        _REPLICAS.labels(service=POOL).set(verdict.target)
        changed = verdict.target != replicas
        due = (self._last_report_at is None
               or measured.at - self._last_report_at >= self.settings.report_every_s)  # fmt: skip
        if not (changed or due or verdict.action == "start"):
            return
        self._last_report_at = measured.at
        decision = ScalingDecision(
            worker_id=self.settings.worker_id, service=POOL, driver=self.driver.name,
            action=verdict.action, replicas_before=replicas, replicas_after=verdict.target,
            min_replicas=self.settings.min_replicas, max_replicas=self.settings.max_replicas,
            partitions=measured.partitions, reason=verdict.reason,
            shards_lag=measured.shards_lag, shards_per_second=measured.shards_per_second,
            jobs=measured.jobs, decided_at=measured.at,
        )  # fmt: skip
        self.decisions.append(decision)
        if changed:
            _DECISIONS.labels(service=POOL, action=verdict.action).inc()
            logger.info("%s %s: %d -> %d replicas: %s (shards lag %d, jobs %s)",
                        verdict.action, POOL, replicas, verdict.target, verdict.reason,
                        measured.shards_lag, [(j.job_id, j.data_wait_ratio, j.batches_lag)
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
