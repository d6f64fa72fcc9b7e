"""The command line's contract without a running stack: exit codes, messages, JSON shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conveyor.cli.main import app
from conveyor.embedded import registry, stack
from conveyor.embedded.health import HealthError
from conveyor.embedded.procs import ProcessInfo, is_alive, start_ticks
from conveyor.embedded.state import (
    ServiceInfo,
    StackState,
    StateError,
    load_state,
    save_state,
)
from conveyor.embedded.store import resolve_storage

runner = CliRunner()
CALLS: list[list[str]] = []


def fake_main(argv: list[str]) -> int:
    """Stand-in service entry: records its arguments, exits 3."""
    CALLS.append(argv)
    return 3


@pytest.fixture
def two_services(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        registry,
        "SERVICES",
        {
            "gateway": registry.ServiceSpec(entry=f"{__name__}:fake_main", serves_api=True),
            "sharder": registry.ServiceSpec(entry=f"{__name__}:fake_main"),
        },
    )
    # `conveyor service` ends its process with os._exit once the service stopped; in process
    # that would end pytest, so it becomes the SystemExit the runner records.
    monkeypatch.setattr(os, "_exit", _raise_exit)


def _raise_exit(code: int) -> None:
    raise SystemExit(code)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("CONVEYOR_STORAGE_", "CONVEYOR_STATE_DIR")):
            monkeypatch.delenv(key)


def test_unknown_service_exits_2_and_lists_known(two_services: None) -> None:
    result = runner.invoke(app, ["service", "nope"])
    assert result.exit_code == 2
    assert "unknown service 'nope'" in result.stderr
    assert "gateway, sharder" in result.stderr


def test_unknown_service_with_empty_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "SERVICES", {})
    result = runner.invoke(app, ["service", "gateway"])
    assert result.exit_code == 2
    assert "none are registered yet" in result.stderr


def test_service_runs_entry_with_extra_args_and_its_exit_code(two_services: None) -> None:
    CALLS.clear()
    result = runner.invoke(app, ["service", "sharder", "--replica", "2"])
    assert result.exit_code == 3
    assert CALLS == [["--replica", "2"]]


def test_a_retired_setting_stops_the_service_with_its_replacement(
    two_services: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    CALLS.clear()
    monkeypatch.setenv("CONVEYOR_SHARDER_JOBS_PARTITIONS", "6")
    result = runner.invoke(app, ["service", "sharder"])
    assert result.exit_code == 2 and CALLS == []  # the service never started
    assert (
        "CONVEYOR_SHARDER_JOBS_PARTITIONS is no longer read: set CONVEYOR_TOPOLOGY_JOBS_PARTITIONS"
        in " ".join(result.stderr.split())
    )


def test_service_spec_rejects_malformed_entry() -> None:
    with pytest.raises(ValueError, match=r"pkg\.module:function"):
        registry.ServiceSpec(entry="conveyor.services.gateway")


def test_down_without_stack_exits_0(tmp_path: Path) -> None:
    result = runner.invoke(app, ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0
    assert "nothing to stop" in " ".join(result.stdout.split())  # the console wraps long paths
    result = runner.invoke(app, ["down", "--state-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"stopped": False, "reason": "no stack recorded"}


def test_status_without_stack_exits_1(tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["running"] is False
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "No Conveyor stack is running" in " ".join(result.stdout.split())


def test_status_with_corrupt_state_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text("{not json")
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "is not a usable stack record" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_up_rejects_unknown_storage_scheme_before_starting_anything(tmp_path: Path) -> None:
    result = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--storage-uri", "ftp://x"])
    assert result.exit_code == 2
    assert "storage uri must start with file:// or s3://" in result.stderr
    assert not (tmp_path / "stack.json").exists()


def test_up_with_s3_uri_needs_an_endpoint(tmp_path: Path) -> None:
    result = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--storage-uri", "s3://b"])
    assert result.exit_code == 1
    assert "needs an S3 endpoint" in result.stderr
    assert not (tmp_path / "stack.json").exists()


def test_storage_defaults(tmp_path: Path) -> None:
    local = resolve_storage(tmp_path, {"uri": None, "s3_endpoint": None})
    assert local.uri == f"file://{(tmp_path / 'objects').resolve()}"
    s3 = resolve_storage(tmp_path, {"s3_endpoint": "minio:9000", "s3_access_key": "k"})
    assert (s3.uri, s3.s3_endpoint, s3.s3_access_key) == ("s3://conveyor", "minio:9000", "k")
    explicit = resolve_storage(tmp_path, {"uri": "s3://data/prefix", "s3_endpoint": "h:1"})
    assert explicit.uri == "s3://data/prefix"


def test_relative_file_uri_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVEYOR_STORAGE_URI", "file://./objs")
    settings = resolve_storage(Path(".conveyor"), {})
    assert settings.uri == f"file://{tmp_path.resolve()}/objs"


def test_state_round_trip(tmp_path: Path) -> None:
    process = ProcessInfo(pid=123, start_ticks=456, log_path="/x/gateway.log")
    state = StackState(
        state_dir=str(tmp_path),
        started_at=1.5,
        bootstrap="127.0.0.1:9092",
        broker=None,
        storage_uri="s3://conveyor",
        storage_endpoint="127.0.0.1:9000",
        services=(
            ServiceInfo(
                name="gateway", process=process, host="127.0.0.1", port=8080, serves_api=True
            ),
        ),
    )
    save_state(state)
    assert load_state(tmp_path) == state
    data = json.loads((tmp_path / "stack.json").read_text())
    assert data["gateway_url"] == "http://127.0.0.1:8080"
    assert data["services"][0]["health_url"] == "http://127.0.0.1:8080/healthz"
    assert data["services"][0]["metrics_url"] == "http://127.0.0.1:8080/metrics"
    (tmp_path / "stack.json").write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(StateError, match="version 99"):
        load_state(tmp_path)


def test_is_alive_tells_exited_and_recycled_pids_apart(tmp_path: Path) -> None:
    me = ProcessInfo.of(os.getpid(), tmp_path / "log")
    assert me.start_ticks is not None
    assert is_alive(me)
    # Same pid, different start time: a recycled pid is not our process.
    assert not is_alive(ProcessInfo(pid=me.pid, start_ticks=me.start_ticks + 1, log_path=""))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    info = ProcessInfo.of(child.pid, tmp_path / "log")
    child.wait()
    assert not is_alive(info)
    assert start_ticks(child.pid) is None


@pytest.mark.parametrize("command", ["up", "down", "status", "service"])
def test_every_command_has_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.stdout


def test_start_failure_is_printed_verbatim_without_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = "service 'trainer' exited with code 3; log: /x/[bold]/trainer.log\n[/INFO] boom"

    def failing_start(*args: object, **kwargs: object) -> stack.StartOutcome:
        raise HealthError(message)

    monkeypatch.setattr(stack, "start_stack", failing_start)
    result = runner.invoke(app, ["up", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_up_on_running_stack_warns_when_options_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = StackState(
        state_dir=str(tmp_path),
        started_at=1.0,
        bootstrap="127.0.0.1:1234",
        broker=ProcessInfo(pid=1, start_ticks=None, log_path="/b.log"),
        storage_uri=f"file://{(tmp_path / 'objects').resolve()}",
    )

    def already(*args: object, **kwargs: object) -> stack.StartOutcome:
        return stack.StartOutcome(state=running, already_running=True)

    monkeypatch.setattr(stack, "start_stack", already)
    same = runner.invoke(app, ["up", "--state-dir", str(tmp_path)])
    assert same.exit_code == 0
    assert "already running" in same.stdout and "127.0.0.1:1234" in same.stdout
    assert "run `conveyor down` first" not in same.stderr
    other = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--kafka", "k:9092"])
    assert other.exit_code == 0
    assert "Kafka 127.0.0.1:1234 (asked: k:9092)" in other.stderr


def test_scale_parses_counts_and_names_replicas(two_services: None) -> None:
    assert registry.parse_scale(["sharder=2", " gateway = 0 ", "sharder=3"]) == {
        "sharder": 3,
        "gateway": 0,
    }
    assert registry.instance_names("sharder", 1) == ["sharder"]
    assert registry.instance_names("sharder", 3) == ["sharder-1", "sharder-2", "sharder-3"]
    assert registry.instance_names("sharder", 0) == []
    assert registry.replica_counts(["gateway", "sharder-1", "sharder-2", "other-1"]) == {
        "gateway": 1,
        "sharder": 2,
        "other-1": 1,
    }
    for bad in ("sharder", "sharder=", "sharder=-1", "sharder=two", "=2"):
        with pytest.raises(ValueError, match="NAME=N"):
            registry.parse_scale([bad])
    with pytest.raises(ValueError, match="at most"):
        registry.parse_scale([f"sharder={registry.MAX_REPLICAS + 1}"])
    with pytest.raises(registry.UnknownServiceError, match="unknown service 'nope'"):
        registry.parse_scale(["nope=2"])


def test_up_rejects_bad_scale_before_starting_anything(tmp_path: Path, two_services: None) -> None:
    unknown = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--scale", "nope=2"])
    assert unknown.exit_code == 2
    assert "unknown service 'nope'" in unknown.stderr
    malformed = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--scale", "sharder"])
    assert malformed.exit_code == 2
    assert "--scale expects NAME=N" in malformed.stderr
    assert not (tmp_path / "stack.json").exists()


def test_up_passes_scale_and_warns_when_running_stack_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_services: None
) -> None:
    process = ProcessInfo(pid=1, start_ticks=None, log_path="/s.log")
    running = StackState(
        state_dir=str(tmp_path),
        started_at=1.0,
        bootstrap="127.0.0.1:1234",
        broker=None,
        storage_uri=f"file://{(tmp_path / 'objects').resolve()}",
        services=tuple(
            ServiceInfo(name=name, process=process, host="127.0.0.1", port=port)
            for port, name in enumerate(["gateway", "sharder-1", "sharder-2"], start=1000)
        ),
    )
    configs: list[stack.StackConfig] = []

    def already(config: stack.StackConfig, **kwargs: object) -> stack.StartOutcome:
        configs.append(config)
        return stack.StartOutcome(state=running, already_running=True)

    monkeypatch.setattr(stack, "start_stack", already)
    same = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--scale", "sharder=2"])
    assert same.exit_code == 0, same.output
    assert configs[-1].scale == {"sharder": 2}
    assert "run `conveyor down` first" not in same.stderr
    other = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--scale", "sharder=3"])
    assert other.exit_code == 0
    assert "2 sharder process(es) (asked: 3)" in other.stderr


def test_job_roots_default_to_the_working_directory_and_are_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = tmp_path.resolve()  # what os.getcwd() gives after the chdir
    monkeypatch.chdir(tmp_path)
    default = resolve_storage(tmp_path, {})
    assert default.dataset_roots == (f"file://{tmp_path}",)
    assert default.output_roots == ()
    given = resolve_storage(
        tmp_path,
        {"dataset_roots": ("data", "s3://bkt/sets"), "output_roots": ("file://./out", "/srv/o")},
    )
    assert given.dataset_roots == (f"file://{tmp_path}/data", "s3://bkt/sets")
    assert given.output_roots == (f"file://{tmp_path}/out", "file:///srv/o")
    monkeypatch.setenv("CONVEYOR_STORAGE_DATASET_ROOTS", '["/srv/data"]')
    from_env = resolve_storage(tmp_path, {})
    assert from_env.dataset_roots == ("file:///srv/data",)  # the operator's, not the cwd


def test_the_services_read_the_roots_the_stack_passes_them(tmp_path: Path) -> None:
    storage = resolve_storage(
        tmp_path, {"dataset_roots": (str(tmp_path), "s3://bkt/d"), "output_roots": ("/srv/o",)}
    )
    config = stack.StackConfig(state_dir=tmp_path, storage=storage)
    env = stack._service_env(config, "127.0.0.1:9092", 1234)
    assert json.loads(env["CONVEYOR_STORAGE_DATASET_ROOTS"]) == [f"file://{tmp_path}", "s3://bkt/d"]
    child = subprocess.run(
        [sys.executable, "-c",
         "from conveyor.platform.config import StorageSettings; s = StorageSettings(); "
         "print(repr((s.uri, s.dataset_roots, s.output_roots)))"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert child.stdout.strip() == repr(
        (storage.uri, (f"file://{tmp_path}", "s3://bkt/d"), ("file:///srv/o",))
    )


def test_up_passes_allowed_roots_and_warns_when_the_running_stack_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = StackState(
        state_dir=str(tmp_path),
        started_at=1.0,
        bootstrap="127.0.0.1:1234",
        broker=None,
        storage_uri=f"file://{(tmp_path / 'objects').resolve()}",
        dataset_roots=(f"file://{tmp_path}",),
    )
    configs: list[stack.StackConfig] = []

    def already(config: stack.StackConfig, **kwargs: object) -> stack.StartOutcome:
        configs.append(config)
        return stack.StartOutcome(state=running, already_running=True)

    monkeypatch.setattr(stack, "start_stack", already)
    up = ["up", "--state-dir", str(tmp_path)]
    same = runner.invoke(app, [*up, "--allow-data", str(tmp_path)])
    assert same.exit_code == 0, same.output
    assert "run `conveyor down` first" not in same.stderr
    assert f"Job datasets     the object store, file://{tmp_path}" in same.stdout
    other = runner.invoke(app, [*up, "--allow-data", "s3://bkt/d", "--allow-output", "/srv/o"])
    assert other.exit_code == 0, other.output
    assert configs[-1].storage.dataset_roots == ("s3://bkt/d",)
    assert configs[-1].storage.output_roots == ("file:///srv/o",)
    assert f"dataset roots file://{tmp_path} (asked: s3://bkt/d)" in other.stderr
    assert "output roots - (asked: file:///srv/o)" in other.stderr
    bad = runner.invoke(app, [*up, "--allow-output", "gs://bkt/o"])
    assert bad.exit_code == 2
    assert "only file://, s3:// or a local path" in bad.stderr


def test_state_keeps_the_roots(tmp_path: Path) -> None:
    state = StackState(
        state_dir=str(tmp_path),
        started_at=1.5,
        bootstrap="127.0.0.1:9092",
        broker=None,
        storage_uri="s3://conveyor",
        output_roots=("file:///srv/o",),
        dataset_roots=("file:///srv/d", "s3://bkt/d"),
    )
    save_state(state)
    assert load_state(tmp_path) == state
    data = json.loads((tmp_path / "stack.json").read_text())
    assert data["dataset_roots"] == ["file:///srv/d", "s3://bkt/d"]
    del data["dataset_roots"], data["output_roots"]  # a record from before the roots
    (tmp_path / "stack.json").write_text(json.dumps(data))
    loaded = load_state(tmp_path)
    assert loaded is not None and (loaded.dataset_roots, loaded.output_roots) == ((), ())


def test_the_event_stream_is_parsed_into_job_updates() -> None:
    from conveyor.cli.client import _apply_event, _sse_frames

    snapshot = {"id": "j", "state": "pending", "progress": {"step": 0}, "epochs": []}
    planned = {"state": "planned", "progress": {"step": 0}, "data": {}}
    epoch = {
        "state": "running",
        "progress": {"step": 7},
        "data": {"epoch": 0, "eval_accuracy": 0.9},
    }
    lines = [
        "event: snapshot", "id: 1", f"data: {json.dumps(snapshot)}", "",
        ": keepalive", "",
        "event: planned", "id: 2", f"data: {json.dumps(planned)}", "",
        "event: epoch_completed", "id: 3", f"data: {json.dumps(epoch)}", "",
    ]  # fmt: skip
    frames = list(_sse_frames(iter(lines)))
    assert [event for event, _ in frames] == ["snapshot", "planned", "epoch_completed"]
    job = frames[0][1]
    for event, data in frames[1:]:
        job = _apply_event(job, event, data)
    assert job["state"] == "running" and job["progress"] == {"step": 7}
    assert job["epochs"] == [{"epoch": 0, "eval_accuracy": 0.9}]


def test_version_flag() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"conveyor {version('conveyor')}"


def test_report_refuses_a_link_that_is_not_a_web_address(tmp_path: Path) -> None:
    output = tmp_path / "report.html"
    args = ["report", "j1", "--grafana-url", "localhost:3000", "--output", str(output)]
    result = runner.invoke(app, [*args, "--gateway", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "grafana_url must be an http:// or https:// URL" in result.output
    assert not output.exists()


def test_the_run_summary_keeps_a_language_models_perplexity() -> None:
    from conveyor.cli.jobs import SUMMARY_FIELDS, summary_of

    reported = {key: None for key in SUMMARY_FIELDS} | {"eval_loss": 2.4, "eval_perplexity": 11.0}
    job = {"id": "j", "state": "completed", "summary": reported}
    summary = summary_of(job)
    assert summary["eval_perplexity"] == 11.0 and summary["eval_loss"] == 2.4
    image_job = {**job, "summary": {k: v for k, v in reported.items() if k != "eval_perplexity"}}
    assert "eval_perplexity" not in summary_of(image_job)  # image classifiers have none
