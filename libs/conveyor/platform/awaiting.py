"""Where a task is stuck: the chain of awaits of a suspended asyncio task, for the log.

``Task.get_stack()`` gives one frame for a suspended coroutine (the outermost); a stop that
overruns needs the innermost await, which is found by following ``cr_await`` from the task's
coroutine through nested coroutines and tasks.
"""

from __future__ import annotations

import asyncio
from typing import Any

MAX_DEPTH = 64
"""Most awaits followed (a cycle cannot happen, a very deep chain is cut)."""


def await_chain(task: asyncio.Task[Any]) -> list[str]:
    """``file:line in function`` for each coroutine ``task`` awaits through, outermost first;
    a task it awaits is followed into (CPython's ``Task._fut_waiter``: what a suspended task
    waits on), a plain future ends the chain. Empty once it is done."""
    chain: list[str] = []
    current: asyncio.Task[Any] | None = task
    while current is not None and not current.done() and len(chain) < MAX_DEPTH:
        awaited: Any = current.get_coro()
        while awaited is not None and len(chain) < MAX_DEPTH:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                break
            code = frame.f_code
            chain.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        waiter = getattr(current, "_fut_waiter", None)
        current = waiter if isinstance(waiter, asyncio.Task) else None
    return chain
