"""Model registry: output shapes, sizes, option validation, and that small_cnn learns digits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_plugin import PLUGIN_MODEL, write_plugin

from conveyor.training.datasets import open_array_dataset
from conveyor.training.models import build_model, list_models, model_options


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Two shared cores: torch's default thread pool oversubscribes them badly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["small_cnn", "mlp", "resnet18"])
@pytest.mark.parametrize(
    ("channels", "size", "classes"), [(1, (8, 8), 10), (3, (32, 32), 7), (3, (20, 12), 3)]
)
def test_forward_gives_logits_per_class(
    one_thread: None, name: str, channels: int, size: tuple[int, int], classes: int
) -> None:
    torch.manual_seed(0)
    model = build_model(name, in_channels=channels, num_classes=classes, image_size=size)
    model.eval()
    with torch.no_grad():
        logits = model(torch.rand(2, channels, *size))
    assert logits.shape == (2, classes) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_resnet18_size_and_norm_options(one_thread: None) -> None:
    resnet = build_model("resnet18", in_channels=3, num_classes=10, image_size=(32, 32))
    assert _params(resnet) == 11_173_962  # the reference CIFAR ResNet-18
    assert any(name.endswith("running_mean") for name, _ in resnet.named_buffers())
    grouped = build_model(
        "resnet18", in_channels=3, num_classes=10, image_size=(32, 32), norm="group"
    )
    assert _params(grouped) == _params(resnet) and list(grouped.named_buffers()) == []
    narrow = build_model("resnet18", in_channels=3, num_classes=10, image_size=(32, 32), width=16)
    assert 600_000 < _params(narrow) < 800_000  # ~1/16 of the weights at 1/4 width


def test_option_defaults_and_effects() -> None:
    assert list_models() == ["gpt", "mlp", "resnet18", "small_cnn"]
    assert model_options("mlp") == {"hidden_sizes": (256, 128)}
    assert model_options("resnet18") == {"width": 64, "norm": "batch"}
    linear = build_model("mlp", in_channels=1, num_classes=10, image_size=(8, 8), hidden_sizes=[])
    assert _params(linear) == 64 * 10 + 10
    cnn = build_model("small_cnn", in_channels=1, num_classes=10, image_size=(8, 8), channels=[4])
    assert _params(cnn) == (9 * 4 + 4) + (4 * 10 + 10)
    assert list(cnn.named_buffers()) == []  # all state is parameters: nothing to sync apart


def test_same_seed_same_weights() -> None:
    torch.manual_seed(3)
    first = build_model("small_cnn", in_channels=3, num_classes=5, image_size=(16, 16))
    torch.manual_seed(3)
    second = build_model("small_cnn", in_channels=3, num_classes=5, image_size=(16, 16))
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("vgg", {}, r"unknown model 'vgg' \(known: gpt, mlp, resnet18, small_cnn\)"),
        ("mlp", {"hidden": [3]}, r"option\(s\) \['hidden'\] \(accepted: \['hidden_sizes'\]"),
        ("mlp", {"hidden_sizes": [0]}, "positive integers"),
        ("small_cnn", {"channels": []}, "non-empty list"),
        ("small_cnn", {"channels": "32"}, "list of ints"),
        ("resnet18", {"norm": "layer"}, "norm must be 'batch' or 'group'"),
        ("resnet18", {"width": 0}, "width must be an integer"),
        ("mlp", {"num_classes": 0}, "num_classes must be a positive integer"),
        ("mlp", {"image_size": (8,)}, "image_size must be"),
    ],
)
def test_bad_names_and_options(name: str, kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"in_channels": 1, "num_classes": 10, "image_size": (8, 8)}
    with pytest.raises(ValueError, match=message):
        build_model(name, **{**base, **kwargs})  # type: ignore[arg-type]


def test_small_cnn_learns_digits(one_thread: None) -> None:
    ds = open_array_dataset("builtin://sklearn-digits")
    x_u8, y_np = ds.read(range(ds.num_samples))
    x = torch.from_numpy(x_u8).float().div_(255.0)  # [1797,1,8,8], normalised like a trainer
    y = torch.from_numpy(y_np)  # [1797]
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    torch.manual_seed(0)
    model = build_model("small_cnn", in_channels=1, num_classes=10, image_size=(8, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(3):
        for start in range(0, len(train), 64):
            batch = train[start : start + 64]
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    assert accuracy > 0.9


def test_a_plugin_model_from_an_installed_package_builds_and_validates_its_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(write_plugin(tmp_path)))
    assert PLUGIN_MODEL in list_models() and "small_cnn" in list_models()
    assert model_options(PLUGIN_MODEL) == {"hidden": 32}
    model = build_model(PLUGIN_MODEL, in_channels=1, num_classes=10, image_size=(8, 8), hidden=7)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert sum(p.numel() for p in model.parameters()) == 64 * 7 + 7 + 7 * 10 + 10
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['depth'\]"):
        build_model(PLUGIN_MODEL, in_channels=1, num_classes=10, image_size=(8, 8), depth=3)
    with pytest.raises(ValueError, match=r"tiny_plug_broken.*cannot be loaded"):
        build_model("tiny_plug_broken", in_channels=1, num_classes=10, image_size=(8, 8))
    with pytest.raises(ValueError, match="returned str, not a Module"):
        build_model("tiny_plug_bad", in_channels=1, num_classes=10, image_size=(8, 8))
    with pytest.raises(ValueError, match=rf"unknown model 'nobody_has_it'.*{PLUGIN_MODEL}"):
        build_model("nobody_has_it", in_channels=1, num_classes=10, image_size=(8, 8))


def test_gpt_is_causal_and_checks_its_shape() -> None:
    torch.manual_seed(0)
    gpt = build_model("gpt", in_channels=1, num_classes=50, image_size=(1, 16),
                      n_layer=2, n_head=2, n_embd=16)  # fmt: skip
    tokens = torch.randint(0, 50, (3, 16))
    logits = gpt(tokens)
    assert logits.shape == (3, 16, 50)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 50
    later = gpt(changed)
    assert torch.equal(later[:, :10], logits[:, :10])  # position t sees nothing after t
    assert not torch.allclose(later[:, 10:], logits[:, 10:])
    assert list(gpt.named_buffers()) == []  # the causal mask is not state
    names = [name for name, _ in gpt.named_parameters()]
    assert "wte.weight" in names and "head.weight" not in names  # tied, listed once
    with pytest.raises(ValueError, match="token sequences"):
        build_model("gpt", in_channels=3, num_classes=10, image_size=(8, 8))
    with pytest.raises(ValueError, match="multiple of n_head"):
        build_model("gpt", in_channels=1, num_classes=10, image_size=(1, 8), n_head=3)
