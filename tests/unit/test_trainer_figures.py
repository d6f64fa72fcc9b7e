"""One trainer's figures: the counters, the wait meter, step times and stage latencies, and the
progress event and heartbeat built from them."""

from __future__ import annotations

import pytest
import torch

from conveyor.platform.messages import TrainerProgress
from conveyor.services.trainer.reporting.figures import (
    STEP_PARTS,
    Rates,
    StageLatencies,
    StepTimes,
    TrainerFigures,
    WaitMeter,
)
from conveyor.services.trainer.reporting.metrics import TrainerMetrics


def figures() -> TrainerFigures:
    return TrainerFigures(TrainerMetrics(), torch.device("cpu"), rate_window_s=60.0, stage_window=8)


def test_figures_count_applied_contributions() -> None:
    counted = figures()
    outcomes = counted.metrics.contributions
    samples = counted.metrics.samples._value.get()  # the registry is process-wide: deltas
    applied = outcomes.labels(outcome="applied")._value.get()
    empty = outcomes.labels(outcome="empty")._value.get()
    counted.contribution_applied(samples=64, batches=2, loss_sum=32.0)
    counted.contribution_applied(samples=0, batches=0, loss_sum=0.0)  # an empty contribution
    assert (counted.samples_trained, counted.batches_trained, counted.loss) == (64, 2, 0.5)
    assert counted.metrics.samples._value.get() - samples == 64
    assert outcomes.labels(outcome="applied")._value.get() - applied == 1
    assert outcomes.labels(outcome="empty")._value.get() - empty == 1


def test_progress_and_heartbeat_carry_the_figures() -> None:
    counted = figures()
    counted.contribution_sent(
        grad_bytes=1000, data_wait_s=0.5, h2d_s=0.1, batches_compute_s=1.0, encode_s=0.25,
        grad_send_s=0.2, param_wait_s=0.3,
    )  # fmt: skip
    counted.contribution_applied(samples=32, batches=2, loss_sum=16.0)
    counted.contribution_rejected()
    counted.empty_sent()
    counted.duplicate_dropped()
    counted.eval_sent()
    counted.data_waited(0.5)
    progress = counted.progress(epoch=1, version=None)
    event = TrainerProgress(job_id="j1", worker_id="w1", **progress)  # the message's own checks
    assert (event.epoch, event.step, event.samples_trained, event.batches_trained) == (1, 0, 32, 2)
    assert (event.contributions, event.empty_contributions, event.rejected_contributions) == (
        1, 1, 1,
    )  # fmt: skip
    assert (event.duplicates, event.eval_batches, event.grad_bytes, event.loss) == (1, 1, 1000, 0.5)
    # wait 0.5 against encode 0.25 + grad send 0.2 (the micro-batches' compute is batch_done's)
    assert event.data_wait_ratio_job == pytest.approx(0.5 / 0.95)
    assert event.step_time_s == pytest.approx(
        {"data_wait": 0.5, "h2d": 0.1, "compute": 1.25, "grad_send": 0.2, "param_wait": 0.3}
    )
    queues = {"outstanding": 2, "ready_batches": 1, "queued_batches": 0, "held_batches": 0,
              "in_flight": 3}  # fmt: skip
    state = counted.heartbeat(epoch=1, version=3, queues=queues, batches_partitions=[1])
    assert (state.device, state.version, state.epoch, state.outstanding) == ("cpu", 3, 1, 2)
    assert (state.in_flight, state.batches_partitions) == (3, [1])
    assert state.step_time_s == pytest.approx(
        {"data_wait": 0.5, "h2d": 0.1, "compute": 1.25, "grad_send": 0.2, "param_wait": 0.3}
    )
    assert state.gpu == {}


def test_wait_meter_window_and_job_totals() -> None:
    now = [0.0]
    meter = WaitMeter(window_s=10.0, clock=lambda: now[0])
    assert meter.ratio is None and meter.recent() == Rates(None, 0.0, 0.0)
    meter.add(wait_s=3.0, compute_s=1.0, samples=40)
    now[0] = 20.0  # the first entry leaves the window
    meter.add(wait_s=1.0, compute_s=2.0, samples=100)
    meter.add(sync_s=2.0)  # the gradient plane's time is step time too
    assert meter.ratio == pytest.approx(4.0 / 9.0)
    rates = meter.recent()
    assert rates.data_wait_ratio == pytest.approx(1.0 / 5.0)
    assert rates.samples_per_second == pytest.approx(100 / 5.0)  # wall: wait + compute + sync
    assert rates.compute_samples_per_second == pytest.approx(50.0)  # compute only
    with pytest.raises(ValueError):
        meter.add(wait_s=-1.0)


def test_step_times_average_the_recent_steps() -> None:
    times = StepTimes(window=2)
    assert times.means() == dict.fromkeys(STEP_PARTS, 0.0)
    times.add(data_wait=9.0, compute=9.0)  # leaves the window
    times.add(data_wait=1.0, h2d=0.5, compute=2.0, grad_send=0.2, param_wait=0.4)
    times.add(compute=4.0, param_wait=0.2)
    assert times.means() == pytest.approx(
        {"data_wait": 0.5, "h2d": 0.25, "compute": 3.0, "grad_send": 0.1, "param_wait": 0.3}
    )
    with pytest.raises(ValueError, match="unknown"):
        times.add(update=1.0)


def test_stage_latencies_from_batch_stamps() -> None:
    stages = StageLatencies(window=3)
    for k in range(4):
        stamps = {
            "read_start": 0.0,
            "read_end": 0.1 * k,
            "augment_end": 0.1 * k + 0.05,
            "sent": 1.0,
            "received": 1.5,
            "h2d_end": 1.5 + 0.01 * k,
        }
        stages.add_batch(stamps, compute_s=0.2)
    p50 = stages.percentile(50)
    assert p50["read"] == pytest.approx(0.2)  # the window keeps k = 1, 2, 3
    assert p50["augment"] == pytest.approx(0.05)
    assert p50["queue"] == pytest.approx(0.5)
    assert p50["h2d"] == pytest.approx(0.02)
    assert p50["compute"] == pytest.approx(0.2)
    partial = StageLatencies(window=3)
    partial.add_batch({"sent": 2.0, "received": 1.0}, compute_s=None)  # skewed clocks
    assert partial.percentile(50) == {"queue": 0.0}
