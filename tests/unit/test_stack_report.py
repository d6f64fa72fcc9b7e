"""What a client command needs of a recorded stack: the broker, the store and the gateway
healthy, whatever the other services are doing (restarted by the supervisor, added or removed
by the autoscaler)."""

from __future__ import annotations

from typing import Any, Literal

from conveyor.embedded.report import ComponentStatus, StackReport

Kind = Literal["broker", "store", "service"]


def component(name: str, kind: Kind, healthy: bool) -> ComponentStatus:
    return ComponentStatus(
        name=name, kind=kind, pid=None, alive=None, healthy=healthy, detail="", url=""
    )


def report(**health: Any) -> StackReport:
    kinds: dict[str, Kind] = {"broker": "broker", "object store": "store"}
    components = tuple(
        component(name.replace("_", " "), kinds.get(name.replace("_", " "), "service"), healthy)
        for name, healthy in health.items()
    )
    return StackReport(state=None, components=components)  # type: ignore[arg-type]


def test_a_stack_serves_clients_while_a_worker_service_restarts() -> None:
    restarting = report(broker=True, object_store=True, gateway=True, preprocessor=False)
    assert restarting.serves_clients and not restarting.healthy
    assert report(broker=True, object_store=True, gateway=True, trainer=True).serves_clients


def test_a_stack_without_its_gateway_broker_or_store_serves_no_client() -> None:
    assert not report(broker=True, object_store=True, gateway=False).serves_clients
    assert not report(broker=False, object_store=True, gateway=True).serves_clients
    assert not report(broker=True, object_store=False, gateway=True).serves_clients
    assert not report(broker=True, object_store=True, trainer=True).serves_clients
