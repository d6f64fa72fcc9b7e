"""Failure reports of end-to-end tests carry the tail of every log file of the running
stacks (section "stack logs <state dir>"); the helpers live in ``e2e_stack.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_stack import ACTIVE


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        for stack in ACTIVE:
            report.sections.append((f"stack logs {stack.state_dir}", stack.log_tails()))
