"""Own a process's background tasks: log every crash, restart with backoff, fail loudly.

A task is given as a factory of coroutines (a coroutine can run only once, a restart needs a
fresh one). When a task crashes the traceback is logged and the task restarts after
``backoff_s * 2**n`` seconds; once its restarts are spent (or it was spawned with
``restart=False``) the supervisor is *failed* and calls its ``on_failure`` callback, which in a
:class:`~conveyor.libs.service.Service` stops the process with a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from conveyor.libs.errors import ConveyorError
from conveyor.libs.telemetry import counter

logger = logging.getLogger(__name__)

CoroutineFactory = Callable[[], Awaitable[object]]


class SupervisorError(ConveyorError):
    """The supervisor was used in a state that does not allow it (spawn after stop)."""


@dataclass(frozen=True, slots=True)
class TaskFailure:
    """Why a supervisor failed: the task that gave up and its last exception."""

    task_name: str
    """Name given to :meth:`TaskSupervisor.spawn`."""
    exception: BaseException
    """The exception of the last crash."""
    restarts: int
    """How many times the task had been restarted before it gave up."""


class TaskSupervisor:
    """Runs named background tasks and restarts the ones that crash.

    ``service`` names the metric ``conveyor_<service>_task_crashes_total{task}``.
    ``on_failure`` is called once, synchronously, from the failing task when a task gives up;
    it must not block. All methods must be called from the event loop's thread.
    """

    def __init__(
        self,
        *,
        service: str = "service",
        on_failure: Callable[[TaskFailure], None] | None = None,
    ) -> None:
        self._on_failure = on_failure
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopped = False
        self.failure: TaskFailure | None = None
        """The first task that gave up, or None while every task is fine."""
        self._crashes = counter(
            service,
            "task_crashes_total",
            "Crashes of supervised background tasks (each is logged with its traceback).",
            ["task"],
        )

    @property
    def failed(self) -> bool:
        """True once a task crashed and may not (or may no longer) be restarted."""
        return self.failure is not None

    @property
    def running(self) -> list[str]:
        """Names of the tasks that have not finished yet."""
        return [name for name, task in self._tasks.items() if not task.done()]

    def spawn(
        self,
        name: str,
        coro_factory: CoroutineFactory,
        *,
        restart: bool = True,
        max_restarts: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 60.0,
    ) -> asyncio.Task[None]:
        """Start ``coro_factory()`` as the task ``name`` and supervise it.

        A normal return ends the task for good (no restart). ``CancelledError`` is not a crash.
        Any other exception is logged with its traceback and, if ``restart``, the task restarts
        after ``min(backoff_s * 2**n, max_backoff_s)`` seconds, at most ``max_restarts`` times;
        a run that lasted ``healthy_after_s`` seconds or more resets the count. Returns the
        supervising task (it finishes when the supervised task is done for good).
        Raises ValueError if a task of that name still runs, SupervisorError after ``stop()``.
        """
        if self._stopped:
            raise SupervisorError(f"cannot spawn {name!r}: the supervisor is stopped")
        if name in self.running:
            raise ValueError(f"a task named {name!r} is already running")
        if max_restarts < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("max_restarts, backoff_s and max_backoff_s must be >= 0")
        task = asyncio.get_running_loop().create_task(
            self._supervise(
                name,
                coro_factory,
                max_restarts=max_restarts if restart else 0,
                backoff_s=backoff_s,
                max_backoff_s=max_backoff_s,
                healthy_after_s=healthy_after_s,
            ),
            name=name,
        )
        self._tasks[name] = task
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        # Finished tasks leave the table, so names can be reused and nothing accumulates.
        if self._tasks.get(task.get_name()) is task:
            del self._tasks[task.get_name()]

    async def _supervise(
        self,
        name: str,
        coro_factory: CoroutineFactory,
        *,
        max_restarts: int,
        backoff_s: float,
        max_backoff_s: float,
        healthy_after_s: float,
    ) -> None:
        restarts = 0
        while True:
            started = time.monotonic()
            try:
                await coro_factory()
            except asyncio.CancelledError:
                if not self._stopped:
                    logger.warning("task %s was cancelled; it will not be restarted", name)
                raise
            except Exception as exc:
                self._crashes.labels(task=name).inc()
                if time.monotonic() - started >= healthy_after_s:
                    restarts = 0
                if restarts >= max_restarts:
                    logger.exception(
                        "task %s crashed and gives up after %d restart(s)", name, restarts
                    )
                    self._fail(TaskFailure(task_name=name, exception=exc, restarts=restarts))
                    return
                delay_s = min(backoff_s * 2**restarts, max_backoff_s)
                restarts += 1
                logger.exception(
                    "task %s crashed; restart %d/%d in %.2fs",
                    name,
                    restarts,
                    max_restarts,
                    delay_s,
                )
                await asyncio.sleep(delay_s)
            else:
                logger.info("task %s finished", name)
                return

    def _fail(self, failure: TaskFailure) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        if self._on_failure is not None:
            self._on_failure(failure)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Cancel every task and wait until they finish (at most ``timeout_s`` if given).

        Idempotent. Tasks still running after ``timeout_s`` (they ignored cancellation) are
        logged by name and left behind.
        """
        self._stopped = True
        tasks = [task for task in self._tasks.values() if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                logger.error(
                    "tasks still running %.1fs after cancel: %s",
                    timeout_s,
                    sorted(task.get_name() for task in pending),
                )
