"""Options and output helpers shared by the command-line modules."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

StateDir = Annotated[
    Path,
    typer.Option(
        "--state-dir",
        envvar="CONVEYOR_STATE_DIR",
        help="Directory holding stack.json, logs/ and the local object store.",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]
DEFAULT_STATE_DIR = Path(".conveyor")


def out() -> Console:
    return Console()


def err() -> Console:
    return Console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one clear error line and exit with ``code`` (no traceback)."""
    err().print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)
