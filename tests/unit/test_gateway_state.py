"""The job-state view: event sequences -> states, finality, progress numbers, idempotency."""

from __future__ import annotations

from typing import Any

import pytest
from job_events import job_event

from conveyor.platform.messages import CoordinatorProgress, JobEvent, JobResumed
from conveyor.training.jobview import JobsView, percentile

SPEC: dict[str, Any] = {"name": "digits-cnn", "training": {"epochs": 3, "max_steps": None}}


def ev(job_id: str, event: str, at: float = 1.0, **data: Any) -> JobEvent:
    return job_event(job_id, event, at=at, **data)


WORKER_EVENTS: dict[str, dict[str, Any]] = {
    "running": {"worker_id": "w0"}, "progress": {"worker_id": "w0"},
}  # fmt: skip


def submitted(job_id: str, at: float = 1.0, key: str | None = None, **spec: Any) -> JobEvent:
    return ev(job_id, "submitted", at, spec={**SPEC, **spec}, idempotency_key=key)


def fold(*events: JobEvent, view: JobsView | None = None) -> JobsView:
    view = view if view is not None else JobsView()
    for event in events:
        view.apply(event)
    return view


def test_submitted_creates_a_pending_job() -> None:
    view = fold(submitted("a", at=10.0, key="k1"))
    job = view.get("a")
    assert job is not None
    assert (job.state, job.name, job.submitted_at, job.seq) == ("pending", "digits-cnn", 10.0, 1)
    assert job.idempotency_key == "k1"
    assert job.progress()["epochs"] == 3


@pytest.mark.parametrize(
    ("events", "state"),
    [
        (["planned"], "planned"),
        (["planned", "running"], "running"),
        (["planned", "progress"], "running"),  # progress implies running
        (["planned", "running", "completed"], "completed"),
        (["failed"], "failed"),
        (["planned", "running", "cancel_requested", "cancelled"], "cancelled"),
        (["running", "planned"], "running"),  # states never move back
    ],
)
def test_state_sequences(events: list[str], state: str) -> None:
    view = fold(submitted("a"), *(ev("a", name, **WORKER_EVENTS.get(name, {})) for name in events))
    job = view.get("a")
    assert job is not None and job.state == state


@pytest.mark.parametrize("terminal", ["completed", "failed", "cancelled"])
def test_terminal_states_are_final(terminal: str) -> None:
    view = fold(submitted("a"), ev("a", "running", worker_id="w0"), ev("a", terminal, at=5.0))
    job = view.get("a")
    assert job is not None
    seq = job.seq
    later_events = [
        ev("a", "running", at=9.0, worker_id="w1"),
        ev("a", "progress", at=9.0, worker_id="w1", step=99),
        ev("a", "failed", at=9.0, reason="x"),
        ev("a", "completed", at=9.0),
        ev("a", "cancelled", at=9.0, reason="x"),
        ev("a", "cancel_requested", at=9.0),
    ]
    for later in later_events:
        assert view.apply(later) is None
    assert (job.state, job.seq, job.updated_at, job.cancel_requested) == (terminal, seq, 5.0, False)
    assert "w1" not in job.workers


def test_failed_and_cancelled_keep_their_reason() -> None:
    view = fold(submitted("a"), ev("a", "failed", reason="dataset unreadable"))
    view = fold(submitted("b"), ev("b", "cancelled", reason="by user"), view=view)
    assert view.get("a").reason == "dataset unreadable"  # type: ignore[union-attr]
    assert view.get("b").reason == "by user"  # type: ignore[union-attr]


def test_completed_keeps_the_summary() -> None:
    summary = {"eval_accuracy": 0.97, "steps": 120}
    view = fold(submitted("a"), ev("a", "completed", summary=summary))
    job = view.get("a")
    assert job is not None and job.summary == summary and job.state == "completed"


def test_events_of_unknown_jobs_are_ignored() -> None:
    view = fold(ev("ghost", "planned"), submitted("a"))
    assert view.get("ghost") is None and len(view) == 1
    assert view.apply(ev("ghost", "progress")) is None
    assert view.get("a").seq == 1  # type: ignore[union-attr]


def test_duplicate_submitted_keeps_the_first() -> None:
    view = fold(submitted("a", at=1.0, name="first"), submitted("a", at=2.0, name="second"))
    job = view.get("a")
    assert job is not None and job.name == "first" and job.submitted_at == 1.0 and job.seq == 1


def test_idempotency_map_points_at_the_first_job() -> None:
    view = fold(submitted("a", key="k"), submitted("b", key="k"), submitted("c"))
    assert view.job_for_key("k").job_id == "a"  # type: ignore[union-attr]
    assert view.job_for_key("other") is None


def test_progress_sums_workers_and_keeps_latest_report_each() -> None:
    view = fold(
        submitted("a"),
        ev("a", "planned", steps_per_epoch=10),
        ev("a", "progress", at=2.0, worker_id="w0", epoch=0, step=3, samples_trained=96,
           loss=2.0, samples_per_second=100.0, data_wait_ratio=0.1),
        ev("a", "progress", at=3.0, worker_id="w1", epoch=0, step=4, samples_trained=128,
           loss=1.5, samples_per_second=50.0, data_wait_ratio=0.3,
           step_time_s={"compute": 0.4, "param_wait": 0.1}),
        ev("a", "progress", at=4.0, worker_id="w0", epoch=1, step=5, samples_trained=160,
           loss=1.2, samples_per_second=120.0, data_wait_ratio=0.2,
           step_time_s={"compute": 0.2, "data_wait": 0.05}),
    )  # fmt: skip
    job = view.get("a")
    assert job is not None
    progress = job.progress()
    assert progress["epoch"] == 1 and progress["step"] == 5
    assert progress["samples_trained"] == 160 + 128
    # Consumed batches are counted by the coordinator alone (none reported yet).
    assert progress["batches_consumed"] == 0 and progress["consumed_train_batches"] == 0
    assert progress["samples_per_second"] == pytest.approx(170.0)
    assert progress["data_wait_ratio"] == pytest.approx(0.25)
    # Each part's mean over the trainers that report it, from their latest reports.
    assert progress["step_time_s"] == pytest.approx(
        {"compute": 0.3, "data_wait": 0.05, "param_wait": 0.1}
    )
    assert progress["loss"] == 1.2
    assert progress["total_steps"] == 30
    assert progress["workers"] == ["w0", "w1"]
    assert job.updated_at == 4.0 and job.seq == 5 and job.state == "running"


def test_the_coordinators_totals_replace_the_sum_of_the_trainers() -> None:
    # Two trainers report their own applied samples; the coordinator reports the job's totals
    # (the same samples): the view must not add them up.
    view = fold(
        submitted("a"),
        ev("a", "planned", steps_per_epoch=10),
        ev("a", "progress", at=2.0, worker_id="w0", epoch=0, step=3, samples_trained=64,
           samples_per_second=100.0, data_wait_ratio=0.1, loss=2.5),
        ev("a", "progress", at=3.0, worker_id="w1", epoch=0, step=3, samples_trained=128,
           samples_per_second=80.0, data_wait_ratio=0.3),
        ev("a", "progress", at=4.0, worker_id="coordinator", epoch=1, step=4,
           samples_trained=192, consumed_batches=7, consumed_train_batches=6, loss=1.1),
    )  # fmt: skip
    progress = view.get("a").progress()  # type: ignore[union-attr]
    assert (progress["epoch"], progress["step"], progress["samples_trained"]) == (1, 4, 192)
    assert (progress["batches_consumed"], progress["consumed_train_batches"]) == (7, 6)
    assert progress["samples_per_second"] == pytest.approx(180.0)
    assert progress["data_wait_ratio"] == pytest.approx(0.2)
    assert progress["loss"] == 1.1
    assert progress["workers"] == ["w0", "w1"]


def test_max_steps_caps_total_steps() -> None:
    view = fold(
        submitted("a", training={"epochs": 5, "max_steps": 7}),
        ev("a", "planned", steps_per_epoch=10),
    )
    assert view.get("a").progress()["total_steps"] == 7  # type: ignore[union-attr]


def test_unusable_stage_latencies_are_left_out() -> None:
    # Field types are the codec's to check (a malformed event never decodes); the values
    # that type-check but cannot be latencies are the view's.
    view = fold(
        submitted("a"),
        ev("a", "progress", worker_id="w0",
           stage_latency_s={"compute": float("nan"), "h2d": -1.0, "read": 0.5}),
    )  # fmt: skip
    job = view.get("a")
    assert job is not None
    assert list(job.stage_percentiles()) == ["read"]


def test_epoch_results_by_epoch() -> None:
    view = fold(
        submitted("a"),
        ev("a", "epoch_completed", epoch=0, train_loss=1.0, eval_loss=0.9, eval_accuracy=0.7),
        ev("a", "epoch_completed", epoch=1, train_loss=0.5, eval_loss=0.4, eval_accuracy=0.9),
    )
    job = view.get("a")
    assert job is not None
    assert job.epochs[1] == {"train_loss": 0.5, "eval_loss": 0.4, "eval_accuracy": 0.9}
    assert sorted(job.epochs) == [0, 1] and job.seq == 3


def test_cancel_requested_is_a_flag_applied_once() -> None:
    view = fold(submitted("a"), ev("a", "running", worker_id="w"))
    job = view.apply(ev("a", "cancel_requested"))
    assert job is not None and job.cancel_requested and job.state == "running"
    assert view.apply(ev("a", "cancel_requested")) is None


def test_stage_percentiles_over_a_bounded_window() -> None:
    view = JobsView(stage_window=4)
    view.apply(submitted("a"))
    for i, latency in enumerate([9.0, 1.0, 2.0, 3.0, 4.0]):
        view.apply(ev("a", "progress", at=float(i), worker_id="w", stage_latency_s={
            "compute": latency, "queue_wait": latency / 10}))  # fmt: skip
    stages = view.get("a").stage_percentiles()  # type: ignore[union-attr]
    assert set(stages) == {"compute", "queue_wait"}
    compute = stages["compute"]
    assert compute["count"] == 4  # 9.0 fell out of the window
    assert compute["max"] == 4.0 and compute["last"] == 4.0
    assert compute["p50"] == pytest.approx(2.5)
    assert compute["p99"] == pytest.approx(3.97)


def test_an_ended_job_keeps_its_stage_percentiles_not_its_windows() -> None:
    view = JobsView(stage_window=4)
    view.apply(submitted("a"))
    for i, latency in enumerate([1.0, 2.0, 3.0, 4.0]):
        view.apply(ev("a", "progress", at=float(i), worker_id="w",
                      stage_latency_s={"compute": latency}))  # fmt: skip
    job = view.get("a")
    assert job is not None
    running = job.stage_percentiles()
    assert running["compute"]["count"] == 4 and running["compute"]["p50"] == pytest.approx(2.5)
    view.apply(ev("a", "completed", at=5.0))
    assert job.stage_samples_s == {}  # the floats of every report are gone
    assert job.stage_percentiles() == running
    # A resumed job's new reports start fresh windows, which are then what is served.
    resumed = JobResumed(job_id="a", spec=SPEC, checkpoint_version=3, incarnation=1, reason="t",
                         at=6.0)  # fmt: skip
    view.apply(resumed)
    assert job.stage_percentiles() == running
    view.apply(ev("a", "progress", at=7.0, worker_id="w", stage_latency_s={"compute": 9.0}))
    assert job.stage_percentiles()["compute"]["count"] == 1
    assert job.stage_percentiles()["compute"]["last"] == 9.0


def test_a_view_that_serves_nothing_keeps_no_windows() -> None:
    view = JobsView(serving=False)
    view.apply(submitted("a"))
    view.apply(ev("a", "progress", worker_id="w", stage_latency_s={"compute": 1.0}, loss=0.5))
    job = view.get("a")
    assert job is not None
    assert job.stage_samples_s == {} and job.stage_percentiles() == {}
    assert job.loss == 0.5 and job.progress()["workers"] == ["w"]  # the rest of the report


def test_a_view_that_serves_nothing_lets_an_ended_job_go_of_its_spec_until_a_resume() -> None:
    served, host = JobsView(), JobsView(serving=False, ended_specs=False)
    summary = {"steps": 7, "eval_accuracy": 0.9}
    events = [
        submitted("a", at=1.0), ev("a", "running", at=2.0, worker_id="w"),
        ev("a", "progress", at=3.0, worker_id="w", loss=0.5),
        CoordinatorProgress(job_id="a", at=3.5, version=7, step=7, epoch=1, samples_trained=70,
                            consumed_batches=7, consumed_train_batches=7, loss=0.4),
        ev("a", "epoch_completed", at=4.0, epoch=0, version=7, train_loss=0.5, eval_loss=0.4,
           eval_accuracy=0.9),
        ev("a", "failed", at=5.0, reason="boom", worker_id="w"),
    ]  # fmt: skip
    for event in events:
        served.apply(event)
        host.apply(event)
    kept, ended = served.get("a"), host.get("a")
    assert kept is not None and ended is not None
    assert kept.spec == SPEC and list(kept.workers) == ["w"] and kept.coordinator is not None
    assert ended.spec == {} and ended.workers == {} and ended.coordinator is None
    assert (ended.state, ended.reason, ended.name) == ("failed", "boom", "digits-cnn")
    assert ended.epochs == kept.epochs == {0: {"train_loss": 0.5, "eval_loss": 0.4,
                                              "eval_accuracy": 0.9}}  # fmt: skip
    assert host.unfinished() == []
    resumed = JobResumed(job_id="a", spec=SPEC, checkpoint_version=7, incarnation=1, reason="r",
                         at=6.0)  # fmt: skip
    host.apply(resumed)
    assert ended.state == "pending" and ended.spec == SPEC and ended.incarnation == 1
    assert [job.job_id for job in host.unfinished()] == ["a"]
    host.apply(submitted("b", at=7.0))
    host.apply(ev("b", "completed", at=8.0, worker_id="agg", summary=summary))
    done = host.get("b")
    assert done is not None and done.summary == summary and done.spec == {}


def test_percentile_interpolates() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_list_newest_first_with_filter_and_limit() -> None:
    view = fold(
        submitted("a", at=1.0), submitted("b", at=3.0), submitted("c", at=2.0),
        ev("b", "failed", reason="x"),
    )  # fmt: skip
    assert [job.job_id for job in view.list()] == ["b", "c", "a"]
    assert [job.job_id for job in view.list(state="pending")] == ["c", "a"]
    assert [job.job_id for job in view.list(limit=1)] == ["b"]
    assert view.counts_by_state()["pending"] == 2 and view.counts_by_state()["failed"] == 1


def test_unfinished_holds_every_job_not_ended_however_many_ended_after_it() -> None:
    view = fold(submitted("old", at=0.0), ev("old", "running", worker_id="w"))
    for i in range(150):  # more ended jobs than list()'s default limit, all newer
        fold(submitted(f"done{i}", at=1.0 + i), ev(f"done{i}", "failed", reason="x"), view=view)
    fold(submitted("new", at=500.0), view=view)
    assert [job.job_id for job in view.unfinished()] == ["new", "old"]
    assert "old" not in [job.job_id for job in view.list()]


def test_stage_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        JobsView(stage_window=0)


def test_a_spec_without_training_section_still_reports_progress() -> None:
    view = fold(ev("a", "submitted", spec={"name": "odd"}), ev("a", "planned", steps_per_epoch=4))
    progress = view.get("a").progress()  # type: ignore[union-attr]
    assert (progress["epochs"], progress["total_steps"]) == (0, 0)


def test_skipped_samples_are_counted_once_with_their_first_reasons() -> None:
    view = fold(
        submitted("j"),
        ev("j", "samples_skipped", shard_id="s0", sample_ids=[4, 9], reasons=["a.png: bad"]),
        ev("j", "samples_skipped", shard_id="s0", sample_ids=[4, 9], reasons=["a.png: bad"]),
        ev("j", "samples_skipped", shard_id="s3", sample_ids=[9, 12],
           reasons=["a.png: bad", "c.png: truncated"]),
    )  # fmt: skip
    job = view.get("j")
    assert job is not None and job.skipped_ids == {4, 9, 12}
    assert job.skipped_reasons == ["a.png: bad", "c.png: truncated"]
