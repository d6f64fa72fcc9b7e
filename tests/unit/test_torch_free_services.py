"""The services that never compute on a tensor start without torch (its import costs ~2.5
CPU-seconds a process, paid by every start of a stack): their entry modules must not import it.
Such a process still decodes a tensor-carrying message when it meets one (the checkpointer
reads the trainers' Contributions on a job's control topic); torch is imported then. The
preprocessors send tensors without ever loading it: their batches are numpy arrays, which the
codec sends as tensors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from conveyor.embedded.registry import SERVICES
from conveyor.platform.codec import decode, encode
from conveyor.platform.messages import Batch, ShardTask
from conveyor.services.preprocessor.work import augmenter_for, process_shard
from conveyor.training.datasets import open_dataset

TORCH_FREE_SERVICES = (
    "gateway", "sharder", "checkpointer", "autoscaler", "watchdog", "preprocessor",
)  # fmt: skip
"""Services whose entry modules load without torch. The sharder imports it in a thread once it
runs (it builds each job's model on the meta device), the checkpointer when it decodes its first
tensor or reads a slice file back; the others never do (the preprocessors: see
:func:`test_a_preprocessor_process_sends_batches_without_loading_torch`)."""

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


def test_a_preprocessor_process_sends_batches_without_loading_torch() -> None:
    """What a preprocessor process runs (its entry point's imports, a shard task decoded, its
    batches made and encoded) leaves torch unloaded; the bytes decode to torch tensors."""
    script = textwrap.dedent("""
        import sys
        import conveyor.services.preprocessor.main
        from conveyor.platform.codec import decode, encode
        from conveyor.services.preprocessor.work import augmenter_for, process_shard
        from conveyor.training.datasets import open_dataset
        task = decode(bytes.fromhex(sys.stdin.readline()))
        batches = process_shard(open_dataset(task.dataset_uri), task,
                                augmenter_for(task.preprocess)).batches
        print(encode(batches[0]).hex())
        print("torch" in sys.modules)
    """)  # fmt: skip
    task = ShardTask(
        job_id="j", shard_id="j:e0:train:00000", epoch=0, index=0, split="train",
        dataset_uri="synthetic://?n=64&shape=3x16x16&classes=4&seed=1", sample_ids=list(range(8)),
        micro_batch_size=4, seed=11, preprocess={"augment": [{"name": "hflip"}]},
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", script], input=encode(task).hex() + "\n",
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    sent, torch_loaded = done.stdout.split()
    assert torch_loaded == "False", done.stderr
    batch = decode(bytes.fromhex(sent))
    assert isinstance(batch, Batch) and isinstance(batch.x, torch.Tensor)
    here = process_shard(open_dataset(task.dataset_uri), task, augmenter_for(task.preprocess))
    assert np.array_equal(batch.x.numpy(), here.batches[0].x)


# Imports the modules given after "--" and prints which of the modules before it got loaded.
_HEAVY_PROBE = """
import importlib, sys
split = sys.argv.index("--")
for module in sys.argv[split + 1:]:
    importlib.import_module(module)
print(*sorted(m for m in sys.argv[1:split] if m in sys.modules))
"""


def test_the_datasets_package_loads_no_decoder_and_no_process_the_otlp_exporter_unasked() -> None:
    # Listing image files (the sharder's plan, the aggregator's and checkpointer's dataset
    # locations) needs no decoder, and a process without an OTLP endpoint exports nothing: each
    # was ~0.1-0.3 s of CPU at every process start. Only the preprocessor decodes.
    heavy = ["PIL.Image", "opentelemetry.exporter.otlp.proto.http.trace_exporter"]
    modules = [*_entry_modules(), "conveyor.training.datasets", "conveyor.training.locations"]
    modules.remove(SERVICES["preprocessor"].entry.partition(":")[0])
    result = subprocess.run(
        [sys.executable, "-c", _HEAVY_PROBE, *heavy, "--", *modules],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == []
