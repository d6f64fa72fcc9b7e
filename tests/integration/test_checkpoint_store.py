"""Checkpoint files, commits, retention and verified loading, against both object stores
(a local directory and a real HTTP S3 endpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from storage_backends import Backend

from conveyor.training.checkpoint import (
    CheckpointError,
    CheckpointStore,
    DataCursor,
    Manifest,
    SliceFile,
    SliceState,
    latest_key,
    manifest_key,
    slice_key,
)
from conveyor.training.checkpoint.slicefile import decode_slice, encode_slice
from conveyor.training.jobspec import OptimizerSpec
from conveyor.training.optim import SliceOptimizer

JOB = "job-ck"
SLICES = 3


def trained_slice(index: int, version: int, *, adam: bool = False) -> SliceState:
    """A slice whose optimizer has real state after ``version`` steps."""
    spec = (
        OptimizerSpec(name="adam", lr=0.01)
        if adam
        else OptimizerSpec(name="sgd", lr=0.1, momentum=0.9)
    )
    generator = torch.Generator().manual_seed(index)
    optimizer = SliceOptimizer(spec, torch.randn(100 + index, generator=generator))
    for _ in range(version):
        optimizer.step(torch.randn(100 + index, generator=generator), 0.1)
    return SliceState(
        slice_index=index,
        version=version,
        values=optimizer.values.clone(),
        optimizer=optimizer.state_tensors(),
        grads_offset=10 * index + version,
    )


def save(checkpoints: CheckpointStore, version: int, *, commit: bool = True) -> Manifest:
    files = [checkpoints.write_slice(trained_slice(p, version)) for p in range(SLICES)]
    manifest = Manifest(
        job_id=JOB,
        version=version,
        step=version,
        trigger="every_steps",
        created_at=1000.0 + version,
        files=files,
        data_cursor=DataCursor(epoch=0, applied_batches=[f"{JOB}:e0:train:{version}"]),
        rng={"seed": 0},
        spec={"name": "x"},
        model={"name": "mlp"},
    )
    if commit:
        checkpoints.commit(manifest)
    return manifest


def test_a_committed_checkpoint_loads_bit_exactly_with_optimizer_state(backend: Backend) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    written = save(checkpoints, 4)
    manifest, states, skipped = checkpoints.latest_good()
    assert manifest == written and skipped == []
    assert sorted(states) == [0, 1, 2]
    for index, state in states.items():
        expected = trained_slice(index, 4)
        assert torch.equal(state.values, expected.values)
        assert state.optimizer.keys() == {"momentum_buffer"}
        assert torch.equal(
            state.optimizer["momentum_buffer"], expected.optimizer["momentum_buffer"]
        )
        assert (state.version, state.grads_offset) == (4, 10 * index + 4)
    pointer = json.loads(backend.store.get_bytes(latest_key(JOB)))
    assert pointer["version"] == 4 and pointer["manifest"] == manifest_key(JOB, 4)


def test_adam_moments_and_step_survive_the_round_trip(backend: Backend) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    state = trained_slice(0, 3, adam=True)
    entry = checkpoints.write_slice(state)
    loaded = checkpoints.read_slice(entry)
    assert loaded.optimizer.keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert float(loaded.optimizer["step"]) == 3.0
    for name, value in state.optimizer.items():
        assert torch.equal(loaded.optimizer[name], value)


def test_only_the_requested_slices_are_read(backend: Backend) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    save(checkpoints, 2)
    backend.store.delete(slice_key(JOB, 2, 0))  # slice 0 lost: a reader of slice 1 is fine
    manifest, states, skipped = checkpoints.latest_good([1])
    assert manifest is not None and manifest.version == 2 and list(states) == [1]
    manifest, states, skipped = checkpoints.latest_good()
    assert manifest is None and [s.version for s in skipped] == [2]


def test_files_without_a_manifest_are_not_a_checkpoint(backend: Backend) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    save(checkpoints, 2)
    save(checkpoints, 4, commit=False)  # the writer died before the commit
    manifest, _, skipped = checkpoints.latest_good()
    assert manifest is not None and manifest.version == 2 and skipped == []
    rows = {row.version: (row.state, row.latest) for row in checkpoints.listing()}
    assert rows == {4: ("incomplete", False), 2: ("committed", True)}


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    backend: Backend, damage: str
) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    save(checkpoints, 2)
    newest = save(checkpoints, 4)
    entry = newest.files[1]
    data = backend.store.get_bytes(entry.key)
    if damage == "corrupt":
        backend.corrupt(entry.key, data[:-8] + bytes(8))  # same size, recorded sha kept
    elif damage == "truncate":
        backend.store.put_bytes(entry.key, data[: len(data) // 2])
    elif damage == "delete":
        backend.store.delete(entry.key)
    else:
        backend.store.put_bytes(manifest_key(JOB, 4), b'{"format": 1, "files": [')
    manifest, states, skipped = checkpoints.latest_good()
    assert manifest is not None and manifest.version == 2
    assert all(torch.equal(s.values, trained_slice(p, 2).values) for p, s in states.items())
    assert [s.version for s in skipped] == [4]
    assert skipped[0].reason  # names the file or the manifest and what is wrong


def test_commit_refuses_a_manifest_whose_files_are_not_in_the_store(backend: Backend) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    manifest = save(checkpoints, 2, commit=False)
    lying = Manifest(
        **{**{f: getattr(manifest, f) for f in Manifest.__dataclass_fields__}, "files": [
            SliceFile(slice_index=i, key=f.key, size_bytes=f.size_bytes + 1, sha256=f.sha256,
                      grads_offset=f.grads_offset)
            for i, f in enumerate(manifest.files)
        ]}
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="not the file that was written"):
        checkpoints.commit(lying)
    backend.store.delete(manifest.files[0].key)
    with pytest.raises(CheckpointError, match="missing"):
        checkpoints.commit(manifest)
    assert checkpoints.committed_versions() == []


def test_retention_keeps_the_newest_and_clears_torn_leftovers(backend: Backend) -> None:
    checkpoints = CheckpointStore(backend.store, JOB)
    for version in (1, 2, 3):
        save(checkpoints, version)
    save(checkpoints, 4, commit=False)  # torn, older than the newest commit below
    save(checkpoints, 5)
    save(checkpoints, 6, commit=False)  # being written now: must stay
    assert checkpoints.retain(keep_last=2) == [1, 2, 4]
    assert checkpoints.committed_versions() == [5, 3]
    remaining = {row.version: row.state for row in checkpoints.listing()}
    assert remaining == {6: "incomplete", 5: "committed", 3: "committed"}
    assert not [k for k in backend.store.list(f"checkpoints/{JOB}/") if "/v0000000001/" in k]


def test_slice_files_are_plain_safetensors_both_ways() -> None:
    # encode_slice lays the file out itself (one copy); any safetensors reader loads it, and
    # files written by safetensors itself (checkpoints of earlier versions) still decode.
    state = trained_slice(1, 3, adam=True)
    state.optimizer["flags"] = torch.tensor([True, False, True])  # 1-byte elements after fp32
    tensors = {"values": state.values, **{f"optimizer.{k}": v for k, v in state.optimizer.items()}}
    metadata = {"format": "1", "job_id": JOB, "version": "3", "slice_index": "1",
                "grads_offset": str(state.grads_offset)}  # fmt: skip
    ours = bytes(encode_slice(JOB, state))
    loaded = load_tensors(ours)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    for data in (ours, save_tensors(tensors, metadata=metadata)):
        decoded = decode_slice(data)
        assert (decoded.slice_index, decoded.version, decoded.grads_offset) == (1, 3, 13)
        assert torch.equal(decoded.values, state.values)
        assert decoded.optimizer.keys() == state.optimizer.keys()
        assert all(torch.equal(decoded.optimizer[k], v) for k, v in state.optimizer.items())


@pytest.mark.parametrize("cut", [0, 7, 12, -1])
def test_a_truncated_or_garbled_slice_file_does_not_decode(cut: int) -> None:
    data = bytes(encode_slice(JOB, trained_slice(0, 2)))
    with pytest.raises(ValueError, match="not a slice state file"):
        decode_slice(data[:cut])
    with pytest.raises(ValueError, match="not a slice state file"):
        decode_slice(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")  # a header that is not an object
