"""Local mode (DiLoCo-style) on the GPT example, simulated in process: which H and outer
optimizer fit a small language model.

The job is ``examples/gpt.yaml`` (a 2-layer GPT over the bytes of the Python standard
library's sources, written by ``examples/make_stdlib_tokens.py``; inner AdamW lr 3e-3, global
batch 32 of 2 x 16 sequences of 64 tokens). Two simulated trainers train it in sync mode and in
local mode at several H and outer optimizers, as ``loadtests.local_outer`` does for the digits
demo (same simulation, no broker). Reported: the eval loss in nats per token (lower is
better) after --epochs, beside the corpus's unigram entropy (what a model that ignores the
context reaches).

    .venv/bin/python -m loadtests.local_outer_gpt --seeds 2

Prints one line per setting (eval loss per seed), then a JSON object of the means.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.nn import functional as F

from conveyor.training.datasets import open_tokens
from conveyor.training.jobspec import JobSpec
from conveyor.training.plan import split_ids
from conveyor.training.slicing import build_job_model
from loadtests.local_outer import TRAINERS, global_batches, train_simulated

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

DILOCO = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
DEFAULT_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.5, "nesterov": True}
AVERAGING = {"name": "sgd", "lr": 1.0}
DILOCO_INNER = {"name": "adamw", "lr": 4e-4, "weight_decay": 0.01}
SETTINGS: dict[str, tuple[int, dict[str, Any] | None, dict[str, Any] | None]] = {
    # name: (H, inner optimizer (None: the example's), outer optimizer (None: sync))
    "sync": (1, None, None),
    "H8 outer sgd lr 1 (averaging)": (8, None, AVERAGING),
    "H8 outer nesterov lr 0.7 m 0.5 (the default)": (8, None, DEFAULT_OUTER),
    "H8 outer nesterov lr 0.7 m 0.9 (DiLoCo)": (8, None, DILOCO),
    "H32 outer sgd lr 1 (averaging)": (32, None, AVERAGING),
    "H32 outer nesterov lr 0.7 m 0.5 (the default)": (32, None, DEFAULT_OUTER),
    "H32 outer nesterov lr 0.7 m 0.9 (DiLoCo)": (32, None, DILOCO),
    "H8 inner adamw 4e-4, outer DiLoCo (DiLoCo's pair)": (8, DILOCO_INNER, DILOCO),
    "H32 inner adamw 4e-4, outer DiLoCo (DiLoCo's pair)": (32, DILOCO_INNER, DILOCO),
}


def write_corpus(folder: Path) -> Path:
    """The example's token file, written by the example's own script into ``folder``."""
    out = folder / "bytes.bin"
    script = EXAMPLES / "make_stdlib_tokens.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    return out


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats per token of the tokens' own frequencies."""
    counts = np.bincount(tokens.ravel())
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def eval_loss(setting: str, corpus: Path, *, seed: int, epochs: int) -> float:
    """Mean next-token cross-entropy (nats) on the eval sequences after ``setting``."""
    window, inner_spec, outer_spec = SETTINGS[setting]
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / "gpt.yaml").read_text())
    uri = data["dataset"]["uri"].replace("data/stdlib/bytes.bin", str(corpus))
    data["dataset"]["uri"] = uri
    data["training"].update(seed=seed, epochs=epochs)
    if inner_spec is not None:
        data["training"]["optimizer"] = inner_spec
    spec = JobSpec.from_dict(data)
    dataset = open_tokens(uri)
    train_ids, eval_ids = split_ids(dataset.num_samples, spec.dataset.eval_fraction, seed)
    sequences = torch.from_numpy(dataset.read(np.arange(dataset.num_samples)))  # [S, T+1]

    def build() -> nn.Module:
        return build_job_model(
            spec, num_classes=dataset.num_classes, sample_shape=dataset.sample_shape
        )

    def loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        tokens = sequences[rows]  # [B, T+1]
        logits = model(tokens[:, :-1])  # [B, T, vocab]
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    batches = global_batches(train_ids, seed, epochs, spec.training.micro_batch_size * TRAINERS)
    model = train_simulated(spec, build, loss, batches, window=window, outer_spec=outer_spec)
    with torch.no_grad():
        return float(loss(model, torch.as_tensor(np.asarray(eval_ids))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    means: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="local-outer-gpt-") as tmp:
        corpus = write_corpus(Path(tmp))
        entropy = unigram_entropy(np.fromfile(corpus, dtype=np.uint16))
        print(f"{'unigram entropy of the corpus':55} {entropy:.3f}", flush=True)
        for setting in SETTINGS:
            found = [eval_loss(setting, corpus, seed=s, epochs=args.epochs)
                     for s in range(args.seeds)]  # fmt: skip
            means[setting] = statistics.fmean(found)
            print(f"{setting:55} " + " ".join(f"{v:.3f}" for v in found), flush=True)
    print(json.dumps({"unigram_entropy": round(entropy, 4),
                      **{k: round(v, 4) for k, v in means.items()},
                      "sync_perplexity": round(math.exp(means["sync"]), 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
