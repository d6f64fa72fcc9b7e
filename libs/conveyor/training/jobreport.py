"""The job report: one HTML page per job (state, progress, loss and accuracy per epoch, where a
step's time goes, links to its traces and dashboard) and a list of jobs.

Pure functions of the gateway's JSON (``GET /v1/jobs/{id}`` and ``/v1/jobs/{id}/stages``), so
the gateway's pages and ``conveyor report JOB`` render the same document. Charts are inline
SVG drawn here: no script, no external resource, so a saved report opens anywhere. Every
user-written string (a job's name, a failure reason) is escaped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

GRAFANA_DASHBOARD_PATH = "/d/conveyor-overview/conveyor-overview"
"""The provisioned dashboard (uid ``conveyor-overview``, infra/grafana/dashboards)."""

STEP_PART_LABELS = {
    "data_wait": "data wait",
    "h2d": "host to device",
    "compute": "compute",
    "grad_send": "gradient send",
    "param_wait": "parameter wait",
}
"""Parts of a trainer's step (``progress.step_time_s``), in the order a step runs them."""

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
_CHART_W, _CHART_H, _PAD = 440, 220, 44
_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:1.4em;margin:0 0 4px} table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} th{background:#f3f3f3}
td.l,th.l{text-align:left} .charts{display:flex;flex-wrap:wrap;gap:16px}
.state{font-weight:bold} progress{width:320px;height:16px} .muted{color:#777}
"""


@dataclass(kw_only=True, slots=True, frozen=True)
class ReportLinks:
    """Where the job's traces and dashboards are; a page shows only the links configured."""

    jaeger_url: str | None = None
    """Base URL of the Jaeger UI (``http://localhost:16686``)."""
    grafana_url: str | None = None
    """Base URL of Grafana (``http://localhost:3000``)."""

    def __post_init__(self) -> None:
        for name in ("jaeger_url", "grafana_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http:// or https:// URL, got {url!r}")

    def for_job(self, job: Mapping[str, Any]) -> dict[str, str]:
        """{label: URL}: the job's traces (the sharder's ``release shard`` spans carry
        ``conveyor.job_id``, and each shard's batches continue that trace) and the dashboard over
        the job's time span."""
        links: dict[str, str] = {}
        if self.jaeger_url:
            tags = json.dumps({"conveyor.job_id": job["id"]})
            query = urlencode({"service": "sharder", "tags": tags, "limit": 50})
            links["Traces in Jaeger"] = f"{self.jaeger_url.rstrip('/')}/search?{query}"
        if self.grafana_url:
            start_ms = int(job["submitted_at"] * 1000)
            end = "now" if job["state"] in _LIVE_STATES else str(int(job["updated_at"] * 1000))
            links["Dashboard in Grafana"] = (
                f"{self.grafana_url.rstrip('/')}{GRAFANA_DASHBOARD_PATH}?from={start_ms}&to={end}"
            )
        return links


_LIVE_STATES = frozenset({"pending", "planned", "queued", "running"})  # queued: waits for trainers


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]]) -> str:
    """An SVG line chart of ``series`` ({name: [(x, y), ...]}); each series' point count is in
    its polyline's ``data-points`` attribute. Non-finite values are left out."""
    clean = {
        name: [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        for name, points in series.items()
    }
    points = [p for values in clean.values() for p in values]
    head = f'<svg class="chart" width="{_CHART_W}" height="{_CHART_H}" role="img">'
    head += f'<title>{escape(title)}</title><text x="{_PAD}" y="16" font-weight="bold">'
    head += f"{escape(title)}</text>"
    if not points:
        return head + f'<text x="{_PAD}" y="{_CHART_H // 2}">no data yet</text></svg>'
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(0.0, min(p[1] for p in points)), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    width, height = _CHART_W - 2 * _PAD, _CHART_H - 2 * _PAD

    def at(x: float, y: float) -> tuple[float, float]:
        """Data -> pixel coordinates (y grows downwards in SVG)."""
        return (
            _PAD + (x - x0) / (x1 - x0) * width,
            _CHART_H - _PAD - (y - y0) / (y1 - y0) * height,
        )

    parts = [
        head,
        f'<rect x="{_PAD}" y="{_PAD}" width="{width}" height="{height}" fill="none" '
        'stroke="#999"/>',
        f'<text x="4" y="{_PAD + 4}">{y1:.3g}</text>',
        f'<text x="4" y="{_CHART_H - _PAD}">{y0:.3g}</text>',
        f'<text x="{_PAD}" y="{_CHART_H - _PAD + 16}">epoch {x0:g}</text>',
        f'<text x="{_CHART_W - _PAD - 40}" y="{_CHART_H - _PAD + 16}">{x1:g}</text>',
    ]
    for index, (name, values) in enumerate(clean.items()):
        color = _COLORS[index % len(_COLORS)]
        pixels = [at(x, y) for x, y in values]
        coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in pixels)
        parts.append(
            f'<polyline data-series="{escape(name)}" data-points="{len(values)}" '
            f'points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>'
        )
        parts.extend(
            f'<circle r="3" fill="{color}" cx="{px:.1f}" cy="{py:.1f}"/>' for px, py in pixels
        )
        parts.append(
            f'<text x="{_PAD + 8 + 150 * index}" y="{_CHART_H - 8}" fill="{color}">'
            f"{escape(name)}</text>"
        )
    return "".join(parts) + "</svg>"


def step_time_bar(step_time_s: Mapping[str, float]) -> str:
    """A stacked SVG bar of a step's mean seconds per part, labelled in milliseconds."""
    parts = [(p, step_time_s.get(p, 0.0)) for p in STEP_PART_LABELS]
    total = sum(v for _, v in parts if math.isfinite(v) and v > 0)
    head = f'<svg class="steptime" width="{_CHART_W}" height="{60 + 18 * len(parts)}" role="img">'
    if total <= 0:
        return head + '<text x="0" y="20">no step reported yet</text></svg>'
    shapes, x = [head], 0.0
    for index, (part, seconds) in enumerate(parts):
        share = max(seconds, 0.0) / total if math.isfinite(seconds) else 0.0
        color = _COLORS[index]
        shapes.append(
            f'<rect data-part="{part}" x="{x:.1f}" y="4" width="{share * _CHART_W:.1f}" '
            f'height="28" fill="{color}"/>'
        )
        shapes.append(
            f'<text x="0" y="{52 + 18 * index}" fill="{color}">{STEP_PART_LABELS[part]}: '
            f"{seconds * 1000:.1f} ms ({share:.0%})</text>"
        )
        x += share * _CHART_W
    return "".join(shapes) + "</svg>"


def _number(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _per_epoch(epochs: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """(epoch, value) of the epochs that have ``key``'s value."""
    return [(e["epoch"], e[key]) for e in epochs if e.get(key) is not None]


def _page(title: str, body: str, refresh_s: int | None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


def job_page(
    job: Mapping[str, Any],
    stages: Mapping[str, Any] | None,
    *,
    links: ReportLinks,
    refresh_s: int | None = None,
    jobs_href: str | None = None,
) -> str:
    """The HTML report of ``job`` (``GET /v1/jobs/{id}``) with its stage latencies
    (``GET /v1/jobs/{id}/stages``, optional). ``refresh_s`` reloads a live job's page that
    often; ``jobs_href`` links back to the list."""
    progress, epochs = job["progress"], job["epochs"]
    name = job["name"] or job["id"]
    total = progress.get("total_steps")
    bar = (
        f'<progress max="{total}" value="{min(progress["step"], total)}"></progress> '
        if total
        else ""
    )
    rows = "".join(
        f"<tr><td>{e['epoch']}</td><td>{_number(e['train_loss'])}</td>"
        f"<td>{_number(e['eval_loss'])}</td><td>{_number(e['eval_accuracy'])}</td></tr>"
        for e in epochs
    )
    loss = line_chart(
        "Loss per epoch",
        {
            "train loss": _per_epoch(epochs, "train_loss"),
            "eval loss": _per_epoch(epochs, "eval_loss"),
        },
    )
    accuracy = line_chart(
        "Eval accuracy per epoch", {"eval accuracy": _per_epoch(epochs, "eval_accuracy")}
    )
    stage_rows = "".join(
        f'<tr><td class="l">{escape(stage)}</td><td>{v["p50"] * 1000:.1f}</td>'
        f"<td>{v['p90'] * 1000:.1f}</td><td>{v['max'] * 1000:.1f}</td></tr>"
        for stage, v in ((stages or {}).get("stages") or {}).items()
    )
    link_items = "".join(
        f'<li><a href="{escape(url)}">{escape(label)}</a></li>'
        for label, url in links.for_job(job).items()
    )
    back = f'<p><a href="{escape(jobs_href)}">All jobs</a></p>' if jobs_href else ""
    reason = f"<p>Reason: {escape(job['reason'])}</p>" if job.get("reason") else ""
    wait = progress.get("data_wait_ratio")
    body = (
        f"{back}<h1>{escape(name)}</h1>"
        f'<p class="muted">job <code id="job-id">{escape(job["id"])}</code>, submitted '
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(job['submitted_at']))} UTC</p>"
        f'<p>State: <span class="state" id="job-state">{escape(job["state"])}</span></p>{reason}'
        f"<p>{bar}epoch {progress['epoch']} of {progress['epochs']}, step {progress['step']}"
        f" of {total if total else '?'}; {progress['samples_trained']} samples trained, "
        f"{progress['samples_per_second']:.0f} samples/s, data wait "
        f"{'-' if wait is None else f'{wait:.1%}'}</p>"
        f'<div class="charts">{loss}{accuracy}</div>'
        '<h2>Per epoch</h2><table id="epochs"><tr><th>epoch</th><th>train loss</th>'
        f"<th>eval loss</th><th>eval accuracy</th></tr>{rows}</table>"
        f"<h2>Where a step's time goes</h2>{step_time_bar(progress.get('step_time_s') or {})}"
        '<h2>Pipeline stages per batch (ms)</h2><table id="stages"><tr><th class="l">stage</th>'
        f"<th>p50</th><th>p90</th><th>max</th></tr>{stage_rows}</table>"
        + (f"<h2>Links</h2><ul>{link_items}</ul>" if link_items else "")
    )
    live = job["state"] in _LIVE_STATES
    return _page(f"{name} - Conveyor", body, refresh_s if live else None)


def jobs_page(jobs: Sequence[Mapping[str, Any]], *, job_href: str, refresh_s: int | None) -> str:
    """The list of ``jobs`` (``GET /v1/jobs``), each linking to ``job_href`` with ``{id}``
    replaced by its id."""
    rows = "".join(
        f'<tr><td class="l"><a href="{escape(job_href.format(id=quote(job["id"], safe="")))}">'
        f'{escape(job["name"] or job["id"])}</a></td><td class="l">{escape(job["state"])}</td>'
        f"<td>{job['progress']['epoch']}/{job['progress']['epochs']}</td>"
        f"<td>{_number(job['progress']['loss'])}</td>"
        f"<td>{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(job['submitted_at']))}</td></tr>"
        for job in jobs
    )
    body = (
        f"<h1>Conveyor jobs</h1><p>{len(jobs)} jobs, newest first.</p>"
        '<table id="jobs"><tr><th class="l">job</th><th class="l">state</th><th>epoch</th>'
        f"<th>loss</th><th>submitted (UTC)</th></tr>{rows}</table>"
    )
    return _page("Conveyor jobs", body, refresh_s)
