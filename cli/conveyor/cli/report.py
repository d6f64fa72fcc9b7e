"""``conveyor report JOB``: the job page the gateway serves at ``/jobs/{id}``, written to a
file (the same renderer, :mod:`conveyor.training.jobreport`, over the same JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from conveyor.cli.jobs import GatewayOption, TokenOption, gateway_for
from conveyor.cli.options import DEFAULT_STATE_DIR, StateDir, fail
from conveyor.platform.errors import ConveyorError
from conveyor.training.jobreport import ReportLinks, job_page


def register(app: typer.Typer) -> None:
    """Add ``report`` to ``app``."""

    @app.command()
    def report(
        job_id: Annotated[str, typer.Argument(help="Job id.")],
        output: Annotated[
            Path | None,
            typer.Option("--output", "-o", help="HTML file to write; default: report-<job>.html."),
        ] = None,
        jaeger_url: Annotated[
            str | None,
            typer.Option(envvar="CONVEYOR_JAEGER_URL", help="Jaeger UI to link the traces to."),
        ] = None,
        grafana_url: Annotated[
            str | None,
            typer.Option(envvar="CONVEYOR_GRAFANA_URL", help="Grafana to link the dashboard to."),
        ] = None,
        state_dir: StateDir = DEFAULT_STATE_DIR,
        gateway: GatewayOption = None,
        token: TokenOption = None,
    ) -> None:
        """Write JOB's report (state, progress, loss and accuracy per epoch, step-time
        breakdown, stage latencies, links) as one self-contained HTML file; prints its path."""
        try:
            links = ReportLinks(jaeger_url=jaeger_url, grafana_url=grafana_url)
            with gateway_for(state_dir, gateway, token, start=False) as client:
                job, stages = client.job(job_id), client.stages(job_id)
        except (ConveyorError, ValueError) as exc:
            fail(str(exc))
        path = output if output is not None else Path(f"report-{job_id}.html")
        try:
            path.write_text(job_page(job, stages, links=links), encoding="utf-8")
        except OSError as exc:
            fail(f"cannot write {path}: {exc.strerror}")
        print(path)
