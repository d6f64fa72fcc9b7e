"""TaskSupervisor: restarts with backoff, gives up loudly, stops everything."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from conveyor.libs.supervisor import SupervisorError, TaskFailure, TaskSupervisor

SERVICE = "supervisortest"


def crashes(task_name: str) -> float:
    value = REGISTRY.get_sample_value(f"conveyor_{SERVICE}_task_crashes_total", {"task": task_name})
    return value or 0.0


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_crashing_task_restarts_n_times_then_fails(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[TaskFailure] = []
    supervisor = TaskSupervisor(service=SERVICE, on_failure=failures.append)
    name = unique("crasher")
    started_at: list[float] = []

    async def crash() -> None:
        started_at.append(time.monotonic())
        raise RuntimeError(f"attempt {len(started_at)}")

    with caplog.at_level(logging.ERROR, logger="conveyor.libs.supervisor"):
        task = supervisor.spawn(name, crash, max_restarts=3, backoff_s=0.02)
        await asyncio.wait_for(task, timeout=5)

    assert len(started_at) == 4  # first run + 3 restarts
    gaps = [b - a for a, b in itertools.pairwise(started_at)]
    for gap, expected in zip(gaps, [0.02, 0.04, 0.08], strict=True):
        assert gap >= expected * 0.9
    assert supervisor.failed
    assert len(failures) == 1
    assert failures[0].task_name == name
    assert failures[0].restarts == 3
    assert str(failures[0].exception) == "attempt 4"
    assert supervisor.failure == failures[0]
    assert crashes(name) == 4
    # every crash logged with its traceback, never silent
    crash_logs = [r for r in caplog.records if name in r.getMessage()]
    assert len(crash_logs) == 4
    assert all(r.exc_info is not None for r in crash_logs)
    assert "gives up" in crash_logs[-1].getMessage()
    assert supervisor.running == []


async def test_no_restart_fails_on_first_crash() -> None:
    failures: list[TaskFailure] = []
    supervisor = TaskSupervisor(service=SERVICE, on_failure=failures.append)
    calls = 0

    async def crash() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("bad")

    await asyncio.wait_for(supervisor.spawn(unique("once"), crash, restart=False), timeout=5)
    assert calls == 1
    assert [f.restarts for f in failures] == [0]
    assert isinstance(failures[0].exception, ValueError)


async def test_task_that_returns_is_not_restarted() -> None:
    supervisor = TaskSupervisor(service=SERVICE)
    calls = 0

    async def finish() -> None:
        nonlocal calls
        calls += 1

    name = unique("finisher")
    await asyncio.wait_for(supervisor.spawn(name, finish), timeout=5)
    await asyncio.sleep(0.05)
    assert calls == 1
    assert not supervisor.failed
    assert crashes(name) == 0
    # the name is free again once the task is done
    await asyncio.wait_for(supervisor.spawn(name, finish), timeout=5)
    assert calls == 2


async def test_cancelled_error_is_not_a_crash() -> None:
    supervisor = TaskSupervisor(service=SERVICE)
    calls = 0

    async def cancelled() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    name = unique("cancelled")
    task = supervisor.spawn(name, cancelled)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=5)
    assert calls == 1
    assert not supervisor.failed
    assert crashes(name) == 0


async def test_long_healthy_run_resets_restart_count() -> None:
    supervisor = TaskSupervisor(service=SERVICE)
    calls = 0

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls <= 5:
            raise RuntimeError("flaky")

    # Every run counts as healthy (healthy_after_s=0), so 5 crashes never exhaust 1 restart.
    task = supervisor.spawn(unique("flaky"), flaky, max_restarts=1, backoff_s=0, healthy_after_s=0)
    await asyncio.wait_for(task, timeout=5)
    assert calls == 6
    assert not supervisor.failed


async def test_stop_cancels_everything_and_is_idempotent() -> None:
    supervisor = TaskSupervisor(service=SERVICE)
    started = 0
    cancelled: list[str] = []

    async def forever(name: str) -> None:
        nonlocal started
        started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def backing_off() -> None:
        raise RuntimeError("waits in backoff when stopped")

    names = [unique("loop") for _ in range(3)]
    for name in names:
        supervisor.spawn(name, lambda name=name: forever(name))
    supervisor.spawn(unique("backoff"), backing_off, backoff_s=60)
    await asyncio.sleep(0.05)
    assert started == 3
    assert len(supervisor.running) == 4

    await asyncio.wait_for(supervisor.stop(), timeout=5)
    assert sorted(cancelled) == sorted(names)
    assert supervisor.running == []
    assert not supervisor.failed
    await asyncio.wait_for(supervisor.stop(), timeout=5)  # idempotent
    with pytest.raises(SupervisorError):
        supervisor.spawn("late", backing_off)


async def test_stop_timeout_leaves_stubborn_task(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = TaskSupervisor(service=SERVICE)
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores cancellation on purpose

    name = unique("stubborn")
    task = supervisor.spawn(name, stubborn)
    await asyncio.sleep(0.01)
    with caplog.at_level(logging.ERROR, logger="conveyor.libs.supervisor"):
        await asyncio.wait_for(supervisor.stop(timeout_s=0.1), timeout=5)
    assert any(name in r.getMessage() for r in caplog.records)
    release.set()
    await asyncio.wait_for(task, timeout=5)


async def test_spawn_validates_arguments() -> None:
    supervisor = TaskSupervisor(service=SERVICE)
    name = unique("dup")
    supervisor.spawn(name, asyncio.Event().wait)
    with pytest.raises(ValueError, match="already running"):
        supervisor.spawn(name, asyncio.Event().wait)
    with pytest.raises(ValueError, match=">= 0"):
        supervisor.spawn(unique("neg"), asyncio.Event().wait, max_restarts=-1)
    await supervisor.stop()
