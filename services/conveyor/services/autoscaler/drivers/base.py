"""What the autoscaler asks of a driver: count a pool's replicas, set them, and (the local
driver only) restart the stack's dead services."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from conveyor.platform.errors import ConveyorError


class DriverError(ConveyorError):
    """The driver could not read or change the pool (engine or API unreachable, refused).

    Retriable: the service logs it and tries again at its next interval."""

    retriable = True


@dataclass(kw_only=True, slots=True, frozen=True)
class Restart:
    """A dead service process started again by the supervisor."""

    service: str
    """The service it runs (``preprocessor``)."""
    instance: str
    """Its name in the stack (``trainer``, ``preprocessor-2``)."""
    old_pid: int
    new_pid: int
    restarts: int
    """Restarts of this instance since the supervisor started."""
    backoff_s: float
    """Seconds waited after noticing the death."""


class ScaleDriver(abc.ABC):
    """Counts and sets the replicas of one pool. Calls come from one task, never concurrently.

    ``replicas()`` is what runs (or is asked to run) now; ``scale(n)`` returns once the change
    is requested (containers or processes may still be starting). Both raise
    :class:`DriverError` when the backend cannot be read or refuses.
    """

    name: str
    """``local``, ``docker`` or ``kubernetes``."""

    @abc.abstractmethod
    async def replicas(self) -> int: ...

    @abc.abstractmethod
    async def scale(self, replicas: int) -> None: ...

    async def supervise(self) -> list[Restart]:
        """Restart what died (the local driver); the others leave that to their orchestrator."""
        return []

    async def close(self) -> None:  # noqa: B027 (optional: most drivers hold a client)
        """Release connections. Idempotent."""
