"""The alerting rules (infra/prometheus/alerts.yml): loaded by the project's Prometheus
configuration and mounted beside it in compose, accepted by promtool, and each alert firing
when, and only when, its unit tests (alerts_test.yml, synthetic series) say it should."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from compose_files import _host_path, _load

RULES_DIR = Path(__file__).resolve().parents[2] / "infra" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        # .ci/run installs Debian's prometheus and sets CONVEYOR_REQUIRE_SERVERS: no skip there.
        if os.environ.get("CONVEYOR_REQUIRE_SERVERS"):
            pytest.fail("promtool (Debian's prometheus) is required here but not installed")
        pytest.skip("promtool (Prometheus) not installed: apt-get install prometheus")
    return subprocess.run(
        ["promtool", *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120
    )


def test_compose_mounts_every_rule_file_beside_the_configuration(
    services: dict[str, Any],
) -> None:
    prometheus = services["prometheus"]
    config = _load(_host_path(prometheus, "/etc/prometheus/prometheus.yml"))
    assert config["rule_files"] == ["alerts.yml"]
    for name in config["rule_files"]:  # resolved against the configuration's directory
        assert _host_path(prometheus, f"/etc/prometheus/{name}") == RULES_DIR / name


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "4 rules found" in checked.stdout
    tested = promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
