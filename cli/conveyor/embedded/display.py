"""Human-readable (rich) and machine-readable (one JSON object) views of the stack."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conveyor.embedded.report import StackReport
from conveyor.embedded.stack import StartOutcome, StopOutcome
from conveyor.embedded.state import StackState


def _yes_no(value: bool | None) -> str:
    if value is None:
        return "[dim]-[/dim]"
    return "[green]yes[/green]" if value else "[red]no[/red]"


def _roots(roots: tuple[str, ...]) -> str:
    return ", ".join(["the object store", *roots])


def print_stack(console: Console, state: StackState) -> None:
    """The URLs a user needs: bootstrap, object store, every service, the gateway."""
    if state.broker is not None:
        broker = f"embedded Tansu, pid {state.broker.pid}, log {escape(state.broker.log_path)}"
    else:
        broker = "external cluster"
    lines = [
        f"  [bold]Kafka bootstrap[/bold]  {state.bootstrap}  [dim]({broker})[/dim]",
        f"  [bold]Object store[/bold]     {escape(state.storage_uri)}",
        f"  [bold]Job datasets[/bold]     {escape(_roots(state.dataset_roots))}",
        f"  [bold]Job outputs[/bold]      {escape(_roots(state.output_roots))}",
    ]
    if state.gateway_url:
        lines.append(f"  [bold]Gateway[/bold]          {state.gateway_url}")
    for service in state.services:
        lines.append(
            f"  [bold]{service.name}[/bold]  health {service.health_url}  "
            f"metrics {service.metrics_url}  [dim](pid {service.process.pid}, "
            f"log {escape(service.process.log_path)})[/dim]"
        )
    if not state.services:
        lines.append("  [dim]no services registered yet: broker and object store only[/dim]")
    for line in lines:
        # soft_wrap keeps URLs and paths on one line whatever the terminal width.
        console.print(line, soft_wrap=True, highlight=False)


def print_started(console: Console, outcome: StartOutcome, state_dir: str) -> None:
    if outcome.already_running:
        console.print("[bold green]Conveyor stack already running[/bold green]", soft_wrap=True)
    else:
        console.print("[bold green]Conveyor stack is up[/bold green]", soft_wrap=True)
    print_stack(console, outcome.state)
    console.print(f"Stop it with: conveyor down --state-dir {escape(state_dir)}", soft_wrap=True)


def print_report(console: Console, report: StackReport) -> None:
    table = Table(title=f"Conveyor stack ({escape(report.state.state_dir)})")
    for column in ("component", "pid", "alive", "healthy", "address", "detail"):
        table.add_column(column, overflow="fold")
    for c in report.components:
        table.add_row(
            c.name,
            str(c.pid) if c.pid is not None else "-",
            _yes_no(c.alive),
            _yes_no(c.healthy),
            escape(c.url or "-"),
            escape(c.detail),
        )
    console.print(table)
    if report.healthy:
        console.print("[green]all components healthy[/green]")
    else:
        down = ", ".join(c.name for c in report.components if not c.healthy)
        console.print(f"[red]not healthy: {down}[/red]", soft_wrap=True)


def print_stopped(console: Console, outcome: StopOutcome) -> None:
    result = outcome.result
    stopped = len(result.terminated) + len(result.killed)
    console.print(
        f"Stopped {stopped} process(es) of the stack in {escape(outcome.state.state_dir)}"
    )
    if result.killed:
        pids = ", ".join(map(str, result.killed))
        console.print(f"[yellow]killed after the grace period: {pids}[/yellow]")
    if result.already_gone:
        pids = ", ".join(map(str, result.already_gone))
        console.print(f"[dim]already gone: {pids}[/dim]")


def started_json(outcome: StartOutcome) -> dict[str, Any]:
    return {
        "already_running": outcome.already_running,
        "replaced_stale": outcome.replaced_stale,
        "stack": outcome.state.to_json(),
    }


def report_json(report: StackReport | None) -> dict[str, Any]:
    if report is None:
        return {"running": False, "healthy": False, "stack": None, "components": []}
    return {
        "running": True,
        "healthy": report.healthy,
        "stack": report.state.to_json(),
        "components": [
            {
                "name": c.name,
                "kind": c.kind,
                "pid": c.pid,
                "alive": c.alive,
                "healthy": c.healthy,
                "url": c.url,
                "detail": c.detail,
            }
            for c in report.components
        ],
    }


def stopped_json(outcome: StopOutcome | None) -> dict[str, Any]:
    if outcome is None:
        return {"stopped": False, "reason": "no stack recorded"}
    return {
        "stopped": True,
        "state_dir": outcome.state.state_dir,
        "terminated": list(outcome.result.terminated),
        "killed": list(outcome.result.killed),
        "already_gone": list(outcome.result.already_gone),
    }
