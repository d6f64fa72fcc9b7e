"""loadtests/locustfile.py as the README runs it: a short headless Locust run against the
embedded stack (every submitted job really runs) ends with no failed request, every kind of
request was sent, and the p95 latencies are reported."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_stack import base_env, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 20
USERS = 4
EXPECTED_REQUESTS = {
    "/v1/jobs [submit]",
    "/v1/jobs?limit=20",
    "/v1/jobs/[id]",
    "/v1/jobs/[id]/events",
    "/v1/jobs/[id]/cancel",
}


def test_a_short_headless_locust_run_has_no_failures(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with running_stack(tmp_path / "stack") as stack:
        assert stack.state.gateway_url is not None
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--headless",
             "-u", str(USERS), "-r", str(USERS), "-t", f"{RUN_S}s", "--stop-timeout", "5",
             "--host", stack.state.gateway_url, "--csv", str(tmp_path / "locust"),
             "--only-summary"],
            cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=RUN_S + 120,
        )  # fmt: skip
        listed = stack.gateway.jobs(limit=500)
    with open(tmp_path / "locust_stats.csv", newline="") as stats_file:
        rows = {row["Name"]: row for row in csv.DictReader(stats_file)}
    failures = (tmp_path / "locust_failures.csv").read_text()
    assert done.returncode == 0, f"locust: {done.returncode}\n{failures}\n{done.stderr[-3000:]}"
    total = rows.pop("Aggregated")
    assert int(total["Failure Count"]) == 0, failures
    assert set(rows) >= EXPECTED_REQUESTS, sorted(rows)
    for name in EXPECTED_REQUESTS:
        assert int(rows[name]["Request Count"]) > 0, name
    # Every submission Locust saw accepted is a job the gateway knows. A submission still in
    # flight when Locust stopped its users reached the gateway without being counted by Locust,
    # so the gateway may know up to one more job per user, never fewer than Locust counted.
    submitted = int(rows["/v1/jobs [submit]"]["Request Count"])
    known = len({job["id"] for job in listed if job["name"].startswith("locust-")})
    assert submitted <= known <= submitted + USERS, (known, submitted)

    report = {name: float(row["95%"]) for name, row in sorted(rows.items())}
    report["all"] = float(total["95%"])
    print(f"locust p95 (ms) over {total['Request Count']} requests: {report}")
    record_property("locust_p95_ms", report)
