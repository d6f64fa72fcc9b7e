"""Loading the model a job exported, outside Conveyor: ``conveyor model pull JOB DIR`` writes
``model.safetensors`` (the state_dict), ``config.json`` (how to rebuild and feed it) and
``losses.json`` (the training loss of every optimizer step, as computed), and::

    from conveyor.training.exported import load_model
    model = load_model("DIR")  # inputs: uint8 [N, C, H, W] / 255, then config's normalize

Only safetensors and JSON are read; the weights are checked against the sha256 that
``config.json`` records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

MODEL_FILES = ("model.safetensors", "config.json", "losses.json")
"""The files of an exported model, weights first (``config.json`` names their sha256 and the
losses': it is the commit)."""


def load_model(directory: str | Path) -> nn.Module:
    """The exported model with its trained weights, in eval mode, on the CPU. ValueError when
    the files do not match (checksum, shapes) or name a model this installation lacks;
    OSError when they cannot be read."""
    # Here, not at the top: the gateway imports this module for MODEL_FILES alone and never
    # loads torch.
    from safetensors.torch import load as load_tensors

    from conveyor.training.models import build_model

    root = Path(directory)
    config: dict[str, Any] = json.loads((root / MODEL_FILES[1]).read_text())
    weights = (root / MODEL_FILES[0]).read_bytes()
    if hashlib.sha256(weights).hexdigest() != config.get("weights_sha256"):
        raise ValueError(f"{root / MODEL_FILES[0]} does not match the sha256 in config.json")
    channels, height, width = (int(v) for v in config["sample_shape"])
    options = {
        k: v
        for k, v in config["model"]["options"].items()
        if k not in ("num_classes", "in_channels")
    }
    model = build_model(
        config["model"]["name"],
        in_channels=channels,
        num_classes=int(config["num_classes"]),
        image_size=(height, width),
        **options,
    )
    try:
        model.load_state_dict(load_tensors(weights), strict=True)
    except RuntimeError as exc:
        raise ValueError(f"the weights in {root} do not fit the model: {exc}") from exc
    return model.eval()
