"""When the trainer reports progress (rate limit, changes only, an interval that stretches with
the time on the job) and what its heartbeats carry."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from heartbeats import trainer_state
from job_events import TRAINER_DEFAULTS

from conveyor.platform.messages import Heartbeat, Message, TrainerProgress
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.reporting.reporter import Reporter


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    async def send(self, topic: str, message: Message, *, key: Any = None) -> asyncio.Future[None]:
        self.sent.append((topic, message))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class State:
    step = 0
    samples = 0
    built = 0
    """Progress figures built so far."""

    def progress(self) -> dict[str, Any]:
        self.built += 1
        return {**TRAINER_DEFAULTS, "step": self.step, "samples_trained": self.samples}


def reporter(producer: FakeProducer, state: State) -> Reporter:
    return Reporter(
        producer,  # type: ignore[arg-type]
        jobs_topic="jobs",
        control_topic="control",
        job_id="j1",
        worker_id="w1",
        progress_interval_s=0.5,
        progress_max_interval_s=5.0,
        heartbeat_interval_s=1.0,
        progress=state.progress,
        heartbeat=lambda: trainer_state(version=1, samples_per_second=10.0),
        started_at=10.0,
    )


def steps_reported(producer: FakeProducer) -> list[int]:
    return [m.step for _, m in producer.sent if isinstance(m, TrainerProgress)]


async def test_progress_is_rate_limited_and_sent_only_when_it_changed() -> None:
    producer, state = FakeProducer(), State()
    report = reporter(producer, state)
    await report.maybe_send_progress(now=10.0)  # first report: due
    state.step = 1
    await report.maybe_send_progress(now=10.1)  # changed, but within the interval: held back
    await report.maybe_send_progress(now=10.6)  # the interval passed: sent
    await report.maybe_send_progress(now=11.5)  # nothing changed: nothing sent
    state.samples = 64
    await report.maybe_send_progress(now=11.6)  # changed and due
    report.request_progress()
    await report.maybe_send_progress(now=11.65)  # asked for (epoch end): sent though unchanged
    assert steps_reported(producer) == [0, 1, 1, 1]
    # The figures are built only when an event is due: at 10.0, 10.6, 11.5, 11.6 and 11.65.
    assert state.built == 5
    first = producer.sent[0]
    assert first[0] == "jobs" and isinstance(first[1], TrainerProgress)
    assert first[1].worker_id == "w1" and first[1].job_id == "j1"


async def test_a_long_jobs_progress_comes_less_often_up_to_the_most_interval() -> None:
    producer, state = FakeProducer(), State()
    report = reporter(producer, state)  # on the job since t = 10 s
    assert report.progress_interval_at(10.0 + 20.0) == 0.5  # the first 30 s: the least
    assert report.progress_interval_at(10.0 + 120.0) == 2.0  # a 60th of the time on the job
    assert report.progress_interval_at(10.0 + 3600.0) == 5.0  # capped
    sent_at = []
    for tick in range(10 * 60):  # an hour in, a step every 0.1 s for a minute
        now = 10.0 + 3600.0 + tick * 0.1
        state.step += 1
        before = len(producer.sent)
        await report.maybe_send_progress(now)
        if len(producer.sent) > before:
            sent_at.append(now)
    assert len(sent_at) == 12  # one per 5 s, not 120
    assert all(b - a >= 5.0 - 1e-9 for a, b in itertools.pairwise(sent_at))
    report.request_progress()
    await report.maybe_send_progress(now=sent_at[-1] + 0.1)  # an epoch end is not held back
    assert len(steps_reported(producer)) == 13


def test_the_most_interval_is_at_least_the_least() -> None:
    with pytest.raises(ValueError, match="progress_max_interval_s"):
        TrainerSettings(progress_interval_s=10.0, progress_max_interval_s=5.0)
    assert TrainerSettings().progress_max_interval_s == 5.0


async def test_heartbeats_go_to_the_control_topic() -> None:
    producer, state = FakeProducer(), State()
    report = reporter(producer, state)
    await report.send_heartbeat()
    await report.send_heartbeat(leaving=True)
    (topic, message), (_, leaving) = producer.sent
    assert topic == "control" and isinstance(message, Heartbeat)
    assert message.worker_id == "w1" and not message.leaving
    assert (message.state.version, message.state.samples_per_second) == (1, 10.0)
    assert isinstance(leaving, Heartbeat) and leaving.leaving is True
