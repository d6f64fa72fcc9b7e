"""The pure helpers of loadtests/bench_aggregation.py: step windows, bytes, ratios, the JSON."""

from __future__ import annotations

import json
import math

import pytest

from loadtests import bench_aggregation as bench
from loadtests.ddp_baseline import Case


def test_the_step_window_starts_at_the_last_warmup_step_and_ends_at_the_last_close() -> None:
    closes = [(1, 10.0), (2, 10.5), (3, 10.7), (4, 11.0), (5, 11.2), (6, 12.2)]
    window = bench.step_window(list(reversed(closes)), warmup_steps=2)  # order does not matter
    assert window is not None
    assert window.steps == 4 and window.seconds == pytest.approx(1.7)
    assert window.per_step_s == pytest.approx(0.425)
    assert window.median_interval_s == pytest.approx(0.25)  # of 0.2, 0.3, 0.2, 1.0


def test_steps_without_samples_do_not_count() -> None:
    # Versions 2 and 4 applied no sample (left out): 3 -> 5 is one step.
    window = bench.step_window([(1, 0.0), (3, 1.0), (5, 2.5)], warmup_steps=2)
    assert window is not None
    assert (window.steps, window.seconds, window.median_interval_s) == (1, 1.5, 1.5)


def test_a_window_without_a_step_is_none() -> None:
    assert bench.step_window([], warmup_steps=0) is None
    assert bench.step_window([(1, 0.0), (2, 1.0)], warmup_steps=2) is None
    assert bench.step_window([(1, 0.0), (2, 1.0)], warmup_steps=3) is None


def test_warmup_is_a_tenth_of_the_steps_and_at_least_two() -> None:
    assert [bench.default_warmup(n) for n in (0, 5, 29, 30, 127)] == [2, 2, 2, 3, 12]


def test_contribution_bytes_leave_empty_contributions_out() -> None:
    found = bench.mean_contribution_bytes([(7520, 32), (0, 0), (7520, 30), (3760, 1)])
    assert found == pytest.approx((7520 + 7520 + 3760) / 3)
    assert bench.mean_contribution_bytes([(0, 0)]) is None


def test_step_bytes_sum_the_contributions_each_step_applied() -> None:
    grad_bytes = {"a:1": 100, "b:1": 100, "a:2": 100, "b:2": 0}
    assert bench.step_bytes([["a:1", "b:1"], ["a:2", "b:2"], ["c:9"]], grad_bytes) == [200, 100, 0]


def test_ratios_and_medians_skip_what_is_missing() -> None:
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None and bench.ratio(1.0, 0.0) is None
    assert bench.median([3.0, None, 1.0, math.nan, 2.0]) == 2.0
    assert bench.median([None]) is None


def test_accuracy_deltas_are_points_lost_per_repeat() -> None:
    deltas = bench.accuracy_deltas([0.95, 0.96, None], [0.90, 0.97, 0.5])
    assert deltas == pytest.approx([5.0, -1.0])


def test_topk_at_one_percent_with_bf16_values_and_int32_indices_saves_at_most_66x() -> None:
    assert bench.max_topk_reduction(0.01) == pytest.approx(400 / 6)
    assert bench.max_topk_reduction(0.01, value_bytes=4) == pytest.approx(50.0)
    # digits small_cnn: 93962 parameters in 2 slices of 46981; k = ceil(469.81) = 470 each.
    dense, topk = 2 * 46981 * 4, 2 * 470 * (2 + 4)
    assert bench.ratio(dense, topk) == pytest.approx(66.64, abs=0.01)


def test_the_json_ends_with_the_three_headline_figures() -> None:
    result = bench.result_json(
        extras={"step_vs_local": 6.12345, "step_vs_ddp_gloo": 99.0, "x": math.nan},
        step_vs_ddp=2.28761,
        bytes_reduction=49.97981,
        accuracy_delta=None,
    )
    assert list(result) == [
        "step_vs_local", "x", "step_vs_ddp_gloo", "topk_bytes_reduction", "topk_accuracy_delta"
    ]  # fmt: skip
    assert result == {
        "step_vs_local": 6.1235, "x": None, "step_vs_ddp_gloo": 2.2876,
        "topk_bytes_reduction": 49.9798, "topk_accuracy_delta": None,
    }  # fmt: skip
    assert json.loads(json.dumps(result)) == result


def test_each_job_has_a_baseline_without_the_overlap_that_trains_the_same() -> None:
    dense = bench.digits_spec(epochs=1, compression="none", seed=3)
    overlapped, baseline = bench.with_overlap(dense, True), bench.with_overlap(dense, False)
    assert overlapped["distribution"]["overlap_backward"] is True
    assert baseline["distribution"]["overlap_backward"] is False
    assert overlapped["name"] == dense["name"] and baseline["name"] == f"{dense['name']}-serial"
    baseline["name"] = dense["name"]
    baseline["distribution"]["overlap_backward"] = True
    assert baseline == overlapped  # only the overlap differs
    cases = [Case("small_cnn", "", dense, 10, 1), Case("resnet18", "", dense, 2, 1)]
    assert bench.job_names(cases) == [
        "small_cnn", "small_cnn_serial", "resnet18", "resnet18_serial"
    ]  # fmt: skip
