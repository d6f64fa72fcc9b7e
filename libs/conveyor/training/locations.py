"""Whether the places a job spec names lie inside the operator's roots.

A spec names two places: ``checkpoint.uri``, where the aggregators write the job's checkpoints
and exported model (None: the stack's object store), and the storage behind ``dataset.uri``
(``npz://``, ``mnist-idx://``; ``builtin://`` and ``synthetic://`` data read none). The roots
are :class:`~conveyor.platform.config.StorageSettings`' (the object store always among them);
what "inside" means is :mod:`conveyor.platform.roots`.

The gateway refuses a spec naming a place outside them (422, :func:`refused_locations`). The
services that act on a job check again with the same functions before they read or write (the
sharder when it plans the job, the preprocessors before they open a dataset, the aggregators
before they open the job's store), so a job put on the jobs topic directly fails with the reason
instead of reading or writing there.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.platform.config import StorageSettings
from conveyor.platform.roots import LocationRefused
from conveyor.training.datasets.location import dataset_location
from conveyor.training.jobspec import JobSpec

__all__ = [
    "LocationRefused",
    "Refusal",
    "check_dataset_uri",
    "output_uri",
    "refused_locations",
]


@dataclass(frozen=True, slots=True)
class Refusal:
    """One place of a spec that the roots do not allow."""

    field: str
    """Dotted path of the spec field: ``checkpoint.uri`` or ``dataset.uri``."""
    reason: str
    """Why, naming the allowed roots."""

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def refused_locations(spec: JobSpec, storage: StorageSettings) -> list[Refusal]:
    """Every place ``spec`` names outside the roots of ``storage``, in field order; empty when
    all are allowed. Reads the file system to resolve links; writes nothing."""
    refusals = []
    if spec.checkpoint.uri is not None:
        try:
            storage.allowed_output_roots().check(spec.checkpoint.uri)
        except LocationRefused as exc:
            refusals.append(Refusal(field="checkpoint.uri", reason=str(exc)))
    try:
        _check_dataset(spec.dataset.uri, storage)
    except LocationRefused as exc:
        refusals.append(Refusal(field="dataset.uri", reason=str(exc)))
    return refusals


def output_uri(spec: JobSpec, storage: StorageSettings) -> str:
    """The store URI the job's checkpoints and exported model go to: the object store when
    ``checkpoint.uri`` is None, else ``checkpoint.uri`` normalised (open this one, not the
    spec's string, so that the writes land where the check looked). LocationRefused (a
    ValueError, its message starting with the field) when it lies outside the output roots."""
    uri = spec.checkpoint.uri
    if uri is None:
        return storage.uri
    try:
        return str(storage.allowed_output_roots().check(uri))
    except LocationRefused as exc:
        raise LocationRefused(f"checkpoint.uri: {exc}") from exc


def check_dataset_uri(uri: str, storage: StorageSettings) -> None:
    """LocationRefused (a ValueError, its message starting with the field) when the dataset at
    ``uri`` would be read from outside the dataset roots, or its URI names no place a check can
    vouch for."""
    try:
        _check_dataset(uri, storage)
    except LocationRefused as exc:
        raise LocationRefused(f"dataset.uri: {exc}") from exc


def _check_dataset(uri: str, storage: StorageSettings) -> None:
    try:
        location = dataset_location(uri)
    except ValueError as exc:
        raise LocationRefused(f"not a usable dataset location: {exc}") from exc
    if location is not None:
        storage.allowed_dataset_roots().check(location)
