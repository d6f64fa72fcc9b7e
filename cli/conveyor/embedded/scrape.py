"""Prometheus file-based service discovery for the single-machine stack.

Every write of ``stack.json`` also writes ``<state-dir>/prometheus/targets/conveyor.json`` in
Prometheus's ``file_sd`` format: one target group per service process, labelled with the service
it runs (``service="trainer"`` for ``trainer-2`` too), so the dashboards' ``by (service)`` queries
read the same on this stack as on docker compose (where DNS discovery sets the label).
``infra/prometheus/prometheus.yml`` reads ``targets/*.json`` next to itself: copied into
``<state-dir>/prometheus/``, it scrapes the stack and follows every change of the record
(Prometheus re-reads the file when it changes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.embedded import registry

if TYPE_CHECKING:
    from conveyor.embedded.state import StackState

TARGETS_FILE = Path("prometheus") / "targets" / "conveyor.json"
"""Where, under the state directory, the targets are written."""


def targets_path(state_dir: Path) -> Path:
    return state_dir / TARGETS_FILE


def scrape_targets(state: StackState) -> list[dict[str, Any]]:
    """The ``file_sd`` target groups of ``state``'s services: ``[{"targets": ["host:port"],
    "labels": {"service": ..., "process": <instance name>}}]``, in the record's order."""
    return [
        {
            "targets": [f"{service.host}:{service.port}"],
            "labels": {"service": registry.service_of(service.name), "process": service.name},
        }
        for service in state.services
    ]


def write_scrape_targets(state: StackState) -> Path:
    """Write :func:`scrape_targets` atomically (Prometheus may read it at any moment; a torn file
    would drop every target until the next write). Returns the file's path."""
    path = targets_path(Path(state.state_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(scrape_targets(state), indent=2))
    os.replace(tmp, path)
    return path


def remove_scrape_targets(state_dir: Path) -> None:
    """Forget the targets (the stack is gone): Prometheus drops them on its next read."""
    targets_path(state_dir).unlink(missing_ok=True)
