"""The services that never compute on a tensor start without torch (its import costs ~2.5
CPU-seconds a process, paid by every start of a stack): their entry modules must not import it.
Such a process still decodes a tensor-carrying message when it meets one (the checkpointer
reads the trainers' Contributions on a job's control topic); torch is imported then."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from conveyor.embedded.registry import SERVICES
from conveyor.platform.codec import encode
from conveyor.platform.messages import Batch

TORCH_FREE_SERVICES = ("gateway", "sharder", "checkpointer", "autoscaler", "watchdog")
"""Services whose entry modules load without torch. The sharder imports it when it plans its
first job (it builds the model on the meta device), the checkpointer when it decodes its first
tensor or reads a slice file back; the others never do."""

# Imports each module in turn and names the first that brings torch in; then decodes the Batch
# on stdin. -W error: the codec's tensor module, imported by that decode, raises no warning.
_PROBE = """
import importlib, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
    if "torch" in sys.modules:
        sys.exit(f"torch imported by {module}")
from conveyor.platform.codec import decode
batch = decode(sys.stdin.buffer.read())
fields = [type(batch).__name__, "torch" in sys.modules, batch.x.dtype, batch.x.tolist()]
print(*fields, batch.y.tolist(), end="")
"""


def _entry_modules() -> list[str]:
    modules = [SERVICES[name].entry.partition(":")[0] for name in TORCH_FREE_SERVICES]
    # The autoscaler's entry (the embedded supervisor) imports the service when it runs.
    return [*modules, "conveyor.services.autoscaler.main"]


def test_torch_free_services_import_no_torch_and_decode_tensors_on_demand() -> None:
    batch = Batch(
        job_id="j",
        batch_id="b",
        shard_id="s",
        epoch=0,
        split="train",
        sample_ids=[3, 4],
        x=torch.arange(8, dtype=torch.uint8).reshape(2, 1, 2, 2),  # [B, C, H, W]
        y=torch.tensor([1, 0]),
        timestamps={},
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", _PROBE, *_entry_modules()],
        input=encode(batch),
        cwd=Path(__file__).parents[2],
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split(maxsplit=3) == [
        "Batch",
        "True",  # torch came with the first tensor
        "torch.uint8",
        "[[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]]] [1, 0]",
    ]
