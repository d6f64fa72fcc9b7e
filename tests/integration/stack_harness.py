"""What the embedded stack's integration tests share (test_stack_cli.py, test_stack_services.py):
waiting for a process to be gone."""

from __future__ import annotations

import time

from conveyor.embedded.procs import ProcessInfo, is_alive


def _pid_gone(pid: int, timeout_s: float = 5.0) -> bool:
    info = ProcessInfo(pid=pid, start_ticks=None, log_path="")
    deadline = time.monotonic() + timeout_s
    while is_alive(info):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
