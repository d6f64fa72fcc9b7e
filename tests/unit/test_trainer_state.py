"""Trainer-state checkpoints: bit-exact round trips, the latest pointer, fallback, retention;
the ledger; the exported model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_tensors

from conveyor.libs.jobspec import JobSpec, OptimizerSpec
from conveyor.libs.models import build_model
from conveyor.libs.storage import open_store
from conveyor.services.trainer.compute import Engine, LocalUpdater, Normalizer, build_optimizer
from conveyor.services.trainer.ledger import Ledger
from conveyor.services.trainer.state import (
    StateStore,
    TrainerCheckpoint,
    capture_tensors,
    pack_model,
    pack_optimizer,
    restore_tensors,
    unpack_model,
    unpack_optimizer,
)
from conveyor.services.trainer.summary import export_model, write_ledger

CPU = torch.device("cpu")


@dataclass
class Trainer:
    engine: Engine
    updater: LocalUpdater

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.updater.optimizer


def trainer(optimizer: OptimizerSpec, seed: int, model: str = "small_cnn") -> Trainer:
    torch.manual_seed(seed)
    options = {"channels": [4, 8]} if model == "small_cnn" else {"width": 2}
    net = build_model(model, in_channels=1, num_classes=10, image_size=(8, 8), **options)
    engine = Engine(net, CPU, bf16=False, normalizer=Normalizer(None, 1, CPU))
    return Trainer(engine, LocalUpdater(net, build_optimizer(optimizer, list(net.parameters()))))


def train_steps(t: Trainer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (6, 1, 8, 8), dtype=torch.uint8, generator=generator)
        y = torch.randint(0, 10, (6,), generator=generator)
        t.engine.accumulate(x, y)
        t.updater.apply(6)


def checkpoint_of(t: Trainer, step: int) -> TrainerCheckpoint:
    optimizer_tensors, optimizer_meta = pack_optimizer(t.optimizer)
    return TrainerCheckpoint(
        step=step,
        tensors={**pack_model(t.model), **optimizer_tensors},
        meta={"optimizer": optimizer_meta},
    )


def restore_into(t: Trainer, checkpoint: TrainerCheckpoint) -> None:
    unpack_model(t.model, checkpoint.tensors)
    unpack_optimizer(t.optimizer, checkpoint.tensors, checkpoint.meta["optimizer"])


@pytest.mark.parametrize(
    ("optimizer", "model"),
    [
        (OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True), "small_cnn"),
        (OptimizerSpec(name="adam", lr=0.01, betas=(0.8, 0.95)), "small_cnn"),
        (OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.1), "resnet18"),  # BN buffers
    ],
)
def test_save_load_round_trip_is_bit_exact_and_training_continues_identically(
    tmp_path: Path, optimizer: OptimizerSpec, model: str
) -> None:
    original = trainer(optimizer, seed=0, model=model)
    train_steps(original, 3, seed=1)
    states = StateStore(open_store(f"file://{tmp_path}"), "job1")
    states.save(checkpoint_of(original, step=3))

    loaded = states.load_latest()
    assert loaded is not None and loaded.step == 3
    resumed = trainer(optimizer, seed=99, model=model)  # different initial weights
    restore_into(resumed, loaded)
    for (name, a), (_, b) in zip(
        original.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    opt_a = original.optimizer.state_dict()
    opt_b = resumed.optimizer.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for index, state in opt_a["state"].items():
        for key, value in state.items():
            other = opt_b["state"][index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other

    train_steps(original, 2, seed=7)
    train_steps(resumed, 2, seed=7)
    for a, b in zip(original.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_pointer_retention_and_fallback_to_an_older_intact_state(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    states = StateStore(store, "job1", keep_last=2)
    assert states.load_latest() is None
    engine = trainer(OptimizerSpec(name="sgd", lr=0.1), seed=0)
    for step in (10, 20, 30):
        states.save(checkpoint_of(engine, step))
    kept = [key for key in store.list("jobs/job1/trainer/") if key.endswith(".json")]
    assert kept == [
        "jobs/job1/trainer/state-0000000020.json",
        "jobs/job1/trainer/state-0000000030.json",
    ]
    assert json.loads(store.get_bytes(states.latest_key))["step"] == 30
    latest = states.load_latest()
    assert latest is not None and latest.step == 30

    # A torn write: step 30's tensors replaced by garbage -> its checksum fails -> step 20.
    (tmp_path / "jobs/job1/trainer/state-0000000030.safetensors").write_bytes(b"torn")
    fallback = states.load_latest()
    assert fallback is not None and fallback.step == 20


def test_ledger_counts_round_trip_and_serialise(tmp_path: Path) -> None:
    ledger = Ledger(10)
    ledger.add(0, [1, 2, 3])
    ledger.add(0, [3])
    ledger.add(1, [12])  # beyond the announced size: grows
    assert ledger.counts(0) == {1: 1, 2: 1, 3: 2}
    restored = Ledger.from_tensors(10, ledger.to_tensors())
    assert restored.counts(0) == ledger.counts(0) and restored.counts(1) == {12: 1}
    store = open_store(f"file://{tmp_path}")
    write_ledger(store, "job1", restored)
    document = json.loads(store.get_bytes("jobs/job1/ledger.json"))
    assert document == {"epochs": {"0": {"1": 1, "2": 1, "3": 2}, "1": {"12": 1}}}
    with pytest.raises(ValueError):
        ledger.add(0, [-1])


def test_exported_model_is_self_describing(tmp_path: Path) -> None:
    spec = JobSpec.from_dict(
        {
            "name": "digits",
            "model": {"name": "small_cnn", "channels": [4, 8]},
            "dataset": {"uri": "builtin://sklearn-digits"},
            "preprocess": {"normalize": {"mean": [0.5], "std": [0.25]}},
            "training": {
                "epochs": 1,
                "global_batch_size": 8,
                "micro_batch_size": 8,
                "optimizer": {"name": "sgd", "lr": 0.1},
            },
        }
    )
    engine = trainer(OptimizerSpec(name="sgd", lr=0.1), seed=0)
    store = open_store(f"file://{tmp_path}")
    uri = export_model(
        store, "job1", engine.model, spec=spec, num_classes=10, sample_shape=(1, 8, 8), step=5
    )
    assert uri == f"file://{tmp_path}/jobs/job1/model.safetensors"
    config = json.loads(store.get_bytes("jobs/job1/config.json"))
    assert config["model"] == {"name": "small_cnn", "options": {"channels": [4, 8]}}
    assert config["normalize"] == {"mean": [0.5], "std": [0.25]}
    assert config["num_classes"] == 10 and config["sample_shape"] == [1, 8, 8]
    rebuilt = build_model(
        config["model"]["name"],
        in_channels=config["sample_shape"][0],
        num_classes=config["num_classes"],
        image_size=tuple(config["sample_shape"][1:]),
        **config["model"]["options"],
    )
    rebuilt.load_state_dict(load_tensors(store.get_bytes("jobs/job1/model.safetensors")))
    for a, b in zip(engine.model.parameters(), rebuilt.parameters(), strict=True):
        assert torch.equal(a, b)


def test_captured_state_restores_model_optimizer_snapshots_and_ledger(tmp_path: Path) -> None:
    live = trainer(OptimizerSpec(name="adam", lr=0.01), seed=0)
    train_steps(live, 2, seed=1)
    snapshot = live.engine.snapshot()  # epoch 0's eval is still open
    train_steps(live, 1, seed=2)
    ledger = Ledger(20)
    ledger.add(0, [4, 5])
    tensors, optimizer_meta = capture_tensors(live.model, live.optimizer, {0: snapshot}, ledger)
    states = StateStore(open_store(f"file://{tmp_path}"), "job1")
    states.save(TrainerCheckpoint(step=3, tensors=tensors, meta={"optimizer": optimizer_meta}))
    loaded = states.load_latest()
    assert loaded is not None

    fresh = trainer(OptimizerSpec(name="adam", lr=0.01), seed=5)
    snapshots = restore_tensors(
        loaded,
        fresh.model,
        fresh.optimizer,
        snapshot_epochs=[0],
        make_snapshot=fresh.engine.snapshot,
    )
    for a, b in zip(snapshot.parameters(), snapshots[0].parameters(), strict=True):
        assert torch.equal(a, b) and not b.requires_grad
    for a, b in zip(live.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(next(snapshot.parameters()), next(live.model.parameters()))
    assert Ledger.from_tensors(20, loaded.tensors).counts(0) == {4: 1, 5: 1}
