"""The gradient plane's guarantees, proven on what the real services put on the wire.

Short digits jobs run through the real sharder, a preprocessor, two aggregators (K = 2 slices)
and two trainers, in-process against the real broker; the test captures each job's control,
batches, grads and params topics while it runs, then checks:

1. Equivalence (the slices of each step sent during its last backward pass, the default;
   the fp16 job sends them after it): replaying the StepCloses in plain single-process
   PyTorch (each contribution's batches forward/backward with the summed cross-entropy on
   the replay's own parameters of its base version, summed, divided by the close's
   num_samples, one step of a torch optimizer over ``model.parameters()`` at the close's lr)
   gives the parameters the slice owners published, at every version (sync with
   SGD+momentum and with Adam; ssp below).
2. Bounded staleness (ssp, s = 2, one trainer slowed): no applied contribution is staler than
   s, some are stale, the summary agrees, every train sample is applied exactly once, and
   the stale gradients were applied as computed on their base versions (the replay).
3. Compression: top-k (1 %, error feedback) and fp16 against dense on the same job: the
   gradient bytes on the wire, counted from the GradSlices themselves and as reported; the
   top-k run equals a single-process replay whose gradients go through each worker's own
   encoder (sparse updates weighted by samples, momentum correction on the trainers).

The jobs share one pipeline (module fixture); each job gets its own two trainers, which must
be free again right after their job completed.
"""

from __future__ import annotations

import copy
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from plane_capture import CAPTURE_TIMEOUT_S, Plane, Run
from plane_harness import assert_exactly_once, job_log, pipeline
from plane_replay import assert_replays, replay, replay_local
from torch import nn

from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import GradSlice
from conveyor.services.trainer.plane.gradients import SliceEncoder
from conveyor.training.compression import decode_slice
from conveyor.training.jobspec import JobSpec
from conveyor.training.slicing import ParamLayout, build_job_model

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": False}
ADAM = {"name": "adam", "lr": 0.004}
SPEC: dict[str, Any] = {
    "name": "digits-plane",
    "model": {"name": "small_cnn", "channels": [16, 32, 64]},
    "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.2},
    # Not the identity on purpose: the replay must normalise exactly as the trainers do.
    "preprocess": {"normalize": {"mean": [0.3], "std": [0.45]}},
    "training": {
        "epochs": 1, "global_batch_size": 64, "micro_batch_size": 32, "seed": 3,
        "optimizer": SGD,
    },
    "distribution": {"trainers": 2, "aggregator_shards": 2, "mode": "sync"},
    # One compute thread: this process also runs the broker clients and the other services.
    "resources": {"device": "cpu", "threads": 1},
    "flow": {"max_lead_batches": 24, "shard_size": 64},
}  # fmt: skip
SLOW_TRAINER_DELAY_S = 0.04
STALENESS = 2
TOPK_RATIO = 0.01


def spec_with(*, optimizer: dict[str, Any] = SGD, **distribution: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["training"]["optimizer"] = dict(optimizer)
    spec["distribution"].update(distribution)
    if spec["distribution"]["mode"] != "local":  # the replays cover the overlapped path, which
        spec["distribution"].setdefault("overlap_backward", True)  # a 94 KiB model lacks
    return spec


# Its slices leave after the whole backward; every other job sends them during the last one.
FP16_SERIAL = spec_with(compression={"kind": "fp16"}, overlap_backward=False)


@pytest.fixture(scope="module")
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    """One topic prefix for the module's jobs (each job has its own topics). Short sessions:
    the embedded broker completes a group join after half of one."""
    return KafkaSettings(
        bootstrap=kafka_bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        session_timeout_s=3.0,
        heartbeat_interval_s=1.0,
    )


@pytest.fixture(scope="module")
def process_torch_state() -> Iterator[None]:
    """Deterministic kernels for the trainers and slice owners (in this process) and the replay
    alike. One compute thread like the trainers': a thread count is per thread (OpenMP), and
    a different one changes the order of the kernels' float reductions."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plane(
    kafka: KafkaSettings, tmp_path_factory: pytest.TempPathFactory, process_torch_state: None
) -> AsyncIterator[Plane]:
    objects = tmp_path_factory.mktemp("plane") / "objects"
    # Each job's topics stay a while after it ends: the capture reads all of them, and a reader
    # still a fetch behind when they were deleted at once missed its last records.
    grace = CAPTURE_TIMEOUT_S + 5
    async with job_log(kafka) as (topics, jobs), pipeline(kafka, objects, topics_grace_s=grace):
        yield Plane(kafka, topics, jobs, objects)


# -- 1. equivalence ------------------------------------------------------------------------


OPTIMIZERS: dict[str, tuple[dict[str, Any], Callable[[list[nn.Parameter]], Any]]] = {
    "sgd": (SGD, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=False)),
    "adam": (ADAM, lambda ps: torch.optim.Adam(ps, lr=0.004)),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
async def test_sync_training_equals_a_single_process_replay_of_its_step_closes(
    plane: Plane, optimizer: str
) -> None:
    optimizer_spec, make_optimizer = OPTIMIZERS[optimizer]
    run = await plane.run(optimizer, spec_with(optimizer=optimizer_spec))

    final = run.final_version
    assert sorted(run.closes) == list(range(1, final + 1))
    assert final >= 20 and run.summary["steps"] >= 20, run.summary
    assert {close.lr for close in run.closes.values()} == {optimizer_spec["lr"]}
    assert all(e.staleness == 0 for e in run.applied())  # sync
    # The global batch: never more than 2 micro-batches a step (fewer when a trainer's batch
    # was not there within empty_contribution_wait_s, or at the epoch's odd last one).
    assert max(len(close.batch_ids) for close in run.closes.values()) == 2
    both = [
        close
        for close in run.closes.values()
        if {e.worker_id for e in close.contributions if e.num_samples > 0} == {"t-a", "t-b"}
    ]
    assert len(both) >= final // 2, "the steps were not shared by both trainers"
    assert_exactly_once(plane.objects, run.job_id, run.spec)
    assert_replays(run, make_optimizer)
    assert_stamped_in_order(run)


def assert_stamped_in_order(run: Run) -> None:
    """Every contribution with samples times its step (loadtests/plane_hops.py): its base's
    close, that version's last ParamSlice publish, its arrival, the step's start, the encoded
    gradient and the acknowledged slices follow each other (one clock: one machine)."""
    stamped = [c for c in run.contributions.values() if c.num_samples > 0 and c.base_version > 0]
    assert len(stamped) >= 10
    for c in stamped:
        published = max(run.params[(p, c.base_version)].published_at
                        for p in range(run.num_slices))  # fmt: skip
        assert c.params_published_at == published, c.contribution_id
        assert c.params_received_at is not None and c.started_at is not None, c.contribution_id
        assert c.params_published_at is not None and c.computed_at is not None, c.contribution_id
        times = [run.closes[c.base_version].closed_at, c.params_published_at,
                 c.params_received_at, c.started_at, c.computed_at, c.sent_at]  # fmt: skip
        assert times == sorted(times), (c.contribution_id, times)


# -- 2. bounded staleness ------------------------------------------------------------------


async def test_bounded_staleness_applies_nothing_staler_than_the_bound(plane: Plane) -> None:
    spec = spec_with(mode="ssp", staleness=STALENESS)
    run = await plane.run("ssp", spec, slow={"t-a": SLOW_TRAINER_DELAY_S})

    applied = run.applied()
    staleness = [int(entry.staleness) for entry in applied]
    assert staleness and max(staleness) <= STALENESS, staleness
    assert max(staleness) > 0, "no contribution was stale: the bound was never exercised"
    assert run.summary["max_staleness"] == max(staleness)
    for version, close in run.closes.items():
        assert len(close.contributions) == 1  # ssp: one contribution per version
        entry = close.contributions[0]
        # The recorded staleness is the distance from the version it was computed on.
        assert entry.staleness == version - 1 - entry.base_version
        contribution = run.contributions[entry.contribution_id]
        assert contribution.base_version == entry.base_version
        assert close.batch_ids == contribution.batch_ids
        # SGD momentum 0.9 damped by the gradient's staleness; a fresh one keeps the job's.
        expected = 0.9 / (1 + entry.staleness) if entry.staleness else None
        assert close.momentum == expected, (version, entry.staleness, close.momentum)
    assert {e.worker_id for e in applied if e.num_samples > 0} == {"t-a", "t-b"}
    print(f"ssp staleness counts {Counter(staleness)}, {len(run.rejections)} rejections")
    # A rejected contribution is never applied; its batches were recomputed and applied once.
    rejected = {r.contribution_id for r in run.rejections}
    assert not rejected & {e.contribution_id for e in applied}
    assert_exactly_once(plane.objects, run.job_id, run.spec)
    assert run.summary["epochs"] == 1
    # Each stale gradient was applied as computed: on the parameters of its base version,
    # with the close's momentum (the replay sets it as the slice owners do).
    assert_replays(run, OPTIMIZERS["sgd"][1])


# -- 3. compression ------------------------------------------------------------------------


def wire_bytes(grad: GradSlice) -> int:
    return grad.values.numel() * grad.values.element_size() + (
        grad.indices.numel() * grad.indices.element_size()
    )


def grad_bytes_by_contribution(run: Run, encoding: str) -> dict[str, int]:
    """Bytes of every contribution: reported, checked against its GradSlices when applied."""
    reported = {cid: c.grad_bytes for cid, c in run.contributions.items()}
    assert run.summary["grad_bytes_total"] == sum(reported.values())
    for entry in run.applied():
        cid = entry.contribution_id
        if entry.num_samples == 0:
            assert reported[cid] == 0  # an empty contribution sends no slice
            continue
        slices = [run.grads[(cid, p)] for p in range(run.num_slices)]
        assert {s.encoding for s in slices} == {encoding}
        assert sum(map(wire_bytes, slices)) == reported[cid]
    return reported


async def test_topk_and_fp16_cut_the_gradient_bytes_on_the_wire(plane: Plane) -> None:
    dense = await plane.run("sgd", spec_with())  # the equivalence job: compression none
    topk = await plane.run("topk", spec_with(compression={"kind": "topk", "ratio": TOPK_RATIO}))
    fp16 = await plane.run("fp16", FP16_SERIAL)

    model = build_job_model(
        JobSpec.from_dict(dense.spec),
        num_classes=dense.planned["num_classes"],
        sample_shape=dense.planned["sample_shape"],
    )
    bounds = ParamLayout.from_model(model).slice_bounds(dense.num_slices)
    numel = bounds[-1][1]
    kept = sum(math.ceil(TOPK_RATIO * (stop - start)) for start, stop in bounds)
    per_contribution = {}
    for run, encoding, expected in (
        (dense, "dense", 4 * numel),  # fp32 values
        (fp16, "fp16", 2 * numel),  # fp16 values
        (topk, "topk", 6 * kept),  # bf16 values + int32 indices of 1 % per slice
    ):
        sizes = {b for b in grad_bytes_by_contribution(run, encoding).values() if b > 0}
        assert sizes == {expected}, (encoding, sizes)
        per_contribution[encoding] = expected
        assert_exactly_once(plane.objects, run.job_id, run.spec)

    assert per_contribution["dense"] == 2 * per_contribution["fp16"]
    # At most 4 / (6 * ratio) = 66.7x: each kept element costs 6 bytes against 4 dense; the
    # ceil per slice takes a little off.
    ratio = per_contribution["dense"] / per_contribution["topk"]
    assert 60 <= ratio <= 4 / (6 * TOPK_RATIO), ratio
    # The job totals, per non-empty contribution (both jobs ran the same steps).
    for run in (dense, topk):
        assert run.summary["grad_bytes_total"] > 0
    dense_mean = dense.summary["grad_bytes_total"] / _non_empty(dense)
    topk_mean = topk.summary["grad_bytes_total"] / _non_empty(topk)
    assert dense_mean / topk_mean >= 60
    totals = {r.job_id: r.summary["grad_bytes_total"] for r in (dense, topk, fp16)}
    print(f"grad bytes per contribution {per_contribution}; job totals {totals}")
    assert_topk_replays(topk, bounds)


async def test_slices_leave_as_the_last_backward_completes_them(plane: Plane) -> None:
    """The dense job (replayed bit for bit above) sent each step's slices during its last
    backward pass: slice 1 (the layers nearest the loss) before slice 0, both before the
    gradient was whole (``computed_at``); the fp16 job, with ``overlap_backward: false``,
    after it, in slice order."""
    for run, overlapped in ((await plane.run("sgd", spec_with()), True),
                            (await plane.run("fp16", FP16_SERIAL), False)):  # fmt: skip
        checked = 0
        for contribution in run.contributions.values():
            if contribution.num_samples == 0:
                continue
            cid = contribution.contribution_id
            first, last = run.grads[(cid, 0)].sent_at, run.grads[(cid, 1)].sent_at
            computed_at = contribution.computed_at
            assert computed_at is not None
            if overlapped:
                assert last < first < computed_at, (cid, first, last, computed_at)
            else:
                assert computed_at <= first < last, (cid, first, last, computed_at)
            checked += 1
        assert checked == _non_empty(run) > 0


def assert_topk_replays(run: Run, bounds: list[tuple[int, int]]) -> None:
    """The sparse updates are weighted and applied as one process computes them: each
    worker's gradients through its own top-k encoder (error feedback, momentum correction:
    the velocity on the trainer), decoded, summed, divided by the step's samples, one SGD
    step without momentum (the aggregator's under momentum correction) at every version."""
    assert not run.rejections  # a rejection would undo an encoding (not replayed here)
    spec = JobSpec.from_dict(run.spec)
    encoders: dict[str, SliceEncoder] = {}

    def encode(worker: str, grad: torch.Tensor, samples: int) -> torch.Tensor:
        encoder = encoders.setdefault(worker, SliceEncoder.for_job(spec, bounds))
        slices = encoder.encode(grad, samples).slices
        return torch.cat([decode_slice(s.encoding, s.values, s.indices, s.numel) for s in slices])

    assert_replays(run, lambda ps: torch.optim.SGD(ps, lr=0.1), encode=encode)
    assert set(encoders) == {"t-a", "t-b"}


def _non_empty(run: Run) -> int:
    return sum(1 for c in run.contributions.values() if c.num_samples > 0)


# -- 4. local mode (DiLoCo) ----------------------------------------------------------------

INNER_SGD = {"name": "sgd", "lr": 0.1}


async def test_local_mode_of_one_inner_step_and_outer_sgd_of_lr_1_is_sync(plane: Plane) -> None:
    spec = spec_with(
        optimizer=INNER_SGD,
        mode="local",
        sync_every_steps=1,
        outer_optimizer={"name": "sgd", "lr": 1.0},
    )
    run = await plane.run("local-h1", spec)

    assert {close.lr for close in run.closes.values()} == {1.0}  # the outer lr
    windows = [c for c in run.contributions.values() if c.num_samples]
    assert windows and all(c.inner_steps == [len(c.batch_ids)] for c in windows)
    assert_exactly_once(plane.objects, run.job_id, run.spec)

    def inner_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    as_local = replay_local(run, make_inner=inner_sgd,
                            make_outer=lambda ps: torch.optim.SGD(ps, lr=1.0))  # fmt: skip
    assert_replays(run, inner_sgd, replayed=as_local)  # what local mode computes, exactly
    # Sync's algorithm on this run's closes (one SGD step at lr 0.1 on the sample-weighted mean
    # gradient of each close's contributions) gives the same parameters up to float rounding:
    # the delta p - (p - 0.1 g) is 0.1 g to within an ulp of p. One step shows the rounding
    # alone (a wrong outer lr or weighting would be off by ~0.1 g, > 1e-3); over the run it
    # grows where a ReLU's input crosses 0 under it (measured up to 3e-5 at 20 versions).
    as_sync = replay(run, inner_sgd, lr=0.1)
    assert (as_sync[1] - as_local[1]).abs().max().item() <= 1e-6
    drift = max((a - b).abs().max().item() for a, b in zip(as_sync, as_local, strict=True))
    assert drift <= 1e-3, drift


def assert_replays_local_sgd(run: Run) -> None:
    """Every version of a local-mode run of SPEC's SGD with the default outer step equals
    its in-process replay."""
    replayed = replay_local(
        run,
        make_inner=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        make_outer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.5, nesterov=True),
    )
    assert_replays(run, OPTIMIZERS["sgd"][1], replayed=replayed)


async def test_local_mode_is_inner_steps_then_an_outer_nesterov_step_at_every_version(
    plane: Plane,
) -> None:
    window = 4
    spec = spec_with(mode="local", sync_every_steps=window)  # outer: the default
    run = await plane.run("local-h4", spec)

    assert not run.rejections
    assert {close.lr for close in run.closes.values()} == {0.7}
    windows = [c.inner_steps for c in run.contributions.values() if c.num_samples]
    assert max(map(len, windows)) == window and all(len(w) <= window for w in windows)
    assert_exactly_once(plane.objects, run.job_id, run.spec)
    assert_replays_local_sgd(run)
    # One contribution per window: about 1/window of sync's versions for the same samples.
    assert run.final_version <= math.ceil(run.summary["samples"] / 64 / window) + 2


async def test_local_mode_overlapped_steps_move_onto_the_new_version_keeping_their_progress(
    plane: Plane,
) -> None:
    window, overlap = 4, 2
    spec = spec_with(mode="local", sync_every_steps=window, overlap_steps=overlap)
    run = await plane.run("local-overlap", spec)

    assert not run.rejections
    contributions = [c for c in run.contributions.values() if c.num_samples]
    carried = [c.carried_steps for c in contributions]
    # Both trainers had batches in hand while their deltas travelled (24 batches of lead).
    assert sum(1 for c in carried if c > 0) >= 2, carried
    assert all(0 <= c <= overlap for c in carried) and all(
        len(c.inner_steps) <= window for c in contributions
    )
    assert_exactly_once(plane.objects, run.job_id, run.spec)
    assert_replays_local_sgd(run)
