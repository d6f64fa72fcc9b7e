"""A tiny model plug-in package written to disk for the tests: a ``conveyor.models`` entry point
that importlib.metadata finds once the directory is on ``sys.path`` (or ``PYTHONPATH``)."""

from __future__ import annotations

from pathlib import Path

PLUGIN_MODEL = "tiny_plug_mlp"

_MODULE = """
from torch import nn


def build(*, in_channels, num_classes, image_size, hidden=32):
    height, width = image_size
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * height * width, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def not_a_module(*, in_channels, num_classes, image_size):
    return "not a model"
"""


def write_plugin(root: Path) -> Path:
    """Install (as files) the distribution ``conveyor-tiny-plug`` under ``root``; returns
    ``root``. Entry points: ``tiny_plug_mlp`` (a real builder), ``tiny_plug_broken`` (a module
    that does not exist) and ``tiny_plug_bad`` (returns no Module)."""
    package = root / "conveyor_tiny_plug"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_MODULE)
    info = root / "conveyor_tiny_plug-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: conveyor-tiny-plug\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[conveyor.models]\n"
        f"{PLUGIN_MODEL} = conveyor_tiny_plug:build\n"
        "tiny_plug_broken = conveyor_tiny_plug_missing:build\n"
        "tiny_plug_bad = conveyor_tiny_plug:not_a_module\n"
    )
    return root
