"""The services a stack runs, in start order, and how to find their entry points.

Adding a service is one line in :data:`SERVICES`: its name and the
``module:function`` of its entry point. ``conveyor up`` starts every
registered service as ``python -m conveyor service NAME``; containers run the
same command, so both deployments share one code path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from conveyor.libs.errors import ConveyorError

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

    def __post_init__(self) -> None:
        module, sep, function = self.entry.partition(":")
        if not (module and sep and function.isidentifier()):
            raise ValueError(f"service entry must be 'pkg.module:function', not {self.entry!r}")


SERVICES: dict[str, ServiceSpec] = {
    "gateway": ServiceSpec(entry="conveyor.services.gateway.main:main", serves_api=True),
}
"""Registered services by name, in the order ``conveyor up`` starts them."""


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
