"""Errors of the gateway's operations; the routes map each to one HTTP status."""

from __future__ import annotations

from typing import ClassVar

from conveyor.platform.errors import ConveyorError
from conveyor.training.locations import Refusal


class GatewayError(ConveyorError):
    """Base of the gateway's errors."""


class JobNotFound(GatewayError):
    """No job with that id is in the view (404)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


class JobFinished(GatewayError):
    """The job already reached a terminal state (409 on cancel)."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"job {job_id!r} is already {state}")
        self.job_id = job_id
        self.state = state


class IdempotencyConflict(GatewayError):
    """The Idempotency-Key was used before with a different spec (409)."""

    def __init__(self, key: str, job_id: str) -> None:
        super().__init__(
            f"Idempotency-Key {key!r} was already used for job {job_id!r} with a different spec"
        )
        self.key = key
        self.job_id = job_id


class ArtifactNotFound(GatewayError):
    """The job has no such object in its store (404)."""


class JobNotRunning(GatewayError):
    """The operation needs a running job (409), e.g. asking for a checkpoint."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(
            f"job {job_id!r} is {state}: only a planned or running job can be checkpointed"
        )
        self.job_id = job_id
        self.state = state


class JobNotResumable(GatewayError):
    """The job cannot be resumed (409): it is not failed or cancelled, or it has no
    checkpoint to resume from (the message says which and why)."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id!r} cannot be resumed: {reason}")
        self.job_id = job_id


class LocationsRefused(GatewayError):
    """The spec names a place outside the operator's roots (422, one error per field)."""

    def __init__(self, refusals: list[Refusal]) -> None:
        super().__init__("; ".join(str(refusal) for refusal in refusals))
        self.refusals = refusals


class GatewayUnavailable(GatewayError):
    """The view is still catching up or the broker did not answer in time (503)."""

    retriable: ClassVar[bool] = True
