"""Job commands of the ``conveyor`` command line: run, submit, job status, cancel, dataset pack
(checkpoints, resume and model pull: :mod:`.checkpoints`).

``conveyor run SPEC`` uses the stack recorded in the state directory when it is healthy, or
starts one (and stops it again at the end unless ``--keep-stack``), submits the job, follows it
with a progress bar and prints the summary; ``--json`` prints the summary as one JSON object
on the last line of standard output.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from conveyor.cli.client import TERMINAL_STATES, GatewayClient, GatewayError
from conveyor.cli.options import DEFAULT_STATE_DIR, StateDir, fail
from conveyor.platform.errors import ConveyorError

SUMMARY_FIELDS = (
    "job_id",
    "state",
    "epochs",
    "steps",
    "samples",
    "eval_accuracy",
    "eval_loss",
    "samples_per_second",
    "data_wait_ratio",
    "grad_bytes_per_step",
    "checkpoint",
)

GatewayOption = Annotated[
    str | None,
    typer.Option(
        "--gateway",
        envvar="CONVEYOR_GATEWAY_URL",
        help="Gateway base URL; default: the gateway of the stack in --state-dir.",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="CONVEYOR_API_TOKEN", help="Bearer token of the gateway."),
]


def load_spec(path: Path) -> dict[str, Any]:
    """Read and validate a YAML/JSON job spec; ValueError with the field-level problems."""
    from pydantic import ValidationError

    from conveyor.training.jobspec import JobSpec

    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read job spec {path}: {exc.strerror}") from exc
    try:
        return JobSpec.from_yaml(text).to_dict()
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid job spec {path}: {problems}") from exc


@contextmanager
def gateway_for(
    state_dir: Path,
    gateway: str | None,
    token: str | None,
    *,
    start: bool,
    keep: bool = True,
    scale: dict[str, int] | None = None,
) -> Iterator[GatewayClient]:
    """A client of ``gateway``, else of the recorded stack's gateway; with ``start`` a stack is
    started when none runs (``scale``: processes per service), and stopped on exit unless
    ``keep``."""
    from conveyor.embedded import stack
    from conveyor.embedded.report import probe_stack
    from conveyor.embedded.state import load_state
    from conveyor.embedded.store import resolve_storage

    started = False
    url = gateway
    if url is None:
        state = load_state(state_dir)
        if state is None or not probe_stack(state).serves_clients:
            if not start:
                raise ConveyorError(
                    f"no healthy Conveyor stack in {state_dir}: run `conveyor up` or pass --gateway"
                )
            config = stack.StackConfig(
                state_dir=state_dir,
                storage=resolve_storage(state_dir, {}),
                scale=dict(scale or {}),
            )
            with Console(stderr=True).status("Starting the Conveyor stack") as status:
                state = stack.start_stack(config, notify=status.update).state
            started = True
        url = state.gateway_url
        if url is None:
            raise ConveyorError("the running stack has no gateway")
    client = GatewayClient(url, token=token)
    try:
        client.wait_ready()
        yield client
    finally:
        client.close()
        if started and not keep:
            stack.stop_stack(state_dir)


def pool_sizes(spec: dict[str, Any]) -> dict[str, int]:
    """The trainer and aggregator processes a stack started for ``spec`` runs: one per trainer
    and one per parameter slice the job asks for (``distribution.aggregator_shards``)."""
    from conveyor.embedded.registry import MAX_REPLICAS

    distribution = spec["distribution"]
    return {
        "trainer": min(distribution["trainers"], MAX_REPLICAS),
        "aggregator": min(distribution["aggregator_shards"], MAX_REPLICAS),
    }


def summary_of(job: dict[str, Any]) -> dict[str, Any]:
    """The run summary of DESIGN section 7, from the job as the gateway reports it."""
    reported = job.get("summary") or {}
    progress = job.get("progress") or {}
    last_epoch = (job.get("epochs") or [{}])[-1]
    fallback = {
        "job_id": job["id"],
        "state": job["state"],
        "epochs": len(job.get("epochs") or []),
        "steps": progress.get("step"),
        "samples": progress.get("samples_trained"),
        "eval_accuracy": last_epoch.get("eval_accuracy"),
        "eval_loss": last_epoch.get("eval_loss"),
        "samples_per_second": progress.get("samples_per_second"),
        "data_wait_ratio": progress.get("data_wait_ratio"),
        "grad_bytes_per_step": None,
        "checkpoint": None,
    }
    summary = {key: reported.get(key, fallback[key]) for key in SUMMARY_FIELDS}
    summary["job_id"], summary["state"] = job["id"], job["state"]
    if "eval_perplexity" in reported:  # a language model's (tokens://) summary
        summary["eval_perplexity"] = reported["eval_perplexity"]
    if job.get("reason"):
        summary["reason"] = job["reason"]
    return summary


def follow_with_progress(client: GatewayClient, job_id: str, *, quiet: bool) -> dict[str, Any]:
    """Follow the job to its end over the gateway's event stream: a progress bar over its
    optimizer steps on a terminal (stderr); in a log (not a terminal), a line per state
    change, per epoch and at most every ``_LOG_EVERY_S`` seconds of progress."""
    interactive = sys.stderr.isatty()
    bar = tqdm(total=None, unit="step", desc=job_id[:12], file=sys.stderr,
               disable=quiet or not interactive)  # fmt: skip
    job: dict[str, Any] = {}
    logged: tuple[str, int] = ("", 0)
    logged_at = 0.0
    queued_at: int | None = None
    try:
        for job in client.follow(job_id):
            progress = job["progress"]
            position = job.get("queue_position") if job["state"] == "queued" else None
            if position is not None and position != queued_at and not quiet:
                # A gateway restarting: no hint this time; the stream resumes on its own.
                with contextlib.suppress(GatewayError):
                    bar.write(why_queued(client, job_id, position), file=sys.stderr)
            queued_at = position
            if bar.total is None and progress.get("total_steps"):
                bar.total = progress["total_steps"]
                bar.refresh()
            bar.n = progress.get("step") or 0
            if bar.total is not None and bar.n > bar.total:
                # Partial steps at epoch ends (a trainer short of batches) add steps.
                bar.total = bar.n
            postfix = _postfix(job)
            bar.set_postfix(postfix, refresh=True)
            epochs = len(job.get("epochs") or [])
            now = time.monotonic()
            if not (quiet or interactive) and (
                (job["state"], epochs) != logged or now - logged_at >= _LOG_EVERY_S
            ):
                total = progress.get("total_steps") or "?"
                details = " ".join(f"{k}={v}" for k, v in postfix.items())
                print(f"job {job_id}: step {bar.n}/{total} {details}", file=sys.stderr, flush=True)
                logged, logged_at = (job["state"], epochs), now
    finally:
        bar.close()
    return job


_LOG_EVERY_S = 10.0


def why_queued(client: GatewayClient, job_id: str, position: int) -> str:
    """One line saying what the queued job waits for, from the gateway's ``/v1/queue``."""
    queue = client.queue()
    entry = next((q for q in queue["queued"] if q["id"] == job_id), None)
    needs = "" if entry is None else f" for {entry['min_trainers']} trainer(s)"
    return (
        f"job {job_id}: queued at position {position}{needs}; the trainer pool has "
        f"{queue['pool_size']} ({len(queue['idle_trainers'])} idle). It starts when enough "
        "trainers are free (on the embedded stack: conveyor up --scale trainer=N)."
    )


def _postfix(job: dict[str, Any]) -> dict[str, Any]:
    progress = job["progress"]
    epochs = job.get("epochs") or []
    postfix: dict[str, Any] = {"state": job["state"], "epoch": progress.get("epoch")}
    if progress.get("loss") is not None:
        postfix["loss"] = f"{progress['loss']:.3f}"
    if epochs and epochs[-1].get("eval_accuracy") is not None:
        postfix["eval_acc"] = f"{epochs[-1]['eval_accuracy']:.3f}"
    if progress.get("samples_per_second"):
        postfix["samples/s"] = f"{progress['samples_per_second']:.0f}"
    if progress.get("data_wait_ratio") is not None:
        postfix["data_wait"] = f"{progress['data_wait_ratio']:.1%}"
    return postfix


def print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"Job {summary['job_id']}", show_header=False)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        table.add_row(key, str(value))
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add the job commands to ``app``."""

    @app.command()
    def run(
        spec: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
        keep_stack: Annotated[
            bool, typer.Option("--keep-stack", help="Leave a stack this command started running.")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    ) -> None:
        """Start the stack if needed, submit SPEC, follow it with a progress bar, print the
        summary. Exit code 0 when the job completed, 1 otherwise."""
        spec_dict = _or_fail(lambda: load_spec(spec), code=2)
        try:
            with gateway_for(
                state_dir,
                gateway,
                token,
                start=True,
                keep=keep_stack,
                scale=pool_sizes(spec_dict),
            ) as client:
                job = client.submit(spec_dict)
                Console(stderr=True).print(
                    f"submitted job [bold]{job['id']}[/bold] ({job['name']})"
                )
                try:
                    job = follow_with_progress(client, job["id"], quiet=False)
                except KeyboardInterrupt:
                    client.cancel(job["id"])
                    _fail(f"interrupted: cancellation of job {job['id']} requested", code=130)
        except ConveyorError as exc:
            _fail(str(exc))
        summary = summary_of(job)
        if as_json:
            print(dumps(summary))
        else:
            print_summary(summary)
        raise typer.Exit(0 if job["state"] == "completed" else 1)

    @app.command()
    def submit(
        spec: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
        idempotency_key: Annotated[
            str | None, typer.Option(help="Same key, same job: safe to retry.")
        ] = None,
    ) -> None:
        """Submit SPEC to a running stack and print the job id."""
        spec_dict = _or_fail(lambda: load_spec(spec), code=2)
        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                job = client.submit(spec_dict, idempotency_key=idempotency_key)
        except ConveyorError as exc:
            _fail(str(exc))
        print(job["id"])

    @app.command()
    def job(
        job_id: Annotated[str, typer.Argument(help="Job id.")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
        wait: Annotated[bool, typer.Option("--wait", help="Follow it until it ends.")] = False,
    ) -> None:
        """Print one job (state, progress, eval results, summary) as JSON."""
        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                found = (
                    follow_with_progress(client, job_id, quiet=False)
                    if wait
                    else client.job(job_id)
                )
        except ConveyorError as exc:
            _fail(str(exc))
        print(dumps(found))
        if found["state"] in TERMINAL_STATES and found["state"] != "completed":
            raise typer.Exit(1)

    @app.command("jobs")
    def list_jobs(
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
        state: Annotated[
            str | None,
            typer.Option(help="Only jobs in this state (pending, queued, running, ...)."),
        ] = None,
        limit: Annotated[int, typer.Option(min=1, max=1000, help="Most jobs listed.")] = 50,
        as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
    ) -> None:
        """List jobs, newest first."""
        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                found = client.jobs(state=state, limit=limit)
        except ConveyorError as exc:
            _fail(str(exc))
        if as_json:
            print(dumps({"jobs": found, "count": len(found)}))
            return
        table = Table("id", "name", "state", "trainers", "epoch", "step", "loss", "submitted")
        for job in found:
            progress = job["progress"]
            total = progress.get("total_steps")
            loss = progress.get("loss")
            position = job.get("queue_position")
            table.add_row(
                job["id"],
                job["name"],
                job["state"] if position is None else f"{job['state']} #{position}",
                str(len(job.get("trainers", []))),
                f"{progress['epoch']}/{progress['epochs']}",
                f"{progress['step']}/{total}" if total else str(progress["step"]),
                "" if loss is None else f"{loss:.3f}",
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["submitted_at"])),
            )
        Console().print(table)

    @app.command()
    def cancel(
        job_id: Annotated[str, typer.Argument(help="Job id.")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
    ) -> None:
        """Ask for a job to be cancelled."""
        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                client.cancel(job_id)
        except ConveyorError as exc:
            _fail(str(exc))
        print(f"cancellation of job {job_id} requested")

    dataset = typer.Typer(help="Dataset tools.", no_args_is_help=True)
    app.add_typer(dataset, name="dataset")

    @dataset.command("pack")
    def pack(
        source: Annotated[
            str,
            typer.Argument(
                help="An idx directory, a .npz with x and y, a .npy images file, or an image "
                "folder (class folders of JPEG/PNG; a directory or imagefolder://s3://...)."
            ),
        ],
        dest: Annotated[str, typer.Argument(help="Local directory or s3://bucket/prefix.")],
        labels: Annotated[
            Path | None, typer.Option(help="Labels .npy when SOURCE is a .npy of images.")
        ] = None,
        shard_size: Annotated[int, typer.Option(min=1, help="Samples per shard.")] = 4096,
        overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset.")] = False,
    ) -> None:
        """Write shards and a manifest (last, with each shard's sha256); prints the dataset URI
        to put in a job spec. Arrays and idx files become npz shards, an image folder
        WebDataset tar shards (the files' bytes as they are). S3 credentials come from
        CONVEYOR_STORAGE_S3_*."""
        from conveyor.platform.config import StorageSettings
        from conveyor.training.datasets.pack import pack_source
        from conveyor.training.datasets.pack_webdataset import (
            WebDatasetPackResult,
            is_image_folder,
            pack_imagefolder,
        )

        remote = (dest, source.removeprefix("imagefolder://"))
        folder: WebDatasetPackResult | None = None
        with tqdm(total=None, unit="sample", desc="packed", file=sys.stderr,
                  disable=not sys.stderr.isatty()) as bar:  # fmt: skip

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            try:
                storage = StorageSettings() if any("s3://" in place for place in remote) else None
                if is_image_folder(source):
                    if labels is not None:
                        raise ValueError("--labels is only for .npy inputs")
                    folder = pack_imagefolder(
                        source, dest, shard_size=shard_size, storage=storage,
                        overwrite=overwrite, progress=progress,
                    )  # fmt: skip
                else:
                    result = pack_source(
                        source,
                        dest,
                        labels_path=labels,
                        shard_size=shard_size,
                        storage=storage,
                        overwrite=overwrite,
                        progress=progress,
                    )
            except (ConveyorError, ValueError, OSError) as exc:
                _fail(str(exc))
        if folder is not None:
            Console(stderr=True).print(
                f"packed {folder.manifest.num_samples} images of "
                f"{len(folder.manifest.classes)} classes into "
                f"{len(folder.manifest.shards)} tar shard(s)"
            )
            print(folder.uri)
            return
        manifest = result.manifest
        Console(stderr=True).print(
            f"packed {manifest.num_samples} samples of shape {list(manifest.sample_shape)} "
            f"into {len(manifest.shards)} shard(s)"
        )
        print(result.uri)


def dumps(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, sort_keys=True, default=str)


def _or_fail(make: Any, *, code: int) -> Any:
    try:
        return make()
    except ValueError as exc:
        _fail(str(exc), code=code)


_fail = fail
