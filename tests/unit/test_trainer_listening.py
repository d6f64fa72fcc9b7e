"""PlaneListener: the trainer's plane readers rest while it computes (sync) unless it waits."""

from __future__ import annotations

import asyncio

from conveyor.services.trainer.plane.listening import PlaneListener, Signal


class FakeTail:
    """Records what the listener asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


def attached(*, enabled: bool) -> tuple[PlaneListener, Signal, FakeTail, FakeTail]:
    signal = Signal()
    listener = PlaneListener(signal, enabled=enabled)
    control, params = FakeTail(), FakeTail()
    listener.attach(control, params)  # type: ignore[arg-type]
    return listener, signal, control, params


async def test_readers_rest_in_quiet_blocks_and_fetch_while_something_waits() -> None:
    listener, signal, control, params = attached(enabled=True)
    assert not listener.paused and control.calls == []
    ready = False

    async def waiter() -> None:
        await listener.wait_for(lambda: ready)

    with listener.quiet():
        assert listener.paused and control.calls == params.calls == ["pause"]
        with listener.quiet():  # nested: one pause only
            assert control.calls == ["pause"]
        assert listener.paused
        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        assert not listener.paused and control.calls == ["pause", "resume"]
        ready = True
        signal.fire()
        await task
        assert listener.paused and control.calls == ["pause", "resume", "pause"]
        await listener.wait_for(lambda: True)  # nothing to wait for: the readers stay resting
        assert control.calls == ["pause", "resume", "pause"]
    assert not listener.paused
    assert control.calls == params.calls == ["pause", "resume", "pause", "resume"]


async def test_bounded_staleness_keeps_following() -> None:
    listener, _, control, params = attached(enabled=False)
    with listener.quiet():
        assert not listener.paused
    assert control.calls == params.calls == []


async def test_without_readers_waiting_still_works() -> None:
    signal = Signal()
    listener = PlaneListener(signal, enabled=True)
    done = False

    async def finish() -> None:
        nonlocal done
        done = True
        signal.fire()

    with listener.quiet():
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(finish()))
        await asyncio.wait_for(listener.wait_for(lambda: done), 2.0)
    assert done
