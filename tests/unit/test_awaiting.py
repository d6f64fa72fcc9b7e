"""await_chain: the innermost await of a stuck task, through coroutines and awaited tasks."""

from __future__ import annotations

import asyncio

from conveyor.platform.awaiting import await_chain


async def _stuck_here(event: asyncio.Event) -> None:
    await event.wait()


async def _outer(event: asyncio.Event) -> None:
    await _stuck_here(event)


async def _through_a_task(event: asyncio.Event) -> None:
    await asyncio.create_task(_outer(event))


async def test_the_chain_names_each_await_down_to_the_innermost() -> None:
    event = asyncio.Event()
    task = asyncio.create_task(_through_a_task(event))
    await asyncio.sleep(0.01)
    functions = [line.rsplit(" in ", 1)[1] for line in await_chain(task)]
    assert functions == ["_through_a_task", "_outer", "_stuck_here", "wait"]
    assert all("test_awaiting.py:" in line for line in await_chain(task)[:3])
    event.set()
    await task
    assert await_chain(task) == []
