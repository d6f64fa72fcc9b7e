"""The ``conveyor`` command line.

Expected failures (no broker binary, a port taken, a service that does not come up, bad
options) print one clear message and exit non-zero; tracebacks are for bugs only.
Exit codes: 0 success, 1 failure or something down, 2 bad usage (unknown service, bad option).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.markup import escape

from conveyor.cli import checkpoints as cli_checkpoints
from conveyor.cli import jobs as cli_jobs
from conveyor.cli import report as cli_report
from conveyor.cli.options import DEFAULT_STATE_DIR, JsonFlag, StateDir, err, fail, out
from conveyor.embedded import registry
from conveyor.platform.config import check_retired_env
from conveyor.platform.errors import ConveyorError

if TYPE_CHECKING:
    from conveyor.embedded.state import StackState

app = typer.Typer(
    name="conveyor",
    help="Distributed PyTorch training fed by a Kafka data pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold credentials
)

_out = out
_err = err
_fail = fail


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        print(f"conveyor {version('conveyor')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Distributed PyTorch training fed by a Kafka data pipeline."""


def _print_json(data: dict[str, Any]) -> None:
    # Plain print: rich would highlight and wrap, and the output is for programs.
    print(json.dumps(data, sort_keys=True))


@app.command()
def up(
    state_dir: StateDir = DEFAULT_STATE_DIR,
    kafka: Annotated[
        str | None,
        typer.Option(help="Bootstrap of a running Kafka cluster; no embedded broker then."),
    ] = None,
    storage_uri: Annotated[
        str | None,
        typer.Option(
            help="Object store root, file://DIR or s3://BUCKET/PREFIX (env CONVEYOR_STORAGE_URI). "
            "Default: s3://conveyor with --s3, else file://STATE_DIR/objects."
        ),
    ] = None,
    s3: Annotated[
        str | None,
        typer.Option(
            "--s3", metavar="ENDPOINT", help="host:port of an S3 endpoint (MinIO) to store objects."
        ),
    ] = None,
    s3_access_key: Annotated[str | None, typer.Option(help="S3 access key.")] = None,
    s3_secret_key: Annotated[str | None, typer.Option(help="S3 secret key.")] = None,
    s3_region: Annotated[str | None, typer.Option(help="S3 region.")] = None,
    s3_secure: Annotated[bool | None, typer.Option(help="Use HTTPS for S3.")] = None,
    allow_data: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-data",
            metavar="LOCATION",
            help="A directory or s3://BUCKET/PREFIX jobs may read datasets from, besides the "
            "object store (env CONVEYOR_STORAGE_DATASET_ROOTS, a JSON list). Repeatable. "
            "Default: the directory conveyor up runs in.",
        ),
    ] = None,
    allow_output: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-output",
            metavar="LOCATION",
            help="A directory or s3://BUCKET/PREFIX a job's checkpoint.uri may name, besides "
            "the object store (env CONVEYOR_STORAGE_OUTPUT_ROOTS, a JSON list). Repeatable.",
        ),
    ] = None,
    foreground: Annotated[
        bool,
        typer.Option("--foreground", help="Stay attached; Ctrl-C or SIGTERM stops the stack."),
    ] = False,
    health_timeout_s: Annotated[
        float, typer.Option(help="Seconds the services may take to become healthy.")
    ] = 60.0,
    scale: Annotated[
        list[str] | None,
        typer.Option(
            "--scale",
            metavar="NAME=N",
            help="Run N processes of service NAME (each with its own port and log file "
            "NAME-1.log ..; 0 leaves it out). Repeatable: --scale preprocessor=2 --scale ...",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Start the embedded stack (broker, object store, every service) and print its URLs."""
    from conveyor.embedded import display, stack
    from conveyor.embedded.store import resolve_storage

    try:
        replicas = registry.parse_scale(scale or [])
    except (registry.UnknownServiceError, ValueError) as exc:
        _fail(str(exc), code=2)
    try:
        storage = resolve_storage(
            state_dir,
            {
                "uri": storage_uri,
                "s3_endpoint": s3,
                "s3_access_key": s3_access_key,
                "s3_secret_key": s3_secret_key,
                "s3_region": s3_region,
                "s3_secure": s3_secure,
                "dataset_roots": tuple(allow_data) if allow_data else None,
                "output_roots": tuple(allow_output) if allow_output else None,
            },
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'storage'}: {e['msg']}" for e in exc.errors()
        )
        _fail(f"invalid storage options: {problems}", code=2)
    except ValueError as exc:
        _fail(f"invalid storage options: {exc}", code=2)
    config = stack.StackConfig(
        state_dir=state_dir,
        storage=storage,
        kafka_bootstrap=kafka,
        health_timeout_s=health_timeout_s,
        scale=replicas,
    )
    err = _err()
    # In the foreground, a SIGTERM that lands while the stack is starting must still stop it:
    # the handler only records the request, which the watch loop honours right after start.
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if foreground:
        previous = {
            sig: signal.signal(sig, lambda signum, frame: stop.set())
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
    try:
        with err.status("Starting the Conveyor stack") as status:
            outcome = stack.start_stack(config, notify=lambda msg: status.update(msg))
    except ConveyorError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted; everything started was stopped again", code=130)
    if outcome.replaced_stale:
        err.print("[yellow]a stale stack record was cleaned up[/yellow]")
    if outcome.already_running:
        _warn_ignored_options(
            outcome.state,
            kafka=kafka,
            storage_uri=storage.uri,
            scale=replicas,
            dataset_roots=storage.dataset_roots if allow_data else None,
            output_roots=storage.output_roots if allow_output else None,
        )
    if as_json:
        _print_json(display.started_json(outcome))
    else:
        display.print_started(_out(), outcome, str(state_dir))
    if foreground and not outcome.already_running:
        raise typer.Exit(_run_foreground(state_dir, outcome.state, stop, previous))


def _warn_ignored_options(
    state: StackState,
    *,
    kafka: str | None,
    storage_uri: str,
    scale: dict[str, int],
    dataset_roots: tuple[str, ...] | None = None,
    output_roots: tuple[str, ...] | None = None,
) -> None:
    """A running stack is reused as is: say so when the options asked for something else
    (None: not asked)."""
    differs = []
    if kafka is not None and kafka != state.bootstrap:
        differs.append(f"Kafka {state.bootstrap} (asked: {kafka})")
    if storage_uri != state.storage_uri:
        differs.append(f"object store {state.storage_uri} (asked: {storage_uri})")
    for what, asked, recorded in (
        ("dataset roots", dataset_roots, state.dataset_roots),
        ("output roots", output_roots, state.output_roots),
    ):
        if asked is not None and asked != recorded:
            differs.append(f"{what} {', '.join(recorded) or '-'} (asked: {', '.join(asked)})")
    running = registry.replica_counts(s.name for s in state.services)
    for name, count in sorted(scale.items()):
        if running.get(name, 0) != count:
            differs.append(f"{running.get(name, 0)} {name} process(es) (asked: {count})")
    if differs:
        _err().print(
            f"[yellow]the running stack uses {escape('; '.join(differs))}; "
            "run `conveyor down` first to change it[/yellow]",
            soft_wrap=True,
        )


def _run_foreground(
    state_dir: Path,
    state: StackState,
    stop: threading.Event,
    previous: dict[signal.Signals, Any],
) -> int:
    """Watch the stack until ``stop`` is set (by a signal) or a component dies, then stop it.
    ``previous``: the signal handlers to restore afterwards."""
    from conveyor.embedded import stack

    err = _err()
    err.print("Running in the foreground; Ctrl-C stops the stack.")
    dead: str | None = None
    try:
        while not stop.wait(1.0):
            dead = stack.first_dead(state)
            if dead is not None:
                err.print(f"[red]{dead} stopped running; stopping the stack[/red]")
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stack.stop_stack(state_dir)
    err.print("Stack stopped.")
    return 1 if dead is not None else 0


@app.command()
def down(
    state_dir: StateDir = DEFAULT_STATE_DIR,
    timeout_s: Annotated[
        float, typer.Option(help="Grace period after SIGTERM before SIGKILL, in seconds.")
    ] = 15.0,
    as_json: JsonFlag = False,
) -> None:
    """Stop the stack: services first, then the broker. Does nothing if none runs."""
    from conveyor.embedded import display, stack

    try:
        outcome = stack.stop_stack(state_dir, timeout_s=timeout_s)
    except ConveyorError as exc:
        _fail(str(exc))
    if as_json:
        _print_json(display.stopped_json(outcome))
    elif outcome is None:
        _out().print(f"No Conveyor stack is recorded in {state_dir}; nothing to stop.")
    else:
        display.print_stopped(_out(), outcome)


@app.command()
def status(state_dir: StateDir = DEFAULT_STATE_DIR, as_json: JsonFlag = False) -> None:
    """Show every component of the stack and whether it is alive and healthy.

    Exits 1 when no stack runs or any recorded component is down.
    """
    from conveyor.embedded import display
    from conveyor.embedded import report as stack_report

    try:
        report = stack_report.stack_report(state_dir)
    except ConveyorError as exc:
        _fail(str(exc))
    if as_json:
        _print_json(display.report_json(report))
    elif report is None:
        _out().print(f"No Conveyor stack is running (nothing recorded in {state_dir}).")
    else:
        display.print_report(_out(), report)
    if report is None or not report.healthy:
        raise typer.Exit(1)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def service(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Registered service to run.")],
) -> None:
    """Run one service in the foreground (what containers do); extra arguments go to it."""
    try:
        spec = registry.resolve(name)
        check_retired_env(os.environ)
    except (registry.UnknownServiceError, ValueError) as exc:
        _fail(str(exc), code=2)
    entry = registry.load_entry(spec)
    code = entry(list(ctx.args)) or 0
    # The service has stopped: offsets committed, producers flushed, traces exported. Tearing
    # down an interpreter that holds torch takes seconds of CPU per process (every stop of the
    # stack paid it, and a supervisor restart waits on it), so end the process now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


cli_jobs.register(app)
cli_checkpoints.register(app)
cli_report.register(app)


def main() -> None:
    """Entry point of the ``conveyor`` script."""
    app()
