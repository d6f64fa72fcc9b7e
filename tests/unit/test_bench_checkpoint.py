"""The pure helpers of loadtests/bench_checkpoint.py: throughput windows, stalls, losses, the
JSON line; and the job pair of loadtests/bench_deterministic.py, which reuses its runner."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from loadtests import bench_checkpoint as bench


def test_the_window_runs_from_the_last_warmup_step_to_the_last_step() -> None:
    # (version, closed_at, samples): version 3 applied nothing and is not a step.
    closes = [(1, 10.0, 64), (2, 11.0, 64), (3, 11.5, 0), (4, 12.0, 64), (5, 14.0, 32)]
    window = bench.close_window(list(reversed(closes)), warmup_steps=2)  # order does not matter
    assert window is not None
    assert (window.first_step, window.last_step) == (2, 4)
    assert (window.samples, window.seconds) == (64 + 32, 3.0)
    assert window.samples_per_second == pytest.approx(32.0)


def test_a_job_too_short_for_its_warmup_has_no_window() -> None:
    assert bench.close_window([(1, 0.0, 64), (2, 1.0, 64)], warmup_steps=3) is None
    assert bench.close_window([], warmup_steps=2) is None


def test_warmup_is_a_tenth_of_the_steps_and_at_least_two() -> None:
    assert [bench.default_warmup(n) for n in (0, 19, 122, 184)] == [2, 2, 12, 18]


def test_a_stall_is_the_time_of_the_steps_after_a_checkpoint_beyond_as_many_median_steps() -> None:
    # Steps every 1 s, except that the two after version 4 took 1.5 s each.
    steps = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.5), (6, 6.0), (7, 7.0), (8, 8.0)]
    assert bench.stall_excess(steps, [4], after_steps=3) == pytest.approx([1.0])
    assert bench.stall_excess(steps, [2], after_steps=2) == pytest.approx([0.0])
    # Too close to the end, or not a step of the window: left out.
    assert bench.stall_excess(steps, [7, 40], after_steps=3) == []
    assert bench.stall_excess(steps[:1], [1], after_steps=1) == []


def test_losses_pair_the_repeats_and_skip_what_is_missing() -> None:
    found = bench.losses([90.0, 100.0, None, 50.0], [100.0, 95.0, 80.0, 0.0])
    assert found == pytest.approx([0.1, -100 / 95 + 1])


def test_io_ratios_are_ours_over_raw_per_repeat() -> None:
    assert bench.ratios([80.0, 120.0], [100.0, 100.0]) == pytest.approx([0.8, 1.2])
    assert bench.ratios([80.0], [0.0]) == []


def test_the_json_line_puts_the_headline_first_and_rounds() -> None:
    line = bench.result_json(
        {"checkpoint_throughput_loss": 0.012345, "save_vs_raw_put": 0.9},
        {"s3_save_vs_raw_put": 0.77777, "digits_checkpoint_throughput_loss": math.nan},
    )
    parsed = json.loads(line)
    assert list(parsed)[:3] == [
        "checkpoint_throughput_loss", "save_vs_raw_put", "restore_vs_raw_get",
    ]  # fmt: skip
    assert parsed == {
        "checkpoint_throughput_loss": 0.0123,
        "save_vs_raw_put": 0.9,
        "restore_vs_raw_get": None,
        "s3_save_vs_raw_put": 0.7778,
        "digits_checkpoint_throughput_loss": None,
    }


def test_slice_states_hold_adam_state_of_the_asked_size() -> None:
    states = bench.slice_states(2, 1000)
    assert [s.slice_index for s in states] == [0, 1]
    assert states[0].values.numel() == 1000
    assert states[0].optimizer.keys() == {"exp_avg", "exp_avg_sq", "step"}


def test_the_job_specs_differ_only_in_every_steps() -> None:
    makers: list[Callable[[int | None], dict[str, Any]]] = [
        lambda every: bench.digits_spec(epochs=2, every_steps=every),
        lambda every: bench.resnet_spec(n=256, width=8, every_steps=every),
    ]
    for make in makers:
        with_checkpoints, without = make(50), make(None)
        assert with_checkpoints["checkpoint"]["every_steps"] == 50
        assert without["checkpoint"]["every_steps"] is None
        without["checkpoint"]["every_steps"] = 50
        assert without == with_checkpoints


def test_the_deterministic_benchmark_pairs_specs_that_differ_in_the_option_alone() -> None:
    from conveyor.training.jobspec import JobSpec
    from loadtests import bench_deterministic

    det, default = (
        JobSpec.from_dict(bench_deterministic.job_spec(epochs=2, deterministic=flag))
        for flag in (True, False)
    )
    assert det.distribution.deterministic and not default.distribution.deterministic
    assert det.distribution.model_copy(update={"deterministic": False}) == default.distribution
    same = {"name", "distribution"}
    assert det.model_dump(exclude=same) == default.model_dump(exclude=same)
    assert det.training.epochs == 2 and det.distribution.trainers == 1
