"""Checkpoints under fire: the checkpointer and the aggregators SIGKILLed at random points of a
job that checkpoints every step, each replaced at once (what a supervisor does); then resumes,
through the API and after the whole stack was killed, and bit-exact resume (a deterministic job
killed twice with the whole stack ends as the same job run straight through).

No torn checkpoint may ever count as committed: every checkpoint with a manifest must load with
all its files verified, the latest good one is the job's end, retention kept what it should,
every slice that moved was rebuilt with its exact optimizer state (the log says so), and the
ledger is exactly once.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_stack import (
    RunningStack,
    conveyor,
    digits_spec,
    running_stack,
    wait_checkpoint_committed,
    wait_for,
)
from ledger_check import assert_exactly_once
from safetensors.torch import load as load_tensors

from conveyor.cli.client import TERMINAL_STATES, GatewayError
from conveyor.embedded.procs import ProcessInfo, is_alive
from conveyor.embedded.state import ServiceInfo, load_state
from conveyor.training.checkpoint import CheckpointStore
from conveyor.training.checkpoint.resume import resume_point
from conveyor.training.exported import MODEL_FILES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

KILLS = 10
KEEP_LAST = 2
STACK_ARGS = ["--scale", "aggregator=2", "--scale", "trainer=2", "--health-timeout-s", "180"]
"""Two trainers: the bit-exact test runs its SGD and Adam jobs side by side."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with running_stack(
        tmp_path_factory.mktemp("checkpoints") / "state",
        args=STACK_ARGS,
    ) as running:
        yield running


def kill(info: ServiceInfo) -> None:
    os.kill(info.process.pid, signal.SIGKILL)
    wait_for(lambda: not is_alive(info.process), timeout_s=10, what=f"{info.name} to die")


CHAOS_EPOCHS = 3


def test_kills_during_checkpoint_writes_never_leave_a_torn_checkpoint_loadable(
    stack: RunningStack,
) -> None:
    seed = int(os.environ.get("CONVEYOR_CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"chaos seed {seed} (set CONVEYOR_CHAOS_SEED to replay)")
    spec = digits_spec(
        "checkpoint-chaos",
        # Three epochs: on a quiet machine two ended before the third kill in one run of ten.
        epochs=CHAOS_EPOCHS,
        distribution={"aggregator_shards": 2},
        checkpoint={"every_steps": 1, "keep_last": KEEP_LAST},
    )
    spec["training"]["optimizer"] = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    job_id = stack.submit(spec)
    envs = {kind: stack.environ_of(name) for kind, name in
            (("checkpointer", "checkpointer"), ("aggregator", "aggregator-1"))}  # fmt: skip
    live: dict[str, list[ServiceInfo]] = {
        "checkpointer": [stack.service("checkpointer")],
        "aggregator": [stack.service("aggregator-1"), stack.service("aggregator-2")],
    }
    # The kills start once the job trains (a checkpoint is committed): on a quiet machine the
    # job trains its 69 steps in seconds, and kills before its slices were served tested nothing.
    wait_for(lambda: bool(CheckpointStore(stack.store(), job_id).committed_versions()),
             timeout_s=120, what="the job's first checkpoint")  # fmt: skip
    kills: list[str] = []
    # The kinds alternate (the first at random), so that any two kills hit both: a free draw
    # per kill chose only checkpointers for all 9 kills of a clean-clone run (seed 7552; 25 seeds in
    # 10,000 do), and no aggregator restored a slice.
    kinds = ["checkpointer", "aggregator"]
    rng.shuffle(kinds)
    for n in range(KILLS):
        time.sleep(rng.uniform(0.2, 1.0))
        if stack.job(job_id)["state"] in TERMINAL_STATES:
            break
        kind = kinds[n % 2]
        victim = live[kind].pop(rng.randrange(len(live[kind])))
        kill(victim)
        kills.append(victim.name)
        live[kind].append(stack.start_extra(f"{kind}-r{n}", kind, envs[kind]))
    assert len(kills) >= 3, f"the job ended after {len(kills)} kills: nothing was tested"

    job = stack.wait_job(job_id, timeout_s=240)
    assert job["state"] == "completed", job.get("reason")
    assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=CHAOS_EPOCHS)
    final = job["summary"]["versions"]
    # The job turns completed once its last checkpoint is saved; its commit and the retention
    # that clears the leftovers come after.
    wait_checkpoint_committed(stack.state_dir, job_id, final)

    checkpoints = CheckpointStore(stack.store(), job_id)
    committed = checkpoints.committed_versions()
    assert committed[0] == final and len(committed) <= KEEP_LAST, committed
    for version in committed:  # a manifest means every file it lists is there, intact
        manifest = checkpoints.read_manifest(version)
        assert [checkpoints.read_slice(f).version for f in manifest.files] == [version] * 2
    latest, _, skipped = checkpoints.latest_good()
    assert latest is not None and latest.version == final and not skipped
    torn = [r.version for r in checkpoints.listing() if r.state == "incomplete"]
    print(f"kills: {kills}; committed {committed}; incomplete leftovers {torn}")
    assert torn == []  # leftovers of killed writers are cleared by the next commit's retention

    logs = "".join(Path(p).read_text() for p in (stack.state_dir / "logs").glob("aggregator*.log"))
    restores = re.findall(
        rf"job {job_id}: slice \d+ restored at version (\d+) .*\(optimizer state (\w+)\)", logs
    )
    assert restores and {state for _, state in restores} == {"exact"}, restores
    # Recorded services were killed (the stack is not "healthy"): name the gateway.
    gateway = str(stack.state.gateway_url)
    listed = conveyor("checkpoints", job_id, "--gateway", gateway, "--json", env=stack.env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert (rows[0]["version"], rows[0]["state"], rows[0]["latest"]) == (final, "committed", True)


def restart(stack: RunningStack) -> RunningStack:
    """`conveyor up` again in the stack's state directory (after :func:`kill_everything`)."""
    up = conveyor("up", "--state-dir", str(stack.state_dir), "--json", *STACK_ARGS, env=stack.env)
    assert up.returncode == 0, up.stderr
    return RunningStack(state_dir=stack.state_dir, env=stack.env, storage=stack.storage)


def kill_everything(stack: RunningStack) -> None:
    """SIGKILL every process of the stack, the broker (it held every topic in memory) and the
    processes the tests added included; the supervisor (recorded last) first, so that it
    restarts nothing meanwhile, and as recorded now (it may have replaced a process)."""
    state = load_state(stack.state_dir)
    assert state is not None and state.broker is not None
    processes = [s.process for s in reversed(state.services)] + [
        ProcessInfo.of(process.pid, stack.state_dir / "logs" / f"{name}.log")
        for name, process in stack.extra
        if process.poll() is None
    ]
    processes.append(state.broker)
    for process in processes:
        if is_alive(process):
            os.kill(process.pid, signal.SIGKILL)
    for process in processes:

        def gone(p: ProcessInfo = process) -> bool:
            return not is_alive(p)

        wait_for(gone, timeout_s=10, what=f"pid {process.pid} gone")
    stack.gateway.close()


OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "adam": {"name": "adam", "lr": 0.004},
}


EXACT_STEPS = 45
"""Steps of :func:`exact_spec`'s job: enough that it still runs at both kills on a fast
machine (it trains on while the first kill waits for the other job's checkpoint)."""


def exact_spec(optimizer: str) -> dict[str, Any]:
    """One epoch of digits in 45 steps of two micro-batches of 16, deterministic, a checkpoint
    every 4 steps."""
    spec = digits_spec(
        f"exact-{optimizer}",
        epochs=1,
        distribution={"trainers": 1, "aggregator_shards": 2, "deterministic": True},
        checkpoint={"every_steps": 4, "keep_last": 2},
    )
    spec["training"].update(
        optimizer=OPTIMIZERS[optimizer], global_batch_size=32, micro_batch_size=16
    )
    return spec


def newest_checkpoint(stack: RunningStack, job_id: str) -> int:
    return max(CheckpointStore(stack.store(), job_id).committed_versions(), default=0)


def wait_past_checkpoints(
    stack: RunningStack, after: dict[str, int], rng: random.Random, *, room: int
) -> None:
    """Until each job has committed a checkpoint 4 or 8 steps (at random) past ``after`` (its
    newest one at the last kill), or one of them is within ``room`` + 8 steps of its end: the
    jobs share the stack's preprocessors and need not train at the same pace, and a kill must
    come while they still train."""
    targets = {job_id: last + rng.choice([4, 8]) for job_id, last in after.items()}

    def due() -> bool:
        newest = {job_id: newest_checkpoint(stack, job_id) for job_id in targets}
        near_end = max(newest.values()) >= EXACT_STEPS - room - 8
        return near_end or all(newest[j] >= at for j, at in targets.items())

    wait_for(due, timeout_s=180, what=f"checkpoints {targets}")


def kill_mid_run(stack: RunningStack, job_ids: Iterable[str], rng: random.Random) -> dict[str, int]:
    """Wait up to 0.5 s and kill the whole stack while a job still trains; returns each job's
    newest checkpoint. (That every job was killed mid-run and resumed is checked at the end:
    each completes with ``resumed_from`` set.)"""
    time.sleep(rng.uniform(0.0, 0.5))
    newest = {job_id: newest_checkpoint(stack, job_id) for job_id in job_ids}
    assert min(newest.values()) < EXACT_STEPS, f"every job ended before the kill: {newest}"
    kill_everything(stack)
    print(f"killed the whole stack past checkpoints {sorted(newest.values())}")
    return newest


Exported = tuple[dict[str, torch.Tensor], list[float]]


def exported(stack: RunningStack, job_id: str) -> Exported:
    """The job's exported weights and per-step losses, as `conveyor model pull` gets them
    (through the gateway, which knows the job until the stack is killed)."""
    files = {name: stack.gateway.model_file(job_id, name) for name in MODEL_FILES}
    losses: list[float] = json.loads(files["losses.json"])["step_losses"]
    return load_tensors(files["model.safetensors"]), losses


def assert_bit_exact(
    stack: RunningStack, straight: dict[str, Exported], killed: dict[str, str]
) -> None:
    """Each optimizer's killed job ended as its straight run: exported parameters equal bit
    for bit, every step's loss equal, the ledger exactly once."""
    # After a whole-stack kill the gateway knows a job again once the checkpointer has put it
    # back on the jobs topic from its registry: until then it answers 404.
    wait_for(lambda: set(killed.values()) <= {j["id"] for j in stack.gateway.jobs(limit=10)},
             timeout_s=60, what="the killed jobs to come back by themselves")  # fmt: skip
    for name, job_id in killed.items():
        job = stack.wait_job(job_id, timeout_s=180)
        assert job["state"] == "completed" and job["resumed_from"] is not None, job
        assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=1)
        weights, losses = straight[name]
        weights_killed, losses_killed = exported(stack, job_id)
        assert len(losses) == job["plan"]["steps_per_epoch"] == job["summary"]["steps"]
        assert losses_killed == losses, f"{name}: step losses differ"
        assert weights.keys() == weights_killed.keys()
        differing = [k for k in weights if not torch.equal(weights[k], weights_killed[k])]
        assert differing == [], f"{name}: parameters differ in {differing}"
    sgd, adam = (straight[name][1] for name in OPTIMIZERS)
    assert sgd != adam and sgd[-1] < sgd[0] and adam[-1] < adam[0]  # two real trainings


def test_a_job_cancelled_resumed_and_killed_with_the_whole_stack_completes_exactly_once(
    stack: RunningStack,
) -> None:
    """Resume through the API, then the whole stack killed and started again: the job comes
    back by itself. One job for both (suite time): what must hold at the end is what an
    uninterrupted run gives, the step count and each train sample once per epoch."""
    epochs = 2
    # A lead over the whole job (116 batches): every task is released at once, and the first
    # epoch must still be evaluated before the job's end, or no checkpoint of the second epoch
    # is usable. Whether the preprocessor's fetches then see the tasks a partition at a time
    # depends on timing (this once failed so, and passes without the fix too): the order is
    # checked deterministically in tests/integration/test_preprocessor.py.
    spec = digits_spec("resume", epochs=epochs, checkpoint={"every_steps": 5, "keep_last": 3},
                       flow={"max_lead_batches": 128})  # fmt: skip
    job_id = stack.submit(spec)
    with pytest.raises(GatewayError) as running:
        stack.gateway.resume(job_id)
    assert running.value.status_code == 409 and "only a failed or cancelled" in str(running.value)
    checkpoints = CheckpointStore(stack.store(), job_id)
    # Cancelled in its second epoch (23 steps an epoch), after a usable checkpoint there (one
    # written before the first epoch's evaluation was in is not: the resume skips it).
    wait_for(lambda: _newest_usable(checkpoints) >= 25, timeout_s=120,
             what="a usable checkpoint in the second epoch")  # fmt: skip
    stack.gateway.cancel(job_id)
    assert stack.wait_job(job_id)["state"] == "cancelled"

    gateway = str(stack.state.gateway_url)
    resumed = conveyor("resume", job_id, "--gateway", gateway, env=stack.env)
    assert resumed.returncode == 0, resumed.stderr
    found = re.fullmatch(rf"job {job_id} resumed from checkpoint v(\d+)\n", resumed.stdout)
    assert found is not None, resumed.stdout
    version = int(found[1])
    assert version >= 25, version  # the newest usable one
    wait_for(lambda: max(checkpoints.committed_versions()) >= version + 5, timeout_s=120,
             what="a checkpoint of the resumed run")  # fmt: skip

    kill_everything(stack)
    again = restart(stack)
    try:
        wait_for(lambda: job_id in {j["id"] for j in again.gateway.jobs(limit=10)},
                 timeout_s=60, what="the job to come back by itself")  # fmt: skip
        job = again.wait_job(job_id, timeout_s=180)
        assert job["state"] == "completed", job.get("reason")
        # The newest *usable* checkpoint: a later one whose ended epoch's eval it lacks is not,
        # so on a fast machine this can be the first resume's own checkpoint again.
        assert job["resumed_from"] >= version, (job["resumed_from"], version)
        summary = job["summary"]
        assert summary["steps"] == job["plan"]["steps_per_epoch"] * epochs, summary
        assert summary["epochs"] == epochs
        assert_exactly_once(again.ledger(job_id), again.train_ids(job), epochs=epochs)

        with pytest.raises(GatewayError) as completed:
            again.gateway.resume(job_id)
        assert completed.value.status_code == 409
        with pytest.raises(GatewayError) as unknown:
            again.gateway.resume("no-such-job")
        assert unknown.value.status_code == 404
        failed = again.submit(digits_spec("resume-nothing", dataset={"uri": "builtin://nope"}))
        assert again.wait_job(failed)["state"] == "failed"
        with pytest.raises(GatewayError) as nothing:
            again.gateway.resume(failed)
        assert nothing.value.status_code == 409 and "no checkpoint" in str(nothing.value)
        wait_for(lambda: not again.store().list("registry/jobs/"), timeout_s=10,
                 what="the registry to forget the ended jobs")  # fmt: skip
    finally:
        again.gateway.close()


def _newest_usable(checkpoints: CheckpointStore) -> int:
    progress, _ = resume_point(checkpoints)
    return progress.version if progress is not None else 0


def test_deterministic_jobs_killed_twice_with_the_whole_stack_end_bit_exact(
    stack: RunningStack,
) -> None:
    """SGD with momentum and Adam, each a deterministic job run straight through, then the
    same specs run while the whole stack (broker included) is SIGKILLed twice at random points
    past random checkpoints and comes back by itself: the exported parameters are equal bit for
    bit, and so is every step's loss, as the trainers computed it."""
    seed = int(os.environ.get("CONVEYOR_CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"exact seed {seed} (set CONVEYOR_CHAOS_SEED to replay)")
    current = RunningStack(state_dir=stack.state_dir, env=stack.env, storage=stack.storage)
    try:
        straight = {name: current.submit(exact_spec(name)) for name in OPTIMIZERS}
        for straight_id in straight.values():
            assert current.wait_job(straight_id, timeout_s=120)["state"] == "completed"
        straight_runs = {name: exported(current, job_id) for name, job_id in straight.items()}
        killed = {name: current.submit(exact_spec(name)) for name in OPTIMIZERS}
        newest = dict.fromkeys(killed.values(), 0)
        for room in (16, 0):  # the first kill leaves room for the second
            wait_past_checkpoints(current, newest, rng, room=room)
            newest = kill_mid_run(current, killed.values(), rng)
            current = restart(current)
        assert_bit_exact(current, straight_runs, killed)
    finally:
        current.gateway.close()
