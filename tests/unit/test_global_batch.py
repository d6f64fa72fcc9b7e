"""``training.global_batch_size`` means the same step for any number of trainers: the
coordinator's allocation and the trainers' reading of it, folded together in lockstep over the
digits demo's plan (45 train micro-batches of 32 per epoch, global batch 64, 5 epochs)."""

from __future__ import annotations

import math

import pytest
from heartbeats import heartbeat

from conveyor.platform.messages import Contribution, sample_ids_tensor
from conveyor.services.aggregator.coordinator import Coordinator, CoordinatorConfig
from conveyor.services.aggregator.membership import allocate
from conveyor.services.trainer.plane.control import ControlState
from conveyor.training.jobspec import JobSpec
from conveyor.training.routing import shard_partitions

JOB = "digits"
EPOCHS = 5
TRAIN_BATCHES = 45  # 1438 train samples / micro-batch 32, the last one partial
T0 = 1_000.0


def spec(window: int = 1) -> JobSpec:
    """The digits demo's job; ``window`` > 1: local mode with that many inner steps."""
    local = {"mode": "local", "sync_every_steps": window} if window > 1 else {}
    return JobSpec.from_dict({
        "name": "digits",
        "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {"epochs": EPOCHS, "global_batch_size": 64, "micro_batch_size": 32,
                     "optimizer": {"name": "sgd", "lr": 0.1}},
        "distribution": local,
    })  # fmt: skip


def batch_id(epoch: int, index: int) -> str:
    return f"{JOB}:e{epoch}:train:{index // 8:05d}:b{index % 8:03d}"


def contribution(
    worker: str, sequence: int, base: int, epoch: int, batches: list[int]
) -> Contribution:
    return Contribution(
        job_id=JOB,
        contribution_id=f"{worker}:{sequence}",
        worker_id=worker,
        base_version=base,
        num_samples=len(batches),  # one sample id per batch is enough for the ledger here
        batch_ids=[batch_id(epoch, b) for b in batches],
        epoch=epoch,
        sample_ids=sample_ids_tensor(batches),
        loss_sum=float(len(batches)),
        grad_bytes=0,
        sent_at=T0,
    )


def train_in_lockstep(
    trainers: int,
    *,
    throughputs: list[float],
    first_hears_only_itself: bool = False,
    placement_known: bool = False,
    window: int = 1,
) -> tuple[list[int], list[str]]:
    """Every trainer takes what its control fold says from the batches routed to it (each
    epoch's batches spread by the coordinator's routing at the epoch's start over the
    partitions the consumer group's round robin gives it), the coordinator closes each step;
    a rejected contribution's batches go back to its trainer. Returns the micro-batches of
    every step (0: an empty one) and the rejections' reasons. ``first_hears_only_itself``:
    the first trainer starts before the others' heartbeats reach it. ``placement_known``: the
    trainers know from the schedule who else is placed on the job. ``window`` > 1: local
    mode, each contribution a window of that many inner steps of the trainer's share."""
    job = spec(window)
    partitions = max(2, 2 * trainers)  # the sharder's default topology for the job
    coordinator = Coordinator(CoordinatorConfig(
        job_id=JOB, spec=job, train_batches_per_epoch=TRAIN_BATCHES, eval_batches_per_epoch=0,
        dataset_samples=TRAIN_BATCHES, batches_partitions=partitions,
    ))  # fmt: skip
    # Named so that sorting by id differs from the partitions' order: the turns must follow
    # the partitions (what each trainer holds), not the ids.
    workers = [f"t{(i * 3) % trainers}-{i}" for i in range(trainers)]
    owned = {w: list(range(i, partitions, trainers)) for i, w in enumerate(workers)}
    owner = {p: w for w, ps in owned.items() for p in ps}
    controls = {
        w: ControlState(worker_id=w, epochs=EPOCHS, train_batches_per_epoch=TRAIN_BATCHES,
                        eval_batches_per_epoch=0, member_timeout_s=10.0)
        for w in workers
    }  # fmt: skip
    for w, rate in zip(workers, throughputs, strict=True):
        beat = heartbeat(JOB, w, at=T0, samples_per_second=rate, batches_partitions=owned[w])
        coordinator.fold(beat)
        for v, control in controls.items():
            if not (first_hears_only_itself and v == workers[0] and w != v):
                control.apply(beat)
    held: dict[str, list[int]] = {}
    routed_epoch = -1
    steps: list[int] = []
    reasons: list[str] = []
    sequence = 0
    while not coordinator.training_finished:
        if coordinator.current_epoch != routed_epoch:
            routed_epoch = coordinator.current_epoch
            routing = shard_partitions(0, TRAIN_BATCHES, coordinator.routing(T0), partitions)
            held = {w: [b for b, p in enumerate(routing) if owner[p] == w] for w in workers}
        taken: dict[str, list[int]] = {}
        for w in workers:
            control = controls[w]
            placed = workers if placement_known and not control.allocation else []
            wanted = control.micro_batches_for(job.micro_batches_per_step, T0, placed=placed)
            wanted *= window
            taken[w], held[w] = held[w][:wanted], held[w][wanted:]
            coordinator.fold(contribution(w, sequence, control.version, routed_epoch, taken[w]))
            sequence += 1
        decisions = coordinator.decide(T0)
        assert decisions.close is not None
        for rejection in decisions.rejections:
            reasons.append(rejection.reason)
            held[rejection.worker_id][:0] = taken[rejection.worker_id]
            coordinator.fold(rejection)
        coordinator.fold(decisions.close)
        for control in controls.values():
            control.apply(decisions.close)
        steps.append(len(decisions.close.batch_ids))
    return steps, reasons


@pytest.mark.parametrize(
    ("trainers", "throughputs"),
    [(1, [100.0]), (2, [100.0, 100.0]), (3, [100.0, 300.0, 50.0]), (4, [100.0] * 4)],
)
def test_any_number_of_trainers_takes_the_same_steps_of_the_global_batch(
    trainers: int, throughputs: list[float]
) -> None:
    steps, reasons = train_in_lockstep(trainers, throughputs=throughputs)
    assert reasons == []
    per_epoch = math.ceil(TRAIN_BATCHES / 2)
    # Every version takes batches, and only each epoch's last is short: no trainer is left
    # holding batches of an epoch that the others wait for.
    assert len(steps) == EPOCHS * per_epoch == 115
    assert steps == ([2] * (per_epoch - 1) + [1]) * EPOCHS
    assert sum(steps) == EPOCHS * TRAIN_BATCHES
    assert max(steps) == 2  # never more than 64 samples: the 4-trainer demo took 3-4 a step


@pytest.mark.parametrize("trainers", [2, 3, 4])
def test_a_first_step_split_on_different_views_of_the_pool_holds_the_global_batch(
    trainers: int,
) -> None:
    # Before the first allocation each trainer splits the step over the trainers it has heard
    # from: the first one, alone in its view, takes the whole step, the others their shares.
    steps, reasons = train_in_lockstep(
        trainers, throughputs=[100.0] * trainers, first_hears_only_itself=True
    )
    assert reasons == ["over the global batch"]  # the others split 2 over all: one takes 1
    assert steps[0] == 2 and max(steps) == 2  # without the cap: 3 (the demo's 114 steps)
    assert sum(steps) == EPOCHS * TRAIN_BATCHES
    assert EPOCHS * math.ceil(TRAIN_BATCHES / 2) <= len(steps) <= EPOCHS * 23 + 1


@pytest.mark.parametrize("trainers", [2, 4])
def test_a_first_local_window_split_on_different_views_of_the_pool_holds_the_global_batch(
    trainers: int,
) -> None:
    # The same blind first split in local mode: the first trainer's window of 8 inner steps
    # of the whole step (16 micro-batches) beside the others' 8 steps of their shares.
    steps, reasons = train_in_lockstep(
        trainers, throughputs=[100.0] * trainers, first_hears_only_itself=True, window=8
    )
    assert reasons == ["over the global batch"]
    assert max(steps) == 16  # without the cap: 24 (2 trainers), 20 (4)
    assert sum(steps) == EPOCHS * TRAIN_BATCHES


@pytest.mark.parametrize(("trainers", "window"), [(2, 1), (3, 1), (4, 1), (2, 8), (4, 8)])
def test_a_first_split_that_counts_the_placed_trainers_needs_no_rejection(
    trainers: int, window: int
) -> None:
    # What the trainers do: the first one has heard no other heartbeat yet, but the schedule
    # (the jobs topic) tells it who else is placed on the job, so its share is theirs.
    steps, reasons = train_in_lockstep(
        trainers, throughputs=[100.0] * trainers, first_hears_only_itself=True,
        placement_known=True, window=window,
    )  # fmt: skip
    assert reasons == []
    per_epoch = [2] * 22 + [1] if window == 1 else [16, 16, 13] if trainers == 2 else [16, 16, 7, 6]
    assert steps == per_epoch * EPOCHS


@pytest.mark.parametrize(
    ("trainers", "epoch_windows"),
    # Four trainers take turns by window, two of them (1 micro-batch each) per inner step, so
    # the end of an epoch's batches falls to two turns.
    [(1, [16, 16, 13]), (2, [16, 16, 13]), (4, [16, 16, 7, 6])],
)
def test_local_windows_hold_the_same_global_batches_for_any_number_of_trainers(
    trainers: int, epoch_windows: list[int]
) -> None:
    steps, reasons = train_in_lockstep(trainers, throughputs=[100.0] * trainers, window=8)
    assert reasons == []
    assert steps == epoch_windows * EPOCHS


def test_more_trainers_than_micro_batches_take_turns() -> None:
    rates = {"a": 5.0, "b": 9.0, "c": 1.0, "d": 2.0, "e": 3.0}
    turns = [allocate(rates, 2, turn=t) for t in range(5)]
    assert all(sum(counts.values()) == 2 and set(counts.values()) <= {0, 1} for counts in turns)
    assert turns[0] == {"a": 1, "b": 1, "c": 0, "d": 0, "e": 0}
    assert turns[1] == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 0}
    assert turns[2] == {"a": 1, "b": 0, "c": 0, "d": 0, "e": 1}
    # every trainer gets its turn within ceil(5 / 2) steps
    for start in range(3):
        served = {w for counts in turns[start : start + 3] for w, n in counts.items() if n}
        assert served == set(rates)
