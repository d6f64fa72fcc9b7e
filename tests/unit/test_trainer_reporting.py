"""When the trainer reports progress: rate limit, prompt reports while waiting, flow steps."""

from __future__ import annotations

import asyncio
from typing import Any

from conveyor.libs.messages import Heartbeat, JobEvent, Message
from conveyor.services.trainer.reporting import Reporter


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    async def send(self, topic: str, message: Message, *, key: Any = None) -> asyncio.Future[None]:
        self.sent.append((topic, message))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class State:
    consumed = 0
    waiting = False


def reporter(producer: FakeProducer, state: State) -> Reporter:
    return Reporter(
        producer,  # type: ignore[arg-type]
        jobs_topic="jobs",
        control_topic="control",
        job_id="j1",
        worker_id="w1",
        progress_interval_s=0.5,
        heartbeat_interval_s=3.0,
        lead_batches=16,
        progress=lambda: {"consumed_batches": state.consumed, "step": state.consumed // 2},
        heartbeat=lambda: {"step": 1},
        waiting=lambda: state.waiting,
    )


def consumed_reported(producer: FakeProducer) -> list[int]:
    return [
        m.data["consumed_batches"]
        for _, m in producer.sent
        if isinstance(m, JobEvent) and m.event == "progress"
    ]


async def test_progress_is_rate_limited_unless_waiting_or_a_flow_step_passed() -> None:
    producer, state = FakeProducer(), State()
    report = reporter(producer, state)
    await report.maybe_send_progress(now=10.0)  # first report: due
    state.consumed = 1
    await report.maybe_send_progress(now=10.1)  # busy, changed by 1 < 16 / 4: held back
    state.consumed = 4
    await report.maybe_send_progress(now=10.2)  # a quarter of the lead consumed: sent
    state.consumed = 5
    state.waiting = True
    await report.maybe_send_progress(now=10.25)  # the step loop starves: sent at once
    await report.maybe_send_progress(now=10.3)  # nothing changed: nothing sent
    state.waiting = False
    state.consumed = 6
    await report.maybe_send_progress(now=10.8)  # the interval passed: sent
    report.request_progress()
    await report.maybe_send_progress(now=10.85)  # asked for (epoch end): sent though unchanged
    assert consumed_reported(producer) == [0, 4, 5, 6, 6]
    first = producer.sent[0]
    assert first[0] == "jobs" and isinstance(first[1], JobEvent)
    assert first[1].data["worker_id"] == "w1" and first[1].job_id == "j1"


async def test_heartbeats_go_to_the_control_topic() -> None:
    producer, state = FakeProducer(), State()
    await reporter(producer, state).send_heartbeat()
    topic, message = producer.sent[0]
    assert topic == "control" and isinstance(message, Heartbeat)
    assert message.role == "trainer" and message.worker_id == "w1" and message.info == {"step": 1}
