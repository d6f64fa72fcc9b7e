"""Find out whether a recorded process still runs, and stop it.

The stack's processes are started detached (their own session), so the
``conveyor`` invocation that stops them is usually not their parent and can
only go by pid. Two guards keep that safe: the process start time recorded
next to the pid (a recycled pid has another one) and zombie detection (a
killed child whose parent does not reap it still answers ``kill(pid, 0)``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True, slots=True, frozen=True)
class ProcessInfo:
    """A process of the stack as recorded in ``stack.json``."""

    pid: int
    start_ticks: int | None
    """Start time of the process in clock ticks since boot (Linux ``/proc``); None where
    unavailable, then only the pid identifies the process."""
    log_path: str
    """File that receives the process's stdout and stderr."""

    @classmethod
    def of(cls, pid: int, log_path: Path) -> ProcessInfo:
        return cls(pid=pid, start_ticks=start_ticks(pid), log_path=str(log_path))


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name, or None if unreadable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; it ends at the last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, None if unknown (not Linux, gone)."""
    fields = _stat_fields(pid)
    # Field 22 of stat is starttime; fields[0] is field 3 (state).
    return int(fields[19]) if fields and len(fields) > 19 else None


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is our own child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def is_alive(info: ProcessInfo) -> bool:
    """True when the recorded process (same pid, same start time) is running and not a zombie."""
    _reap(info.pid)
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else: the start time below decides
    fields = _stat_fields(info.pid)
    if fields is None:
        # No /proc (macOS): kill(pid, 0) succeeded, that is all we can know.
        return True
    if fields[0] in ("Z", "X"):
        return False
    return info.start_ticks is None or start_ticks(info.pid) == info.start_ticks


def _signal(info: ProcessInfo, sig: signal.Signals) -> None:
    """Send ``sig`` to the process's group when it leads one (its worker processes stop too)."""
    if not is_alive(info):
        return
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(info.pid) == info.pid:
            os.killpg(info.pid, sig)
        else:
            os.kill(info.pid, sig)


@dataclass(kw_only=True, slots=True, frozen=True)
class StopResult:
    """How each process went away."""

    terminated: tuple[int, ...]
    """Pids that exited after SIGTERM."""
    killed: tuple[int, ...]
    """Pids that needed SIGKILL after the grace period."""
    already_gone: tuple[int, ...]
    """Pids that were not running any more."""


def stop_processes(
    infos: Sequence[ProcessInfo], *, timeout_s: float, poll_s: float = 0.05
) -> StopResult:
    """SIGTERM every live process, wait up to ``timeout_s`` for all of them, SIGKILL the rest.

    Returns once every process is gone. A process that survives SIGKILL for 5 s (stuck in the
    kernel) is reported as killed anyway: nothing more can be done from user space.
    """
    gone = tuple(info.pid for info in infos if not is_alive(info))
    running = [info for info in infos if info.pid not in gone]
    for info in running:
        _signal(info, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    pending = list(running)
    while pending and time.monotonic() < deadline:
        time.sleep(poll_s)
        pending = [info for info in pending if is_alive(info)]
    killed = tuple(info.pid for info in pending)
    for info in pending:
        _signal(info, signal.SIGKILL)
    kill_deadline = time.monotonic() + 5.0
    while pending and time.monotonic() < kill_deadline:
        time.sleep(poll_s)
        pending = [info for info in pending if is_alive(info)]
    terminated = tuple(info.pid for info in running if info.pid not in killed)
    return StopResult(terminated=terminated, killed=killed, already_gone=gone)
