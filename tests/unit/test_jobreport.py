"""The job report's HTML from the gateway's JSON: curves per epoch, step-time parts, links,
escaping of what users wrote."""

from __future__ import annotations

import re
from typing import Any

import pytest

from conveyor.training.jobreport import ReportLinks, job_page, jobs_page, line_chart


def job_json(**changes: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "id": "j1",
        "name": "digits <script>alert(1)</script>",
        "state": "completed",
        "submitted_at": 1_700_000_000.0,
        "updated_at": 1_700_000_060.0,
        "reason": None,
        "progress": {
            "epoch": 2, "epochs": 2, "step": 46, "total_steps": 46, "samples_trained": 2876,
            "loss": 0.3, "samples_per_second": 900.0, "data_wait_ratio": 0.05,
            "step_time_s": {"data_wait": 0.001, "compute": 0.006, "grad_send": 0.002,
                            "param_wait": 0.001},
        },
        "epochs": [
            {"epoch": 0, "train_loss": 1.9, "eval_loss": 1.2, "eval_accuracy": 0.71},
            {"epoch": 1, "train_loss": 0.8, "eval_loss": 0.5, "eval_accuracy": 0.93},
        ],
    }  # fmt: skip
    job.update(changes)
    return job


STAGES = {"id": "j1", "window": 256, "stages": {"compute": {"p50": 0.004, "p90": 0.006,
          "p99": 0.007, "max": 0.009, "count": 10.0, "last": 0.004}}}  # fmt: skip


def test_the_page_draws_each_epoch_and_escapes_the_users_strings() -> None:
    html = job_page(job_json(), STAGES, links=ReportLinks())
    assert "<script>" not in html and "digits &lt;script&gt;" in html
    points = dict(re.findall(r'data-series="([^"]+)" data-points="(\d+)"', html))
    assert points == {"train loss": "2", "eval loss": "2", "eval accuracy": "2"}
    assert html.count("<circle") == 6
    assert '<span class="state" id="job-state">completed</span>' in html
    # The step-time bar: the parts' shares of 10 ms.
    assert "compute: 6.0 ms (60%)" in html and "data wait: 1.0 ms (10%)" in html
    assert "<td>4.0</td><td>6.0</td><td>9.0</td>" in html  # compute stage p50/p90/max in ms
    assert "http-equiv" not in html and "<h2>Links</h2>" not in html


def test_live_pages_reload_and_link_to_traces_and_the_dashboard() -> None:
    links = ReportLinks(jaeger_url="http://jaeger:16686/", grafana_url="http://grafana:3000")
    html = job_page(job_json(state="running"), None, links=links, refresh_s=5, jobs_href="/jobs")
    assert '<meta http-equiv="refresh" content="5">' in html
    assert (
        'href="http://jaeger:16686/search?service=sharder&amp;tags=%7B%22conveyor.job_id%22'
        '%3A+%22j1%22%7D&amp;limit=50"' in html
    )
    grafana = "http://grafana:3000/d/conveyor-overview/conveyor-overview?from=1700000000000"
    assert f'href="{grafana}&amp;to=now"' in html
    assert '<a href="/jobs">All jobs</a>' in html


def test_links_must_be_web_addresses() -> None:
    with pytest.raises(ValueError, match="grafana_url must be an http"):
        ReportLinks(grafana_url="localhost:3000")


def test_a_job_without_epochs_or_steps_yet_says_so() -> None:
    empty = {"epoch": 0, "epochs": 2, "step": 0, "total_steps": None, "samples_trained": 0,
             "loss": None, "samples_per_second": 0.0, "data_wait_ratio": None}  # fmt: skip
    html = job_page(job_json(state="pending", epochs=[], progress=empty), None, links=ReportLinks())
    assert html.count("no data yet") == 2 and "no step reported yet" in html
    assert "<progress" not in html and "data wait -" in html


def test_charts_leave_out_values_that_are_not_finite() -> None:
    svg = line_chart("loss", {"a": [(0, 1.0), (1, float("nan")), (2, float("inf")), (3, 0.5)]})
    assert 'data-points="2"' in svg


def test_the_list_links_every_job_to_its_page() -> None:
    html = jobs_page([job_json(), job_json(id="j/2", name="")], job_href="/jobs/{id}", refresh_s=5)
    assert '<a href="/jobs/j1">digits &lt;script&gt;' in html
    assert '<a href="/jobs/j%2F2">j/2</a>' in html
    assert "2 jobs, newest first." in html
