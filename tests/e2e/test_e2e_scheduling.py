"""Scheduling end to end: a pool of three trainers (`--scale trainer=3`, each slowed to a
simulated accelerator so that jobs overlap) and jobs: an elastic one (1 to 3 trainers), one
asking 1 with a higher priority and one asking more trainers than the pool has, which waits at
the tail of the queue (shown by `conveyor jobs`) until it is cancelled, submitted at once; then,
once the elastic job has grown into the spare trainer, one asking 2 with the higher priority.
That one waits (the elastic job's extra alone is not enough), starts when the first
higher-priority job ends by taking the elastic job's extra (the elastic job shrinks to its
minimum for a higher priority), and when it ends the elastic job grows to its most. Every job
completes with an exact ledger: each train sample once per epoch, across every change of its
trainers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_stack import RunningStack, conveyor, digits_spec, running_stack, wait_for
from ledger_check import assert_exactly_once

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEP_DELAY_S = 0.02
"""Simulated extra compute per micro-batch: a job's steps take long enough to overlap."""
DATASET = "synthetic://?n=320&shape=1x8x8&classes=10&seed=1"
"""256 train samples: 8 micro-batches of 32 an epoch."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with running_stack(
        tmp_path_factory.mktemp("scheduling") / "state",
        # No checkpointer: nothing here reads a checkpoint, and one process fewer to start.
        args=["--scale", "trainer=3", "--scale", "checkpointer=0"],
        env={"CONVEYOR_TRAINER_SIMULATED_STEP_DELAY_S": str(STEP_DELAY_S)},
    ) as running:
        yield running


def job_spec(name: str, *, epochs: int, priority: int = 0, **trainers: int) -> dict[str, Any]:
    return digits_spec(
        name,
        epochs=epochs,
        priority=priority,
        dataset={"uri": DATASET, "eval_fraction": 0.2},
        distribution={"aggregator_shards": 1, **trainers},
    )


class Sampler:
    """Samples ``GET /v1/queue`` in a thread: {job name: trainers} and the queue, over time."""

    def __init__(self, stack: RunningStack) -> None:
        self._stack = stack
        self.samples: list[tuple[dict[str, int], list[tuple[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            queue = self._stack.gateway.queue()
            placed = {job["name"]: len(job["trainers"]) for job in queue["placed"]}
            self.samples.append((placed, [(j["name"], j["position"]) for j in queue["queued"]]))

    def latest(self) -> tuple[dict[str, int], list[tuple[str, int]]]:
        return self.samples[-1] if self.samples else ({}, [])


def test_jobs_share_the_pool_by_priority_then_fifo_and_train_exactly_once(
    stack: RunningStack,
) -> None:
    wait_for(lambda: stack.gateway.queue()["pool_size"] == 3, timeout_s=30, what="3 trainers")
    with Sampler(stack) as sampler:
        ids = {
            "elastic": stack.submit(
                job_spec("elastic", epochs=10, trainers=1, min_trainers=1, max_trainers=3)
            ),
            "urgent": stack.submit(job_spec("urgent", epochs=2, priority=1, trainers=1)),
        }
        # Ranked last, it holds back no one; asking 4 of 3 trainers, it never starts.
        too_big = stack.submit(job_spec("too-big", epochs=1, priority=-1, trainers=4))
        # urgent (priority 1) and elastic get their one; the spare trainer is elastic's.
        wait_for(
            lambda: sampler.latest() == ({"urgent": 1, "elastic": 2}, [("too-big", 1)]),
            timeout_s=30,
            what="urgent and elastic placed, elastic grown",
        )
        # pair (priority 1, 2 trainers) can take elastic's extra but needs one more: it waits,
        # first in line.
        ids["pair"] = stack.submit(job_spec("pair", epochs=2, priority=1, trainers=2))
        wait_for(
            lambda: (
                sampler.latest() == ({"urgent": 1, "elastic": 2}, [("pair", 1), ("too-big", 2)])
            ),
            timeout_s=30,
            what="pair queued behind urgent",
        )
        # From here the gateway has read all four submissions. Before, it may have folded
        # them in another order (the jobs topic has several partitions).
        settled = len(sampler.samples) - 1
        # urgent ends: pair starts with two trainers, one taken back from the elastic job.
        wait_for(
            lambda: sampler.latest()[0] == {"elastic": 1, "pair": 2},
            timeout_s=60,
            what="elastic shrunk for pair",
        )
        # pair ends: the elastic job grows to its most.
        wait_for(lambda: sampler.latest()[0] == {"elastic": 3}, timeout_s=60, what="growth to 3")
        jobs = {name: stack.wait_job(job_id, timeout_s=120) for name, job_id in ids.items()}

    listed = conveyor(
        "jobs", "--state-dir", str(stack.state_dir), env={**stack.env, "COLUMNS": "200"}
    )
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if too_big in line]
    assert len(rows) == 1 and "queued #1" in rows[0], listed.stdout
    stack.gateway.cancel(too_big)
    assert stack.wait_job(too_big, timeout_s=30)["state"] == "cancelled"

    for name, job in jobs.items():
        assert job["state"] == "completed", (name, job.get("reason"))
        epochs = job["spec"]["training"]["epochs"]
        assert_exactly_once(stack.ledger(job["id"]), stack.train_ids(job), epochs=epochs)
    # Never more trainers placed than the pool has; too-big never placed.
    assert all(sum(placed.values()) <= 3 for placed, _ in sampler.samples)
    assert not any("too-big" in placed for placed, _ in sampler.samples)
    # pair never ran beside urgent: it waited for its two trainers.
    assert not any({"urgent", "pair"} <= set(placed) for placed, _ in sampler.samples[settled:])
