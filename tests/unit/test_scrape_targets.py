"""The single-machine stack's Prometheus targets follow its record (``stack.json``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from conveyor.embedded.procs import ProcessInfo
from conveyor.embedded.scrape import targets_path
from conveyor.embedded.state import ServiceInfo, StackState, remove_state, save_state


def _service(name: str, port: int) -> ServiceInfo:
    return ServiceInfo(
        name=name,
        process=ProcessInfo(pid=port, start_ticks=None, log_path=f"/x/{name}.log"),
        host="127.0.0.1",
        port=port,
        serves_api=name == "gateway",
    )


def test_saving_the_record_writes_one_labelled_target_per_process(tmp_path: Path) -> None:
    state = StackState(
        state_dir=str(tmp_path),
        started_at=0.0,
        bootstrap="127.0.0.1:9092",
        broker=None,
        storage_uri=f"file://{tmp_path}/store",
        services=(_service("gateway", 8001), _service("trainer-1", 8002)),
    )
    save_state(state)
    groups = json.loads(targets_path(tmp_path).read_text())
    assert groups == [
        {"targets": ["127.0.0.1:8001"], "labels": {"service": "gateway", "process": "gateway"}},
        {"targets": ["127.0.0.1:8002"], "labels": {"service": "trainer", "process": "trainer-1"}},
    ]
    # A replica added later (the record is saved again) is scraped too.
    save_state(replace(state, services=(*state.services, _service("trainer-2", 8003))))
    assert [g["labels"]["process"] for g in json.loads(targets_path(tmp_path).read_text())] == [
        "gateway", "trainer-1", "trainer-2",
    ]  # fmt: skip
    remove_state(tmp_path)
    assert not targets_path(tmp_path).exists()
