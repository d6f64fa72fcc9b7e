"""Real servers and tools the tests run when the machine has them (Debian's prometheus,
chromium): a test skips without one, except in CI, where ``.ci/run`` installs them and sets
``CONVEYOR_REQUIRE_SERVERS`` so that a missing one fails the test instead."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def require_binary(*names: str, install: str) -> str:
    """The path of the first of ``names`` on PATH; skip (fail under
    ``CONVEYOR_REQUIRE_SERVERS``) naming ``install`` when none is there."""
    for name in names:
        found = shutil.which(name)
        if found is not None:
            return found
    message = f"{' / '.join(names)} not installed: {install}"
    if os.environ.get("CONVEYOR_REQUIRE_SERVERS"):
        pytest.fail(f"required here (CONVEYOR_REQUIRE_SERVERS): {message}")
    pytest.skip(message)


def headless_chromium(url: str, *action: str, timeout_s: float = 60.0) -> str:
    """Run headless Chromium once on ``url`` with ``action`` (``--dump-dom`` and/or
    ``--screenshot=PATH``: one launch does both); its standard output (the DOM for
    ``--dump-dom``)."""
    binary = require_binary("chromium", "chromium-browser", install="apt-get install chromium")
    done = subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1000,1300",
            *action,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
