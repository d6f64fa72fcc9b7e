"""Checks that need only a default stack, run on one (a stack takes ~20 s to start on two cores):

- model plug-ins through the real stack: a package registered under the ``conveyor.models``
  entry-point group (on the services' PYTHONPATH, as an installed package would be) trains like
  a built-in, and a job naming a model no process has fails with the reason before training;
- loadtests/locustfile.py as the README runs it: a short headless Locust run against the stack
  (every submitted job really runs) ends with no failed request, every kind of request was
  sent, and the p95 latencies are reported. It runs last: its jobs keep the stack busy.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_stack import RunningStack, base_env, digits_spec, running_stack
from ledger_check import assert_exactly_once
from model_plugin import PLUGIN_MODEL, write_plugin

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


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("default")
    plugin = write_plugin(root / "site")
    pythonpath = os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))
    with running_stack(root / "state", env={"PYTHONPATH": pythonpath}) as running:
        yield running


def test_a_plugin_model_trains_and_an_unknown_one_fails_clearly(stack: RunningStack) -> None:
    job_id = stack.submit(
        digits_spec("plugin-model", epochs=2, model={"name": PLUGIN_MODEL, "hidden": 64})
    )
    missing_id = stack.submit(digits_spec("missing-model", model={"name": "nobody_has_it"}))
    job = stack.wait_job(job_id, timeout_s=120)
    missing = stack.wait_job(missing_id, timeout_s=60)
    assert job["state"] == "completed", job.get("reason")
    assert job["summary"]["eval_accuracy"] > 0.7  # chance is 0.1; a 64-unit MLP, 2 epochs
    assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=2)
    assert missing["state"] == "failed" and missing["plan"] is None
    assert "unknown model 'nobody_has_it'" in missing["reason"]
    assert PLUGIN_MODEL in missing["reason"]  # the known models, plug-ins included, are named


def test_a_short_headless_locust_run_has_no_failures(
    stack: RunningStack, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
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
