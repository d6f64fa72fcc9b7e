"""Bounded staleness learns with SGD momentum only when the momentum is damped by the staleness
(loadtests/ssp_momentum.py: the aggregator's update rule on the digits demo, in process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SIMULATION = Path(__file__).resolve().parents[2] / "loadtests" / "ssp_momentum.py"


@pytest.fixture(scope="module")
def simulation() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ssp_momentum", SIMULATION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ssp_momentum"] = module
    spec.loader.exec_module(module)
    return module


def test_damped_momentum_learns_where_undamped_stays_at_chance(simulation: ModuleType) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-reproducible sums
    try:
        damped = simulation.ssp_accuracy("ssp momentum / (1 + d)", seed=0)
        undamped = simulation.ssp_accuracy("ssp undamped", seed=0)
    finally:
        torch.set_num_threads(threads)
    assert damped >= 0.9  # sync reaches ~0.97 on this seed
    assert undamped < 0.3  # 10 classes: chance is 0.1
