"""Trainer-state checkpoints in the object store: what a restarted trainer resumes from.

Layout under ``jobs/<job_id>/trainer/``:

- ``state-<step>.safetensors``: tensors: ``model.<name>`` (parameters and buffers),
  ``optim.<param index>.<name>`` (optimizer state), ``snapshot.<epoch>.<name>`` (parameters an
  open eval is measured on) and ``ledger.<epoch>`` (sample counts);
- ``state-<step>.json``: everything else (step, schedule, counters, optimizer param groups),
  with the sha256 of the tensors file;
- ``latest``: ``{"step", "meta_key", "meta_sha256"}``, written last: the commit point.

A save writes the tensors, then the JSON, then ``latest``, then deletes all but the newest
``keep_last`` states. A load follows ``latest`` and verifies both checksums; a torn or corrupt
state falls back to the next older one. Saves are synchronous (run them in a thread).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from conveyor.libs.storage import ChecksumMismatch, ObjectNotFound, ObjectStore
from conveyor.services.trainer.ledger import Ledger

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
_STATE_RE = re.compile(r"state-(\d+)\.json$")


@dataclass(kw_only=True, slots=True)
class TrainerCheckpoint:
    """One trainer state: tensors (CPU copies) and JSON-safe metadata."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def pack_model(model: nn.Module, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """CPU copies of the model's parameters and buffers under ``<prefix><name>``."""
    return {f"{prefix}{name}": _cpu_copy(value) for name, value in model.state_dict().items()}


def unpack_model(
    model: nn.Module, tensors: dict[str, torch.Tensor], prefix: str = "model."
) -> None:
    """Load ``<prefix>*`` tensors into ``model`` (strict: every key must match)."""
    state = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    model.load_state_dict(state, strict=True)


def pack_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(``optim.<index>.<name>`` tensors, JSON part) of the optimizer's state_dict."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for index, per_param in state_dict["state"].items():
        for name, value in per_param.items():
            key = f"{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{key}"] = _cpu_copy(value)
            else:
                values[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "values": values}


def unpack_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Load the state written by :func:`pack_optimizer` into ``optimizer``."""
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        if key.startswith("optim."):
            index, name = key.removeprefix("optim.").split(".", 1)
            state.setdefault(int(index), {})[name] = tensor
    for key, value in meta["values"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [dict(group) for group in meta["param_groups"]]
    for group in groups:
        if "betas" in group:  # JSON turned the tuple into a list
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def capture_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    snapshots: Mapping[int, nn.Module],
    ledger: Ledger,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """CPU copies of a trainer's tensor state, and the optimizer's JSON part (blocking)."""
    tensors = pack_model(model)
    optimizer_tensors, optimizer_meta = pack_optimizer(optimizer)
    tensors.update(optimizer_tensors)
    for epoch, snapshot in snapshots.items():
        tensors.update(pack_model(snapshot, prefix=f"snapshot.{epoch}."))
    tensors.update(ledger.to_tensors())
    return tensors, optimizer_meta


def restore_tensors(
    checkpoint: TrainerCheckpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    snapshot_epochs: Iterable[int],
    make_snapshot: Callable[[], nn.Module],
) -> dict[int, nn.Module]:
    """Load model and optimizer from ``checkpoint`` and rebuild the eval snapshots of
    ``snapshot_epochs`` (blocking). KeyError/ValueError/RuntimeError when it does not fit."""
    tensors = checkpoint.tensors
    unpack_model(model, tensors)
    unpack_optimizer(optimizer, tensors, checkpoint.meta["optimizer"])
    snapshots = {}
    for epoch in snapshot_epochs:
        snapshots[epoch] = make_snapshot()
        unpack_model(snapshots[epoch], tensors, prefix=f"snapshot.{epoch}.")
    return snapshots


class StateStore:
    """Saves and loads one job's trainer states in ``store``."""

    def __init__(self, store: ObjectStore, job_id: str, *, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.store = store
        self.prefix = f"jobs/{job_id}/trainer/"
        self.keep_last = keep_last

    @property
    def latest_key(self) -> str:
        return f"{self.prefix}latest"

    def _key(self, step: int, suffix: str) -> str:
        return f"{self.prefix}state-{step:010d}.{suffix}"

    def save(self, checkpoint: TrainerCheckpoint) -> str:
        """Write ``checkpoint`` durably and make it the latest; returns its JSON key.

        Raises StorageError (StorageUnavailable when retriable); a failed save leaves the
        previous latest state in place.
        """
        tensors_key = self._key(checkpoint.step, "safetensors")
        tensors_info = self.store.put_bytes(tensors_key, save_tensors(checkpoint.tensors))
        meta = {
            **checkpoint.meta,
            "format": STATE_FORMAT,
            "step": checkpoint.step,
            "tensors": {"key": tensors_key, "sha256": tensors_info.sha256},
        }
        meta_key = self._key(checkpoint.step, "json")
        meta_info = self.store.put_bytes(meta_key, json.dumps(meta).encode())
        pointer = {"step": checkpoint.step, "meta_key": meta_key, "meta_sha256": meta_info.sha256}
        self.store.put_bytes(self.latest_key, json.dumps(pointer).encode())
        self._retain(keep=meta_key)
        return meta_key

    def load_latest(self) -> TrainerCheckpoint | None:
        """The newest intact state, or None when the job has none."""
        candidates: list[tuple[str, str | None]] = []
        try:
            pointer = json.loads(self.store.get_bytes(self.latest_key))
            candidates.append((pointer["meta_key"], pointer["meta_sha256"]))
        except ObjectNotFound:
            pass
        except (ChecksumMismatch, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s is unreadable (%s); looking for older states", self.latest_key, exc)
        candidates += [(key, None) for key in reversed(self._state_keys())]
        for meta_key, meta_sha256 in candidates:
            try:
                return self._load(meta_key, meta_sha256)
            except ObjectNotFound:
                continue
            except (ChecksumMismatch, ValueError, KeyError, TypeError) as exc:
                logger.warning(
                    "trainer state %s is torn or corrupt (%s); trying older", meta_key, exc
                )
        return None

    def _load(self, meta_key: str, meta_sha256: str | None) -> TrainerCheckpoint:
        meta = json.loads(self.store.get_bytes(meta_key, expected_sha256=meta_sha256))
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown trainer state format {meta.get('format')!r}")
        ref = meta["tensors"]
        tensors = load_tensors(self.store.get_bytes(ref["key"], expected_sha256=ref["sha256"]))
        return TrainerCheckpoint(step=int(meta["step"]), tensors=tensors, meta=meta)

    def _state_keys(self) -> list[str]:
        """JSON keys of the stored states, oldest first."""
        steps = {
            key: int(match.group(1))
            for key in self.store.list(self.prefix)
            if (match := _STATE_RE.search(key)) is not None
        }
        return sorted(steps, key=steps.__getitem__)

    def _retain(self, keep: str) -> None:
        older = [key for key in self._state_keys() if key != keep]
        for meta_key in older[: max(0, len(older) - (self.keep_last - 1))]:
            self.store.delete(meta_key)  # the JSON first: a state is gone once it is
            self.store.delete(meta_key.removesuffix(".json") + ".safetensors")
