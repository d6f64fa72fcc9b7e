"""A real Prometheus server (Debian's ``prometheus``) scraping a single-machine stack with the
project's scrape configuration, as docs/operations.md tells users to run it: the file
``infra/prometheus/prometheus.yml`` copied into ``<state-dir>/prometheus/``, where
``conveyor up`` keeps the file_sd targets (``targets/conveyor.json``). One change: scrapes every
second instead of every 5 s, so the short test jobs (seconds on a fast machine) span enough
scrapes for the dashboard's rates over 1 m windows to have values."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from servers import require_binary

from conveyor.embedded.broker import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRAPE_CONFIG = ROOT / "infra" / "prometheus" / "prometheus.yml"
ALERT_RULES = ROOT / "infra" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "infra" / "grafana" / "dashboards" / "conveyor.json"


class PrometheusServer:
    """``prometheus`` in the stack's state directory, on a free port; :meth:`stop` ends it."""

    def __init__(self, state_dir: Path, data_dir: Path) -> None:
        binary = require_binary("prometheus", install="apt-get install prometheus")
        config_dir = state_dir / "prometheus"
        config_dir.mkdir(parents=True, exist_ok=True)
        config = config_dir / "prometheus.yml"
        project = SCRAPE_CONFIG.read_text()
        assert "  scrape_interval: 5s\n" in project, "the test expects the global 5 s interval"
        config.write_text(project.replace("  scrape_interval: 5s\n", "  scrape_interval: 1s\n", 1))
        shutil.copy(ALERT_RULES, config_dir / ALERT_RULES.name)  # rule_files, beside the config
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = config_dir / "prometheus.log"
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data_dir}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._client = httpx.Client(base_url=self.url, timeout=10)
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self._process.poll() is None, f"prometheus exited: {self.log_tail()}"
            assert time.monotonic() < deadline, f"prometheus not ready: {self.log_tail()}"
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return self._client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        reply = self._client.get("/api/v1/query", params={"query": expr})
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (expr, body)
        assert body["data"]["resultType"] == "vector", (expr, body["data"]["resultType"])
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def get(self, path: str) -> dict[str, Any]:
        """The JSON body of an API GET (``/api/v1/rules``), checked for success."""
        reply = self._client.get(path)
        body: dict[str, Any] = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (path, body)
        return body

    def finite_values(self, expr: str) -> list[float]:
        """The finite sample values of ``expr`` now (a quantile of no observations is NaN)."""
        values = (float(sample["value"][1]) for sample in self.query(expr))
        return [value for value in values if math.isfinite(value)]

    def finite_values_between(
        self, expr: str, start_s: float, end_s: float, step_s: float = 5.0
    ) -> list[float]:
        """The finite values of ``expr`` evaluated every ``step_s`` from ``start_s`` to
        ``end_s`` (Unix seconds), as a dashboard's graph over that span shows them."""
        params: dict[str, str | float] = {
            "query": expr, "start": start_s, "end": end_s, "step": step_s,
        }  # fmt: skip
        reply = self._client.get("/api/v1/query_range", params=params)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (expr, body)
        values = (float(v) for series in body["data"]["result"] for _, v in series["values"])
        return [value for value in values if math.isfinite(value)]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self._client.close()
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
