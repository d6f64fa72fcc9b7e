"""Health of a recorded stack: every process alive, broker serving metadata, store reachable,
every service answering /healthz."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from conveyor.embedded.health import Probe, broker_probe, http_probe
from conveyor.embedded.procs import is_alive
from conveyor.embedded.state import StackState, load_state
from conveyor.embedded.store import store_probe


@dataclass(kw_only=True, slots=True, frozen=True)
class ComponentStatus:
    """Health of one recorded component."""

    name: str
    kind: Literal["broker", "store", "service"]
    pid: int | None
    alive: bool | None
    """None when the component is not a process of this stack (external Kafka, S3)."""
    healthy: bool
    detail: str
    url: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class StackReport:
    state: StackState
    components: tuple[ComponentStatus, ...]

    @property
    def healthy(self) -> bool:
        return all(c.healthy for c in self.components)

    @property
    def serves_clients(self) -> bool:
        """The broker, the store and the gateway answer: what a client command needs. The
        other services may be restarting (the supervisor) or being added or removed (the
        autoscaler) at any moment without the stack being any less usable."""
        needed = [c for c in self.components if c.kind != "service" or c.name == "gateway"]
        return any(c.name == "gateway" for c in needed) and all(c.healthy for c in needed)


def probe_stack(state: StackState) -> StackReport:
    """Probe every recorded component: pid alive, broker metadata, store, /healthz."""
    components: list[ComponentStatus] = []
    broker_alive = is_alive(state.broker) if state.broker else None
    probe = (
        broker_probe(state.bootstrap)
        if broker_alive is not False
        else Probe(healthy=False, detail="process is gone")
    )
    components.append(
        ComponentStatus(
            name="broker" if state.broker else "kafka (external)",
            kind="broker",
            pid=state.broker.pid if state.broker else None,
            alive=broker_alive,
            healthy=probe.healthy,
            detail=probe.detail,
            url=state.bootstrap,
        )
    )
    store = store_probe(state.storage_uri, state.storage_endpoint)
    components.append(
        ComponentStatus(
            name="object store",
            kind="store",
            pid=None,
            alive=None,
            healthy=store.healthy,
            detail=store.detail,
            url=state.storage_uri,
        )
    )
    for service in state.services:
        alive = is_alive(service.process)
        probe = (
            http_probe(service.health_url, pid=service.process.pid)
            if alive
            else Probe(healthy=False, detail="process is gone")
        )
        components.append(
            ComponentStatus(
                name=service.name,
                kind="service",
                pid=service.process.pid,
                alive=alive,
                healthy=probe.healthy,
                detail=probe.detail,
                url=service.base_url,
            )
        )
    return StackReport(state=state, components=tuple(components))


def stack_report(state_dir: Path) -> StackReport | None:
    """Health of the recorded stack, or None when none is recorded."""
    state = load_state(state_dir)
    return probe_stack(state) if state is not None else None
