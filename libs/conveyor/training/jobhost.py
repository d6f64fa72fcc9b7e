"""What the services that work on jobs (trainer, aggregator) share about a job's lifetime."""

from __future__ import annotations

from typing import ClassVar

from conveyor.platform.errors import ConveyorError


class JobFailure(ConveyorError):
    """The job cannot go on (invalid spec or plan, a model that cannot be built, a corrupt
    gradient, ...); ``str(exc)`` is the reason published with :class:`JobFailed`."""

    retriable: ClassVar[bool] = False
