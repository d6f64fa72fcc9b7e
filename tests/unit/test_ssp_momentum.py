"""Bounded staleness learns with SGD momentum only when the momentum is damped by the staleness
(loadtests/ssp_momentum.py: the aggregator's update rule on the digits demo, in process)."""

from __future__ import annotations

import torch

from loadtests import ssp_momentum as simulation


def test_damped_momentum_learns_where_undamped_stays_at_chance() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-reproducible sums
    try:
        damped = simulation.ssp_accuracy("ssp momentum / (1 + d)", seed=0)
        undamped = simulation.ssp_accuracy("ssp undamped", seed=0)
    finally:
        torch.set_num_threads(threads)
    assert damped >= 0.9  # sync reaches ~0.97 on this seed
    assert undamped < 0.3  # 10 classes: chance is 0.1
