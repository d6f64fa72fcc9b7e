"""What a finished job leaves behind: the exported model, its ledger and its summary.

- ``jobs/<job_id>/model.safetensors``: the model's state_dict; ``config.json`` beside it says
  how to rebuild and feed it (model name and options, num_classes, sample_shape, normalize),
  so the pair is self-describing: ``build_model(**config)`` + ``load_state_dict``.
- ``jobs/<job_id>/ledger.json``: per epoch, sample id -> times trained.

Synchronous (object-store I/O): call from a thread.
"""

from __future__ import annotations

import json
from typing import Any

from safetensors.torch import save as save_tensors
from torch import nn

from conveyor.libs.jobspec import JobSpec
from conveyor.libs.storage import ObjectStore
from conveyor.services.trainer.ledger import Ledger
from conveyor.services.trainer.state import pack_model


def export_model(
    store: ObjectStore,
    job_id: str,
    model: nn.Module,
    *,
    spec: JobSpec,
    num_classes: int,
    sample_shape: tuple[int, int, int],
    step: int,
) -> str:
    """Write ``model.safetensors`` then ``config.json``; returns the model's URI."""
    prefix = f"jobs/{job_id}/"
    tensors = pack_model(model, prefix="")
    normalize = spec.preprocess.normalize
    config: dict[str, Any] = {
        "format": 1,
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
    store.put_bytes(f"{prefix}config.json", json.dumps(config, indent=2).encode())
    return store.uri_for(info.key)


def write_ledger(store: ObjectStore, job_id: str, ledger: Ledger) -> str:
    """Write ``ledger.json``; returns its URI."""
    info = store.put_bytes(f"jobs/{job_id}/ledger.json", json.dumps(ledger.to_json()).encode())
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
) -> dict[str, Any]:
    """The ``completed`` event's summary (DESIGN section 7 fields)."""
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
    }
