"""The soak and chaos run: jobs one after another on one stack while a service is killed at a
random moment of every job but the first; each job is checked exactly once from its ledger, the
stack must come back whole after each, and the memory every process holds is followed job by
job.

In the suite it runs its short form (2 jobs, a kill in the second). The long form is a
documented command (docs/operations.md, "Soak and chaos runs"), for example::

    CONVEYOR_SOAK_JOBS=30 .venv/bin/pytest tests/e2e/test_soak.py -s

``CONVEYOR_CHAOS_SEED`` replays a run's kills; ``CONVEYOR_SOAK_KILLS=0`` runs the jobs without
kills (a leak soak only). From ``LEAK_CHECK_MIN_JOBS`` jobs on, the resident memory of every
process that lived through the second half of the run must grow less than
``LEAK_LIMIT_BYTES_PER_JOB`` a job over that half; every run prints the figures as one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_stack import RunningStack, digits_spec, list_topics, running_stack, wait_for
from ledger_check import assert_exactly_once

from conveyor.cli.client import TERMINAL_STATES, GatewayError
from conveyor.embedded.procs import is_alive
from conveyor.embedded.state import ServiceInfo, load_state

SOAK_JOBS = int(os.environ.get("CONVEYOR_SOAK_JOBS", "2"))
KILLS = os.environ.get("CONVEYOR_SOAK_KILLS", "1") != "0"
EPOCHS = 2
SPREAD = {"trainers": 2, "aggregator_shards": 2}
"""Every job on both trainers and both aggregators, so that each kill hits a process at work."""
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120 + 60 * SOAK_JOBS)]
VICTIMS = ("trainer-1", "trainer-2", "aggregator-1", "aggregator-2", "preprocessor", "sharder",
           "checkpointer", "gateway", "autoscaler")  # fmt: skip
"""What a kill may hit: every process of the stack but the broker and the watchdog (the
autoscaler restarts the others, the watchdog the autoscaler)."""
LEAK_CHECK_MIN_JOBS = 60
"""Below this many jobs the memory figures are printed, not judged: a process's first jobs warm
its caches and allocator arenas up (a trainer grew 0.5-1 MiB a job over the second half of 40
jobs, and levelled off later)."""
WARM_UP_JOBS = 3
"""Jobs a process runs before its memory is judged."""
LEAK_LIMIT_BYTES_PER_JOB = 1 << 20
"""A process holding 1 MiB more per job would hold a GiB more after a thousand jobs. Measured
over the second half of 80 jobs without kills: the trainers -86 and +43 KiB a job, the
aggregators 10 and 295, the broker 160, every other process under 60."""


@dataclass
class MemoryTrail:
    """Resident memory of each process after each job, for the pid that ran then."""

    samples: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """name -> [(job index, pid, resident bytes)]."""

    def record(self, job_index: int, processes: dict[str, int]) -> None:
        for name, pid in processes.items():
            rss = resident_bytes(pid)
            if rss is not None:
                self.samples.setdefault(name, []).append((job_index, pid, rss))

    def growth_per_job(self, since_job: int) -> dict[str, float]:
        """Bytes a job each process grew by from job ``since_job`` to the last (the slope of a
        line fitted to its samples), for the processes whose one pid ran through all of it and
        the ``WARM_UP_JOBS`` jobs before (a restarted one warms up afresh)."""
        growth = {}
        for name, trail in self.samples.items():
            tail = [s for s in trail if s[0] >= since_job - WARM_UP_JOBS]
            if len({pid for _, pid, _ in tail}) != 1 or tail[0][0] != since_job - WARM_UP_JOBS:
                continue
            judged = [(job, rss) for job, _, rss in tail if job >= since_job]
            if len(judged) >= 2:
                # A fitted line, not the first and last sample: a process's resident memory
                # moves up and down by megabytes from job to job (the allocator, the collector).
                jobs, rss = zip(*judged, strict=True)
                growth[name] = statistics.linear_regression(jobs, rss).slope
        return growth


def resident_bytes(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # A finished job's topics go a second after it ends, so the last check finds them gone.
    env = {"CONVEYOR_SHARDER_FINISHED_TOPICS_GRACE_S": "1"}
    args = ["--scale", "trainer=2", "--scale", "aggregator=2"]
    with running_stack(tmp_path_factory.mktemp("soak"), args=args, env=env) as running:
        yield running


def test_jobs_back_to_back_under_kills_train_exactly_once_and_the_stack_holds_steady(
    stack: RunningStack,
) -> None:
    seed = int(os.environ.get("CONVEYOR_CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"soak seed {seed} (set CONVEYOR_CHAOS_SEED to replay), {SOAK_JOBS} jobs")
    memory = MemoryTrail()
    kills: list[str] = []
    job_seconds: list[float] = []
    job_ids: list[str] = []
    extra_steps: list[tuple[str, int]] = []
    """(kill, the steps its job took beyond the plan)."""
    for index in range(SOAK_JOBS):
        started = time.monotonic()
        job_id = submit(stack, digits_spec(f"soak-{index}", epochs=EPOCHS, distribution=SPREAD))
        job_ids.append(job_id)
        killed_before = len(kills)
        if KILLS and index > 0:
            victim = rng.choice(VICTIMS)
            # Somewhere in the job's 46 steps, early enough that it still runs after.
            at_step = rng.randint(1, 30)
            if kill_at_step(stack, job_id, victim, at_step):
                kills.append(f"{victim}@{at_step}")
        job = wait_terminal(stack, job_id, timeout_s=300)
        job_seconds.append(time.monotonic() - started)
        accuracy = (job.get("summary") or {}).get("eval_accuracy")
        print(f"job {index + 1}/{SOAK_JOBS}: {job['state']} in {job_seconds[-1]:.1f} s, "
              f"eval accuracy {accuracy}, kills so far {kills}")  # fmt: skip
        assert job["state"] == "completed", (index, kills, job.get("reason"))
        planned = job["plan"]["steps_per_epoch"] * EPOCHS
        if len(kills) == killed_before:
            assert job["summary"]["steps"] == planned
        else:  # the dead process's micro-batches may go into a step of their own, later
            assert job["summary"]["steps"] >= planned
            extra_steps.append((kills[-1], job["summary"]["steps"] - planned))
        assert job["summary"]["eval_accuracy"] > 0.75, job["summary"]  # chance is 0.1
        assert_exactly_once(stack.ledger(job_id), stack.train_ids(job), epochs=EPOCHS)
        # The next job starts on the whole stack: every process back and ready.
        processes = wait_for(lambda: all_ready(stack), timeout_s=120,
                             what="every service of the stack ready again")  # fmt: skip
        broker = stack.state.broker  # None on an external Kafka
        memory.record(index, {**processes, **({"broker": broker.pid} if broker else {})})
    if KILLS and SOAK_JOBS > 1:
        assert kills, "no kill landed while a job ran: nothing was tested"

    # What the jobs held on the broker is gone once they are: no job topic is left.
    def job_topics() -> set[str]:
        return {t for t in list_topics(stack.state.bootstrap) if any(j in t for j in job_ids)}

    wait_for(lambda: not job_topics(), timeout_s=60, interval_s=1.0, what="the jobs' topics to go")

    half = max(SOAK_JOBS // 2, WARM_UP_JOBS)
    growth = memory.growth_per_job(since_job=half)
    print(json.dumps({
        "soak_jobs": SOAK_JOBS, "seed": seed, "kills": kills, "extra_steps": extra_steps,
        "job_seconds_max": round(max(job_seconds), 1),
        "job_seconds_median": round(sorted(job_seconds)[len(job_seconds) // 2], 1),
        "rss_mib_first": {n: round(t[0][2] / 2**20, 1) for n, t in memory.samples.items()},
        "rss_mib_last": {n: round(t[-1][2] / 2**20, 1) for n, t in memory.samples.items()},
        "rss_growth_kib_per_job_second_half": {n: round(g / 1024, 1) for n, g in growth.items()},
    }))  # fmt: skip
    if SOAK_JOBS >= LEAK_CHECK_MIN_JOBS:
        assert growth, "no process lived through the second half: nothing to judge"
        leaking = {n: g for n, g in growth.items() if g > LEAK_LIMIT_BYTES_PER_JOB}
        assert not leaking, f"resident memory grows by more than 1 MiB a job: {leaking}"


def submit(stack: RunningStack, spec: dict[str, Any]) -> str:
    # The gateway may still be coming back from the last job's kill.
    stack.gateway.wait_ready(timeout_s=60)
    return stack.submit(spec)


def kill_at_step(stack: RunningStack, job_id: str, victim: str, at_step: int) -> bool:
    """SIGKILL ``victim`` once the job has applied ``at_step`` steps; False when the job ended
    first (nothing killed)."""

    def reached() -> dict[str, Any] | None:
        job = stack.job(job_id)
        done = job["state"] in TERMINAL_STATES or job["progress"]["step"] >= at_step
        return job if done else None

    job = wait_for(reached, timeout_s=180, interval_s=0.05, what=f"step {at_step}")
    if job["state"] in TERMINAL_STATES:
        return False
    service = current(stack, victim)
    os.kill(service.process.pid, 9)
    wait_for(lambda: not is_alive(service.process), timeout_s=10, what=f"{victim} to die")
    return True


def wait_terminal(stack: RunningStack, job_id: str, *, timeout_s: float) -> dict[str, Any]:
    """The job once terminal, asking the gateway through its own restarts."""

    def terminal() -> dict[str, Any] | None:
        try:
            job = stack.job(job_id)
        except GatewayError:
            return None  # killed, being restarted
        return job if job["state"] in TERMINAL_STATES else None

    result: dict[str, Any] = wait_for(terminal, timeout_s=timeout_s, interval_s=0.2,
                                      what=f"job {job_id} to end")  # fmt: skip
    return result


def current(stack: RunningStack, name: str) -> ServiceInfo:
    """The process recorded as ``name`` now (a restart records a new pid)."""
    state = load_state(stack.state_dir)
    assert state is not None
    return next(s for s in state.services if s.name == name)


def all_ready(stack: RunningStack) -> dict[str, int] | None:
    """{name: pid} of every service once each is alive and answers /readyz with 200."""
    state = load_state(stack.state_dir)
    assert state is not None
    pids = {}
    for service in state.services:
        if not is_alive(service.process):
            return None
        try:
            if httpx.get(f"{service.base_url}/readyz", timeout=2).status_code != 200:
                return None
        except httpx.HTTPError:
            return None
        pids[service.name] = service.process.pid
    return pids
