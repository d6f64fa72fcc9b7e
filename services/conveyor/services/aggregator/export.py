"""What a finished job leaves behind: the exported model, its sample ledger and its summary.

- ``jobs/<job_id>/model.safetensors``: the model's state_dict; ``config.json`` beside it says
  how to rebuild and feed it (model name and options, num_classes, sample_shape, normalize),
  so the pair is self-describing: ``build_model(**config)`` + ``load_state_dict``;
  ``losses.json`` beside them holds the mean training loss of every optimizer step, in step
  order, as the trainers computed it (``{"format": 1, "job_id", "step_losses": [...]}``; a
  resumed job's history is whole: the checkpoint carries the steps before it).
- ``jobs/<job_id>/ledger.json``: the coordinator's :class:`~conveyor.training.ledger.Ledger`,
  how many times each sample went into an applied model update per epoch, counted from the
  sample ids the trainers computed on (never from the plan). After a job every train sample's
  count is 1 in every epoch trained and no other sample has one: the exactly-once proof.

Writes are synchronous (object-store I/O): call them from a thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from conveyor.platform.storage import ObjectStore
from conveyor.training.jobspec import JobSpec
from conveyor.training.ledger import Ledger

EXPORT_FORMAT = 1
"""Version of the config.json layout."""


def job_prefix(job_id: str) -> str:
    """Key prefix of a job's exports in the object store."""
    return f"jobs/{job_id}/"


def export_model(
    store: ObjectStore,
    job_id: str,
    model: nn.Module,
    *,
    spec: JobSpec,
    num_classes: int,
    sample_shape: Sequence[int],
    step: int,
    step_losses: Sequence[float],
) -> str:
    """Write ``model.safetensors``, ``losses.json`` (``step_losses``: one per step), then
    ``config.json`` (which names both files' sha256, so it is the commit); returns the model's
    URI. Raises the store's StorageError."""
    prefix = job_prefix(job_id)
    tensors = {
        name: value.detach().to("cpu").contiguous().clone()
        for name, value in model.state_dict().items()
    }
    normalize = spec.preprocess.normalize
    config: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "job_id": job_id,
        "model": {"name": spec.model.name, "options": spec.model.options},
        "num_classes": num_classes,
        "sample_shape": list(sample_shape),
        "input": "uint8 [N, C, H, W]; x / 255, then (x - mean) / std per channel",
        "normalize": normalize.model_dump() if normalize is not None else None,
        "precision": spec.training.precision,
        "step": step,
    }
    metadata = {"job_id": job_id, "model": spec.model.name, "step": str(step)}
    info = store.put_bytes(f"{prefix}model.safetensors", save_tensors(tensors, metadata=metadata))
    config["weights_sha256"] = info.sha256
    # JSON numbers print a float's shortest repr, which reads back to the same bits.
    losses = {"format": 1, "job_id": job_id, "step_losses": list(step_losses)}
    config["losses_sha256"] = store.put_bytes(
        f"{prefix}losses.json", json.dumps(losses).encode()
    ).sha256
    store.put_bytes(f"{prefix}config.json", json.dumps(config, indent=2).encode())
    return store.uri_for(info.key)


def load_exported_state(store: ObjectStore, job_id: str) -> dict[str, torch.Tensor]:
    """The state_dict written by :func:`export_model` (checksum verified against config.json)."""
    prefix = job_prefix(job_id)
    config = json.loads(store.get_bytes(f"{prefix}config.json"))
    data = store.get_bytes(f"{prefix}model.safetensors", expected_sha256=config["weights_sha256"])
    return load_tensors(data)


def write_ledger(store: ObjectStore, job_id: str, ledger: Ledger) -> str:
    """Write ``ledger.json``; returns its URI."""
    key = f"{job_prefix(job_id)}ledger.json"
    info = store.put_bytes(key, json.dumps(ledger.to_json()).encode())
    return store.uri_for(info.key)


def build_summary(
    *,
    job_id: str,
    epochs: int,
    steps: int,
    samples: int,
    eval_accuracy: float | None,
    eval_loss: float | None,
    samples_per_second: float,
    data_wait_ratio: float | None,
    checkpoint: str,
    **extra: Any,
) -> dict[str, Any]:
    """The ``completed`` event's summary: the DESIGN section 7 fields, then ``extra`` (the
    gradient plane's figures: grad_bytes_total, grad_bytes_per_step, max_staleness, ...)."""
    return {
        "job_id": job_id,
        "state": "completed",
        "epochs": epochs,
        "steps": steps,
        "samples": samples,
        "eval_accuracy": eval_accuracy,
        "eval_loss": eval_loss,
        "samples_per_second": samples_per_second,
        "data_wait_ratio": data_wait_ratio,
        "checkpoint": checkpoint,
        **extra,
    }
