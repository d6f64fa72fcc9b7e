"""Checkpoint commands of the ``conveyor`` command line: checkpoints, resume, model pull."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from conveyor.cli.jobs import GatewayOption, TokenOption, dumps, gateway_for
from conveyor.cli.options import DEFAULT_STATE_DIR, StateDir, fail
from conveyor.platform.errors import ConveyorError


def register(app: typer.Typer) -> None:
    """Add the checkpoint commands to ``app``."""

    @app.command()
    def checkpoints(
        job_id: Annotated[str, typer.Argument(help="Job id.")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
        take: Annotated[
            bool, typer.Option("--take", help="Ask for a checkpoint at the next step first.")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
    ) -> None:
        """List a job's checkpoints, newest first (committed, or incomplete: being written or
        torn, never loaded)."""
        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                if take:
                    client.request_checkpoint(job_id)
                    Console(stderr=True).print(f"checkpoint of job {job_id} requested")
                listing = client.checkpoints(job_id)
        except ConveyorError as exc:
            fail(str(exc))
        if as_json:
            print(dumps(listing))
            return
        table = Table("version", "step", "state", "trigger", "size", "created", "uri")
        for row in listing["checkpoints"]:
            created = row["created_at"]
            table.add_row(
                f"{row['version']}{' (latest)' if row['latest'] else ''}",
                "" if row["step"] is None else str(row["step"]),
                row["state"],
                row["trigger"] or "",
                f"{row['size_bytes'] / 1e6:.2f} MB" if row["size_bytes"] else "",
                ""
                if created is None
                else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)),
                row["uri"],
            )
        Console().print(table)

    model = typer.Typer(help="The model a job exported.", no_args_is_help=True)
    app.add_typer(model, name="model")

    @model.command("pull")
    def pull(
        job_id: Annotated[str, typer.Argument(help="Job id (a completed job).")],
        directory: Annotated[Path, typer.Argument(help="Directory to write the files into.")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
    ) -> None:
        """Download the exported model (model.safetensors + config.json, and losses.json: the
        training loss of every step) into DIRECTORY; load it with
        ``conveyor.training.exported.load_model(DIRECTORY)``."""
        from conveyor.training.exported import MODEL_FILES

        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                files = {name: client.model_file(job_id, name) for name in MODEL_FILES}
        except ConveyorError as exc:
            fail(str(exc))
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (directory / name).write_bytes(data)
        print(directory)

    @app.command()
    def resume(
        job_id: Annotated[str, typer.Argument(help="Job id (a failed or cancelled job).")],
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
    ) -> None:
        """Restart a failed or cancelled job, under its id, from its newest usable checkpoint;
        follow it with ``conveyor status JOB``."""
        try:
            with gateway_for(state_dir, gateway, token, start=False) as client:
                job = client.resume(job_id)
        except ConveyorError as exc:
            fail(str(exc))
        print(f"job {job_id} resumed from checkpoint v{job['resumed_from']}")
