"""The time-to-accuracy benchmark's figures: its pure helpers, on made-up runs."""

from __future__ import annotations

import pytest

from loadtests.bench_time_to_accuracy import baseline_figures, result_json, steady_rate, time_to

EPOCHS = [
    {"elapsed_s": 2.0, "eval_accuracy": 0.80},
    {"elapsed_s": 4.0, "eval_accuracy": 0.93},
    {"elapsed_s": 6.0, "eval_accuracy": 0.91},
]


def test_time_to_accuracy_is_the_first_epoch_end_at_the_target() -> None:
    assert time_to(EPOCHS, 0.9) == 4.0
    assert time_to(EPOCHS, 0.8) == 2.0
    assert time_to(EPOCHS, 0.95) is None


def test_ddp_sends_a_ring_all_reduce_per_global_batch_and_plain_nothing() -> None:
    found = {"epochs": EPOCHS, "samples": 600}
    ddp = baseline_figures(found, 0.9, params=1000, system="ddp")
    assert ddp["samples_per_s"] == 100.0 and ddp["final_accuracy"] == 0.91
    assert ddp["bytes_per_sample"] == 2 * (2 - 1) * 4 * 1000 / 64  # 2 trainers, batch 64
    assert baseline_figures(found, 0.9, params=1000, system="plain")["bytes_per_sample"] == 0


def test_the_last_line_compares_local_and_sync_with_ddp_and_prefixes_resnet18() -> None:
    def system(
        rate: float, tta: float | None, acc: float, per_sample: float
    ) -> dict[str, float | None]:
        return {"samples_per_s": rate, "time_to_accuracy_s": tta, "final_accuracy": acc,
                "bytes_per_sample": per_sample}  # fmt: skip

    case = {
        "plain": system(400, 2.0, 0.97, 0),
        "ddp": system(200, 4.0, 0.97, 100),
        "sync": system(50, 16.0, 0.96, 800),
        "local": system(180, 5.0, 0.955, 100),
    }
    line = result_json({"small_cnn": case, "resnet18": {**case, "local": system(0, None, 0.5, 1)}})
    assert line["local_vs_ddp_samples_per_s"] == pytest.approx(0.9)
    assert line["local_vs_ddp_time_to_accuracy"] == pytest.approx(1.25)
    assert line["sync_vs_ddp_samples_per_s"] == pytest.approx(0.25)
    assert line["local_accuracy_delta_vs_sync"] == pytest.approx(0.5)  # points, sync - local
    assert line["bytes_per_sample_local_vs_sync"] == pytest.approx(0.125)
    assert line["resnet18_local_vs_ddp_time_to_accuracy"] is None  # never reached the target
    assert line["resnet18_local_accuracy_delta_vs_sync"] == pytest.approx(46.0)


def test_local_overlap_follows_with_its_own_keys_when_it_ran() -> None:
    def system(rate: float, tta: float | None, acc: float) -> dict[str, float | None]:
        return {"samples_per_s": rate, "time_to_accuracy_s": tta, "final_accuracy": acc,
                "bytes_per_sample": 100.0}  # fmt: skip

    case = {
        "plain": system(400, 2.0, 0.97),
        "ddp": system(200, 4.0, 0.97),
        "sync": system(50, 16.0, 0.96),
        "local": system(100, 8.0, 0.955),
    }
    assert not any(key.startswith("local_overlap") for key in result_json({"small_cnn": case}))
    line = result_json({"small_cnn": {**case, "local_overlap": system(120, 6.0, 0.95)}})
    assert line["local_overlap_vs_ddp_samples_per_s"] == pytest.approx(0.6)
    assert line["local_overlap_vs_local_samples_per_s"] == pytest.approx(1.2)
    assert line["local_overlap_vs_ddp_time_to_accuracy"] == pytest.approx(1.5)
    assert line["local_overlap_accuracy_delta_vs_sync"] == pytest.approx(1.0)
    assert line["local_vs_ddp_samples_per_s"] == pytest.approx(0.5)  # the headline is local's


def test_the_steady_rate_starts_at_the_first_step_every_trainer_contributed_to() -> None:
    both, one = {"a", "b"}, {"a"}
    # A first window cut short (one trainer, early), then the pool: 2 s for 3 x 100 samples.
    steps = [(0.5, 40, one), (5.0, 100, both), (6.0, 100, both), (6.5, 100, one), (7.0, 100, both)]
    assert steady_rate(steps, 2) == pytest.approx(150.0)
    assert steady_rate(steps, 3) is None  # never the whole pool
    assert steady_rate(steps[:2], 2) is None  # no step after it
    assert steady_rate([(1.0, 10, one), (2.0, 10, one)], 1) == pytest.approx(10.0)
