"""Helpers shared by the load tests: what a process costs, from /proc (peak and current
memory, CPU seconds, run-queue wait, CPU seconds per thread) and a process's children.

Linux only (``/proc``); nothing here needs psutil.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ProcMemory:
    """Resident memory of one process, from ``/proc/<pid>/status``."""

    peak_rss_bytes: int
    """VmHWM: the most resident memory the process has had since it started."""
    rss_bytes: int
    """VmRSS: resident memory now."""


def proc_memory(pid: int) -> ProcMemory | None:
    """Peak and current resident memory of ``pid``; None when it is gone or unreadable.

    Shared pages (shared libraries, pages a forked child still shares with its parent) count
    in full in every process that maps them, so per-process figures over-state a sum.
    """
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024  # reported in kB
    if "VmHWM" not in fields:
        return None  # a zombie has no memory fields
    return ProcMemory(peak_rss_bytes=fields["VmHWM"], rss_bytes=fields.get("VmRSS", 0))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time ``pid`` has used so far (seconds); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields from 3 (state) on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def runqueue_wait_seconds(pid: int) -> float | None:
    """Time the threads of ``pid`` have spent runnable but waiting for a CPU, summed
    (``/proc/<pid>/task/*/schedstat``, seconds); None when it is gone. On a machine shared with
    other work this is where their load shows."""
    total_ns = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            total_ns += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return total_ns / 1e9


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread of ``pid``, keyed ``main`` for its main thread and by thread
    name (``comm``, at most 15 characters) for the others, same names summed."""
    found: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    ticks = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = "main" if int(tid) == pid else stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return found


def child_pids(pid: int) -> list[int]:
    """Live direct children of ``pid`` (scans ``/proc/*/stat``; order of pids)."""
    children: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 2 (comm) is parenthesised and may hold spaces: split after its last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            children.append(int(entry))
    return sorted(children)
