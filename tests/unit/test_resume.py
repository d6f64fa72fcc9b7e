"""Resuming a job from a checkpoint, as pure folds: the coordinator's progress snapshot through a
slice file and back, and every fold of the control log (coordinator, trainer, checkpointer)
started from a ResumePoint ends where the straight run ends; the sharder releases only the
tasks with batches left; the job view revives a resumed job; the registry of live jobs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from coordinator_cases import JOB, SAMPLES, T0, batch, beat, contrib, echo
from test_checkpoint_triggers import job_spec

from conveyor.platform.config import StorageSettings
from conveyor.platform.messages import (
    EndedEpoch,
    EvalResult,
    JobCancelled,
    JobResumed,
    JobSubmitted,
    Message,
    ResumePoint,
    SliceSaved,
    StepClose,
)
from conveyor.platform.storage import open_store
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig
from conveyor.services.checkpointer.book import CheckpointBook
from conveyor.services.checkpointer.registry import (
    JobRegistry,
    RegistryEntry,
    recovery_event,
    registry_changes,
)
from conveyor.services.sharder.flow import RemainingSequence, batches_done, remaining_tasks
from conveyor.services.trainer.plane.control import ControlState
from conveyor.training.checkpoint import (
    CheckpointStore,
    DataCursor,
    JobProgress,
    Manifest,
    SliceState,
)
from conveyor.training.checkpoint.slicefile import decode_slice, encode_slice
from conveyor.training.checkpoint.slicehead import read_slice_head
from conveyor.training.jobview import JobsView
from conveyor.training.plan import JobPlan

TRAIN, EVAL = 12, 1  # batches per epoch: 3 steps of 4, one eval batch


def coordinator() -> Coordinator:
    return Coordinator(CoordinatorConfig(
        job_id=JOB, spec=job_spec(every_steps=1), train_batches_per_epoch=TRAIN,
        eval_batches_per_epoch=EVAL, dataset_samples=SAMPLES,
    ))  # fmt: skip


def step(c: Coordinator, version: int) -> list[Message]:
    """The log of step ``version + 1`` (one trainer, four fresh batches; epoch 0's eval right
    after the close that ends it), folded into ``c``."""
    epoch, first = divmod(4 * version, TRAIN)
    # A loss of its own per step (1/3 has no short binary form: a lossy copy would show).
    loss = 2.0 + version / 3
    contribution = contrib("a", version, [batch(epoch, first + i) for i in range(4)], loss=loss)
    c.fold(contribution)
    decisions = c.decide(T0)
    assert decisions.close is not None
    echo(c, decisions)
    log: list[Message] = [contribution, decisions.close]
    for ended in (e for e, v in c.epochs.end_version.items() if v == decisions.close.version):
        log.append(EvalResult(job_id=JOB, worker_id="a", epoch=ended, version=c.version,
                              batch_ids=[batch(ended, 0, "eval")], loss_sum=2.0, correct=3,
                              num_samples=4))  # fmt: skip
        c.fold(log[-1])
    return log


def through_a_file(progress: JobProgress) -> JobProgress:
    """What a resume reads back: the progress inside slice 0's safetensors file."""
    state = SliceState(slice_index=0, version=progress.version, values=torch.zeros(3),
                       optimizer={}, grads_offset=7, progress=progress)  # fmt: skip
    loaded = decode_slice(encode_slice(JOB, state)).progress
    assert loaded is not None
    return loaded


def straight_run() -> tuple[Coordinator, list[list[Message]]]:
    c = coordinator()
    c.fold(beat("a", T0))
    return c, [step(c, version) for version in range(6)]


@pytest.mark.parametrize("resume_at", [3, 4, 5])
def test_a_coordinator_resumed_from_a_checkpoint_ends_like_the_straight_run(resume_at: int) -> None:
    straight, logs = straight_run()
    snapshot = coordinator()
    snapshot.fold(beat("a", T0))
    for log in logs[:resume_at]:
        for message in log:
            snapshot.fold(message)
    progress = through_a_file(snapshot.progress_at[resume_at])
    assert progress.usable  # epoch 0 ended at v3 and was evaluated right after
    point = progress.resume_point(JOB)

    resumed = coordinator()
    resumed.resume(point, progress)
    resumed.fold(beat("a", T0))
    for ended in (e for e in point.ended_epochs if not e.evaluated):  # at v3: evaluated again
        assert (ended.epoch, ended.version) == (0, resume_at)
        resumed.fold(next(m for m in logs[2] if isinstance(m, EvalResult)))
    for log in logs[resume_at:]:  # the same contributions, decided again by the new fold
        for message in log:
            if isinstance(message, StepClose):
                decisions = resumed.decide(T0)
                assert decisions.close is not None and decisions.close.version == message.version
                assert decisions.close.batch_ids == message.batch_ids
                echo(resumed, decisions)
            else:
                resumed.fold(message)
    assert resumed.finished and straight.finished
    assert (resumed.version, resumed.steps, resumed.samples_trained) == (
        straight.version, straight.steps, straight.samples_trained,
    )  # fmt: skip
    assert resumed.ledger == straight.ledger and resumed.ledger.total(1) == TRAIN
    # Every step's loss, the ones before the checkpoint from its file, bit for bit.
    assert resumed.step_losses == straight.step_losses == [2.0 + v / 3 for v in range(6)]
    assert resumed.epochs.results() == straight.epochs.results()
    assert resumed.consumed_batches == straight.consumed_batches == 2 * (TRAIN + EVAL)


def test_a_checkpoint_after_an_unevaluated_epoch_end_is_not_usable() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    for version in range(4):  # epoch 0 ends at v3; its eval never comes
        epoch, first = divmod(4 * version, TRAIN)
        c.fold(contrib("a", version, [batch(epoch, first + i) for i in range(4)]))
        echo(c, c.decide(T0))
    at_end, after = c.progress_at[3], c.progress_at[4]
    assert at_end.usable and not after.usable  # at v3 the trainers evaluate epoch 0 again
    assert at_end.resume_point(JOB).ended_epochs == [EndedEpoch(epoch=0, version=3,
                                                                evaluated=False)]  # fmt: skip
    with pytest.raises(ValueError, match="evaluation is missing"):
        after.resume_point(JOB)
    c.fold(SliceSaved(job_id=JOB, version=3, slice_index=1, key="k", size_bytes=1, sha256="",
                      grads_offset=0))  # fmt: skip
    assert 3 in c.progress_at  # only slice 0's file carries it
    c.fold(SliceSaved(job_id=JOB, version=3, slice_index=0, key="k", size_bytes=1, sha256="",
                      grads_offset=0))  # fmt: skip
    assert 3 not in c.progress_at


def test_the_trainer_and_checkpointer_folds_start_from_the_resume_point() -> None:
    _, logs = straight_run()
    snapshot = coordinator()
    snapshot.fold(beat("a", T0))
    for log in logs[:4]:
        for message in log:
            snapshot.fold(message)
    point = snapshot.progress_at[4].resume_point(JOB)
    assert point.applied_batches == [batch(1, i) for i in range(4)]

    def control() -> ControlState:
        return ControlState(worker_id="a", epochs=2, train_batches_per_epoch=TRAIN,
                            eval_batches_per_epoch=EVAL, member_timeout_s=10.0)  # fmt: skip

    def book() -> CheckpointBook:
        return CheckpointBook(job_id=JOB, num_slices=2, train_batches_per_epoch=TRAIN,
                              started_at=T0)  # fmt: skip

    straight, resumed = (control(), book()), (control(), book())
    for log in logs[:5]:
        for message in log:
            straight[0].apply(message)
            straight[1].fold(message)
    resumed[0].apply(point)
    resumed[1].fold(point)
    assert (resumed[0].version, resumed[0].epoch_end) == (4, {0: 3})
    assert resumed[0].eval_done(0) and not resumed[0].is_applied(batch(1, 4), 1)
    assert resumed[0].is_done(batch(0, 0, "eval"), 0, "eval")
    for message in logs[4]:
        resumed[0].apply(message)
        resumed[1].fold(message)
    assert (resumed[0].version, resumed[0].steps, resumed[0].applied_train_batches) == (
        straight[0].version, straight[0].steps, straight[0].applied_train_batches,
    )  # fmt: skip
    assert resumed[0].train_left(1) == straight[0].train_left(1) == 4
    assert resumed[1].cursors[5] == straight[1].cursors[5]


def test_a_resumed_job_releases_only_the_tasks_with_batches_left() -> None:
    plan = JobPlan(job_id=JOB, num_samples=100, eval_fraction=0.2, seed=0, epochs=2,
                   micro_batch_size=5, shard_size=20)  # fmt: skip
    # 80 train samples: 4 train tasks of 4 batches an epoch, then one eval task of 4.
    assert (plan.tasks_per_epoch, plan.train_batches_per_epoch) == (5, 16)
    first = plan.task(5)  # epoch 1's first train task: 3 of its 4 batches applied
    applied = [f"{first.shard_id}:b{b:03d}" for b in range(3)]
    point = ResumePoint(job_id=JOB, version=9, steps=9, samples_trained=95,
                        ended_epochs=[EndedEpoch(epoch=0, version=8, evaluated=True)],
                        applied_batches=applied)  # fmt: skip
    assert remaining_tasks(plan, point) == [(5, 1), (6, 4), (7, 4), (8, 4), (9, 4)]
    assert batches_done(plan, point) == 16 + 4 + 3
    sequence = RemainingSequence(remaining_tasks(plan, point))
    assert [sequence.batches_before(k) for k in range(6)] == [0, 1, 5, 9, 13, 17]
    assert [sequence.first_unconsumed_task(n) for n in (0, 1, 4, 5, 17)] == [0, 1, 1, 2, 5]
    ended_here = ResumePoint(job_id=JOB, version=8, steps=8, samples_trained=80,
                             ended_epochs=[EndedEpoch(epoch=0, version=8, evaluated=False)],
                             applied_batches=[])  # fmt: skip
    assert [k for k, _ in remaining_tasks(plan, ended_here)] == [4, 5, 6, 7, 8, 9]


def test_the_job_view_revives_a_resumed_job_and_ignores_a_running_one() -> None:
    view = JobsView()
    spec = {"name": "r", "training": {"epochs": 2}}
    view.apply(JobSubmitted(job_id=JOB, spec=spec, at=T0))
    resumed = JobResumed(job_id=JOB, spec=spec, checkpoint_version=4, incarnation=1,
                         reason="test", at=T0 + 2)  # fmt: skip
    assert view.apply(resumed) is None  # pending: nothing to resume
    view.apply(JobCancelled(job_id=JOB, reason="cancel requested", at=T0 + 1))
    job = view.apply(resumed)
    assert job is not None and (job.state, job.incarnation, job.resumed_from) == (
        "pending", 1, 4,
    )  # fmt: skip
    assert job.reason is None and not job.cancel_requested and not job.terminal
    other = JobResumed(job_id="lost", spec=spec, checkpoint_version=2, incarnation=3,
                       reason="test", at=T0)  # fmt: skip
    created = view.apply(other)  # a job the view never saw (its jobs topic was lost)
    assert created is not None and (created.state, created.incarnation) == ("pending", 3)


def test_the_registry_tracks_live_jobs_and_brings_back_lost_ones(tmp_path: Path) -> None:
    view = JobsView()
    spec = {"name": "r", "training": {"epochs": 2}}
    for job_id in ("live", "ended"):
        view.apply(JobSubmitted(job_id=job_id, spec=spec, at=T0))
    view.apply(JobCancelled(job_id="ended", reason="cancel requested", at=T0))
    registry = JobRegistry(open_store(f"file://{tmp_path}", StorageSettings(uri="file:///")))
    for job_id in ("ended", "lost"):
        registry.write(RegistryEntry(job_id=job_id, spec=spec, incarnation=2))
    changes = registry_changes(view, registry.entries())
    assert changes.write == [RegistryEntry(job_id="live", spec=spec, incarnation=0)]
    assert changes.delete == ["ended"]
    assert [e.job_id for e in changes.lost] == ["lost"]

    lost = changes.lost[0]
    checkpoints = CheckpointStore(registry.store, "lost")
    recovered = recovery_event(lost, checkpoints)
    assert recovered.at == pytest.approx(time.time(), abs=60)
    assert recovered == JobSubmitted(job_id="lost", spec=spec, at=recovered.at)  # from the start
    progress = coordinator().progress()
    progress.version = 7
    entry = checkpoints.write_slice(
        SliceState(
            slice_index=0,
            version=7,
            values=torch.zeros(2),
            optimizer={},
            grads_offset=0,
            progress=progress,
        )
    )
    checkpoints.commit(Manifest(job_id="lost", version=7, step=7, trigger="every_steps",
                                created_at=T0, files=[entry], data_cursor=DataCursor(epoch=0),
                                rng={}, spec=spec, model={}))  # fmt: skip
    event = recovery_event(lost, checkpoints)
    assert isinstance(event, JobResumed)
    assert (event.checkpoint_version, event.incarnation) == (7, 3)


def test_a_slice_files_head_reads_without_torch_what_the_full_read_does(tmp_path: Path) -> None:
    """The checkpointer commits a job's final checkpoint from the files in the store by their
    heads (:func:`read_slice_head`): the same identity and progress as :func:`decode_slice`,
    in a process that never imports torch; a torn file is refused."""
    straight, _ = straight_run()
    progress = straight.progress_at[6]
    state = SliceState(slice_index=0, version=6, values=torch.zeros(3), optimizer={},
                       grads_offset=7, progress=progress)  # fmt: skip
    data = bytes(encode_slice(JOB, state))
    full = decode_slice(data)
    head = read_slice_head(data)
    assert (head.slice_index, head.version, head.grads_offset) == (0, 6, 7)
    assert head.progress == full.progress
    assert head.progress is not None and head.progress.step_losses == straight.step_losses
    with pytest.raises(ValueError, match="not a slice state file"):
        read_slice_head(data[: len(data) // 2])

    path = tmp_path / "slice-0.safetensors"
    path.write_bytes(data)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from conveyor.training.checkpoint.slicehead import read_slice_head\n"
        f"head = read_slice_head(Path({str(path)!r}).read_bytes())\n"
        "assert head.progress is not None\n"
        "print(head.version, head.progress.steps, 'torch' in sys.modules)\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert ran.stdout.split() == ["6", str(progress.steps), "False"]
