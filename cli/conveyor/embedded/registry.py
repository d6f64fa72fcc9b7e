"""The services a stack runs, in start order, and how to find their entry points.

Adding a service is one line in :data:`SERVICES`: its name and the
``module:function`` of its entry point. ``conveyor up`` starts every
registered service as ``python -m conveyor service NAME``; containers run the
same command, so both deployments share one code path.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from conveyor.platform.errors import ConveyorError

ServiceMain = Callable[[list[str]], int | None]
"""A service entry point: takes the extra command-line arguments, runs in the foreground until
the process is asked to stop (SIGTERM/SIGINT), returns the exit status (None means 0)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ServiceSpec:
    """How to run one service."""

    entry: str
    """``package.module:function`` of the service's :data:`ServiceMain`; imported only when the
    service runs, so the command line stays fast and light."""
    serves_api: bool = False
    """The service's HTTP port also serves the user-facing API (the gateway): ``conveyor up``
    prints its URL."""
    embedded_only: bool = False
    """Runs in the embedded stack only (docker compose and Kubernetes have no such service)."""

    def __post_init__(self) -> None:
        module, sep, function = self.entry.partition(":")
        if not (module and sep and function.isidentifier()):
            raise ValueError(f"service entry must be 'pkg.module:function', not {self.entry!r}")


MAX_REPLICAS = 32
"""Most processes ``conveyor up --scale`` starts for one service (one machine's worth)."""

SERVICES: dict[str, ServiceSpec] = {
    "gateway": ServiceSpec(entry="conveyor.services.gateway.main:main", serves_api=True),
    "sharder": ServiceSpec(entry="conveyor.services.sharder.main:main"),
    "preprocessor": ServiceSpec(entry="conveyor.services.preprocessor.main:main"),
    "trainer": ServiceSpec(entry="conveyor.services.trainer.main:main"),
    "aggregator": ServiceSpec(entry="conveyor.services.aggregator.main:main"),
    "checkpointer": ServiceSpec(entry="conveyor.services.checkpointer.main:main"),
    # Last: `conveyor down` stops services in reverse order, so the supervisor goes first and
    # restarts nothing that is being stopped. Its entry lives with the embedded stack because
    # the local driver works on stack.json (conveyor.embedded.supervisor).
    "autoscaler": ServiceSpec(entry="conveyor.embedded.supervisor:main"),
    # Restarts the autoscaler, which restarts everything else (it included); stopped first.
    "watchdog": ServiceSpec(entry="conveyor.embedded.watchdog:main", embedded_only=True),
}
"""Registered services by name, in the order ``conveyor up`` starts them."""


def deployed_services() -> list[str]:
    """The services that docker compose and Kubernetes run too (not embedded only)."""
    return [name for name, spec in SERVICES.items() if not spec.embedded_only]


class UnknownServiceError(ConveyorError):
    """No service of that name is registered."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        listing = ", ".join(known) if known else "none are registered yet"
        super().__init__(f"unknown service {name!r}; known services: {listing}")
        self.name = name
        self.known = tuple(known)


def resolve(name: str, services: Mapping[str, ServiceSpec] | None = None) -> ServiceSpec:
    """The spec registered under ``name``; raises :class:`UnknownServiceError` listing the
    known names otherwise."""
    registered = SERVICES if services is None else services
    try:
        return registered[name]
    except KeyError:
        raise UnknownServiceError(name, list(registered)) from None


def load_entry(spec: ServiceSpec) -> ServiceMain:
    """Import the entry point of ``spec``. Import errors propagate: a registered service that
    cannot be imported is a bug to be seen with its traceback, not an expected condition."""
    module_name, _, function_name = spec.entry.partition(":")
    module = importlib.import_module(module_name)
    entry = getattr(module, function_name, None)
    if not callable(entry):
        raise TypeError(f"{spec.entry!r} does not name a callable")
    return cast(ServiceMain, entry)


def parse_scale(
    items: Iterable[str], services: Mapping[str, ServiceSpec] | None = None
) -> dict[str, int]:
    """``["preprocessor=2", ...]`` (``conveyor up --scale``) -> ``{"preprocessor": 2}``.

    ``N`` may be 0 (the service is left out) up to :data:`MAX_REPLICAS`; a later item for the
    same service wins. Raises :class:`UnknownServiceError` for a name that is not registered
    and ValueError for anything else that is not ``NAME=N``.
    """
    registered = SERVICES if services is None else services
    scale: dict[str, int] = {}
    for item in items:
        name, sep, count = item.partition("=")
        name, count = name.strip(), count.strip()
        if not (sep and name and count.isdigit()):
            raise ValueError(f"--scale expects NAME=N with N a whole number, got {item!r}")
        resolve(name, registered)
        replicas = int(count)
        if replicas > MAX_REPLICAS:
            raise ValueError(f"--scale {name}={replicas}: at most {MAX_REPLICAS} replicas")
        scale[name] = replicas
    return scale


def instance_names(name: str, replicas: int) -> list[str]:
    """Process names of ``replicas`` copies of service ``name``: the bare name for one copy
    (what a stack without ``--scale`` records), ``name-1`` .. ``name-N`` for several (each
    gets its own port and log file ``logs/<instance>.log``)."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    if replicas == 1:
        return [name]
    return [f"{name}-{index}" for index in range(1, replicas + 1)]


_REPLICA_SUFFIX = re.compile(r"^(?P<service>.+)-(?P<index>[1-9][0-9]*)$")


def service_of(instance: str, services: Mapping[str, ServiceSpec] | None = None) -> str:
    """The service an instance name of :func:`instance_names` runs (``preprocessor-2`` ->
    ``preprocessor``); the name itself when it is not a replica name of a registered service."""
    registered = SERVICES if services is None else services
    if instance in registered:
        return instance
    match = _REPLICA_SUFFIX.match(instance)
    if match is not None and match["service"] in registered:
        return match["service"]
    return instance


def replica_counts(
    instances: Iterable[str], services: Mapping[str, ServiceSpec] | None = None
) -> dict[str, int]:
    """How many processes of each service the instance names stand for."""
    counts: dict[str, int] = {}
    for instance in instances:
        service = service_of(instance, services)
        counts[service] = counts.get(service, 0) + 1
    return counts
