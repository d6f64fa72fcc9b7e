"""The model registry: jobs name a model and its options; a job sends no code.

``build_model(name, in_channels=, num_classes=, image_size=(H, W), **options)``
returns a freshly initialised ``nn.Module`` mapping float images ``[N,C,H,W]``
(already normalised on the device) to logits ``[N,num_classes]``. Initial
weights come from torch's global RNG: seed it (``torch.manual_seed``) first for
reproducible weights.

Models:
- ``small_cnn {channels: list[int] = [32, 64, 128]}``: conv3x3-ReLU-maxpool
  stages (pooling only while the map is >= 2 pixels), global average pool,
  linear head. No batch norm, so its whole state is its parameters; works from
  8x8 (digits) up.
- ``mlp {hidden_sizes: list[int] = [256, 128]}``: flatten, Linear-ReLU layers, linear head.
- ``resnet18 {width: int = 64, norm: "batch" | "group" = "batch"}``: the CIFAR-style
  ResNet-18 (3x3 stride-1 stem, no max-pool, 4 stages of 2 basic blocks), ~11.2M
  parameters at width 64 and 10 classes. ``norm="batch"`` keeps running
  statistics in buffers, which the gradient plane averages across trainers and exports
  with the weights (:mod:`conveyor.training.slicing`); ``"group"`` (GroupNorm, 32 groups
  or fewer) has none.
- ``gpt {n_layer: int = 4, n_head: int = 4, n_embd: int = 128}``: a small GPT for
  ``tokens://`` datasets (:mod:`conveyor.training.gpt`); its "images" are token sequences,
  ``in_channels=1``, ``image_size=(1, block_size)``, ``num_classes=vocab_size``, and it maps
  token ids ``[N, T]`` to logits ``[N, T, vocab_size]``; the one name in
  ``jobspec.LANGUAGE_MODELS``.

Plug-ins: an installed package registers more builders under the ``conveyor.models``
entry-point group (``[project.entry-points."conveyor.models"] my_net = "my_pkg:build"``). A
builder is called like the built-ins, ``build(*, in_channels, num_classes, image_size,
**options)``, and its named keyword parameters are the options a spec may set. The built-in
names win over a plug-in of the same name. Every service that builds the job's model (sharder,
trainers, aggregators) looks it up in its own environment: a model that a process lacks fails
the job with the reason before training starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any, cast

import torch
from torch import nn

from conveyor.training.gpt import build_gpt

ModelBuilder = Callable[..., nn.Module]


def _positive_ints(name: str, value: object, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, list | tuple) or (not value and not allow_empty):
        raise ValueError(f"{name} must be a {'' if allow_empty else 'non-empty '}list of ints")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"{name} must contain positive integers, got {value!r}")
    return list(value)


class SmallCNN(nn.Module):
    """Conv stages then a linear head; see the module docstring."""

    def __init__(
        self,
        *,
        in_channels: int,
        num_classes: int,
        image_size: tuple[int, int],
        channels: Sequence[int],
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        height, width = image_size
        previous = in_channels
        for out in channels:
            layers += [nn.Conv2d(previous, out, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            if min(height, width) >= 2:
                layers.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
            previous = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(previous, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)  # [N,C_last,H',W']
        h = self.pool(h).flatten(1)  # [N,C_last]
        logits: torch.Tensor = self.head(h)  # [N,num_classes]
        return logits


class MLP(nn.Module):
    """Flatten, hidden Linear-ReLU layers, linear head."""

    def __init__(self, *, in_features: int, num_classes: int, hidden_sizes: Sequence[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        previous = in_features
        for size in hidden_sizes:
            layers += [nn.Linear(previous, size), nn.ReLU(inplace=True)]
            previous = size
        layers.append(nn.Linear(previous, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(x)  # [N,C,H,W] -> [N,num_classes]
        return logits


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(32, channels), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (projected when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = _norm(norm, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                _norm(norm, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))  # [N,out,H/s,W/s]
        h = self.norm2(self.conv2(h))  # [N,out,H/s,W/s]
        return torch.relu(h + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: 3x3 stem, stages of width w, 2w, 4w, 8w (strides 1, 2, 2, 2)."""

    def __init__(self, *, in_channels: int, num_classes: int, width: int, norm: str) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            _norm(norm, width),
            nn.ReLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        previous = width
        for stage, stride in enumerate((1, 2, 2, 2)):
            out = width * 2**stage
            blocks += [BasicBlock(previous, out, stride, norm), BasicBlock(out, out, 1, norm)]
            previous = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(previous, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)  # [N,w,H,W]
        h = self.blocks(h)  # [N,8w,H/8,W/8]
        h = self.pool(h).flatten(1)  # [N,8w]
        logits: torch.Tensor = self.head(h)  # [N,num_classes]
        return logits


def _small_cnn(
    *,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    channels: Sequence[int] = (32, 64, 128),
) -> nn.Module:
    return SmallCNN(
        in_channels=in_channels,
        num_classes=num_classes,
        image_size=image_size,
        channels=_positive_ints("channels", channels, allow_empty=False),
    )


def _mlp(
    *,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    hidden_sizes: Sequence[int] = (256, 128),
) -> nn.Module:
    return MLP(
        in_features=in_channels * image_size[0] * image_size[1],
        num_classes=num_classes,
        hidden_sizes=_positive_ints("hidden_sizes", hidden_sizes, allow_empty=True),
    )


def _resnet18(
    *,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    width: int = 64,
    norm: str = "batch",
) -> nn.Module:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 1024:
        raise ValueError(f"width must be an integer in [1, 1024], got {width!r}")
    if norm not in ("batch", "group"):
        raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
    return ResNet18(in_channels=in_channels, num_classes=num_classes, width=width, norm=norm)


_MODELS: dict[str, ModelBuilder] = {
    "small_cnn": _small_cnn,
    "mlp": _mlp,
    "resnet18": _resnet18,
    "gpt": build_gpt,
}
_FIXED = {"in_channels", "num_classes", "image_size"}


ENTRY_POINT_GROUP = "conveyor.models"
"""Entry-point group under which installed packages register model builders."""


def _plugins() -> dict[str, EntryPoint]:
    """Installed plug-in builders by name (read from the installed packages' metadata on each
    call: cheap, and a package installed after start is seen)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in _MODELS}


def list_models() -> list[str]:
    """Names accepted by ``build_model``: the built-ins and the installed plug-ins."""
    return sorted({*_MODELS, *_plugins()})


def model_options(name: str) -> dict[str, Any]:
    """The options ``name`` accepts with their defaults; ValueError for an unknown model."""
    builder = _get(name)
    params = inspect.signature(builder).parameters.values()
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: p.default for p in params if p.name not in _FIXED and p.kind in named}


def _get(name: str) -> ModelBuilder:
    builder = _MODELS.get(name)
    if builder is not None:
        return builder
    plugin = _plugins().get(name)
    if plugin is None:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(list_models())})")
    try:
        loaded = plugin.load()
    except Exception as exc:  # a broken plug-in is a job failure with its reason, not a crash
        raise ValueError(
            f"model {name!r}: its plug-in {plugin.value} cannot be loaded: {exc}"
        ) from exc
    if not callable(loaded):
        raise ValueError(f"model {name!r}: the plug-in {plugin.value} is not a callable builder")
    return cast(ModelBuilder, loaded)


def build_model(
    name: str,
    *,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    **options: Any,
) -> nn.Module:
    """Build model ``name`` for images ``[*, in_channels, H, W]`` and ``num_classes`` outputs.

    ValueError for an unknown model (listing the known ones), an unknown option
    (listing the accepted ones) or an invalid value.
    """
    builder = _get(name)
    for label, value in (("in_channels", in_channels), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if len(image_size) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in image_size
    ):
        raise ValueError(f"image_size must be (H, W) positive integers, got {image_size!r}")
    accepted = model_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"model {name!r}: unknown option(s) {unknown} (accepted: {sorted(accepted)})"
        )
    model = builder(
        in_channels=in_channels,
        num_classes=num_classes,
        image_size=(image_size[0], image_size[1]),
        **options,
    )
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model {name!r}: its builder returned {type(model).__name__}, not a Module"
        )
    return model
