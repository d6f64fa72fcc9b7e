"""``start()`` paired with an idempotent ``stop()``, exposed as ``async with``: the shape of
every client and service object in Conveyor (producer, consumer, tail, admin, service)."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class AsyncLifecycle(abc.ABC):
    """A resource used as ``async with obj:`` (``start()`` on entry, ``stop()`` on exit).

    ``stop()`` must be safe to call twice and after a failed ``start()``.
    """

    @abc.abstractmethod
    async def start(self) -> None:
        """Acquire the resource (connect, bind, ...)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release it; idempotent."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
