"""Locust load test of the gateway: the mix of requests its users and their dashboards send.

Each simulated user submits small jobs (an ``Idempotency-Key`` on every submission, and now and
then the retry of one, which must answer 200 with the same job), lists jobs, reads one, follows
one's progress stream (server-sent events) for a moment, reads its stage latencies and cancels
one of its own. Every submitted job really runs: the load reaches the broker and every service,
not only the gateway.

    # against a running stack (`conveyor up` prints the gateway URL; compose: port 8080)
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080          # web UI on :8089
    # the heavier run: 50 users for 10 minutes, bigger jobs, statistics as CSV files
    CONVEYOR_LOCUST_SAMPLES=4096 locust -f loadtests/locustfile.py --host http://127.0.0.1:8080 \\
        --headless -u 50 -r 5 -t 10m --csv loadtest --html loadtest.html

Settings (environment): ``CONVEYOR_API_TOKEN`` (the gateway's bearer token, when it has one),
``CONVEYOR_LOCUST_SAMPLES`` (samples of each submitted synthetic job, default 64),
``CONVEYOR_LOCUST_FOLLOW_S`` (how long a user follows a progress stream, default 1 s).
tests/e2e/test_e2e_default_stack.py runs a short headless run against the embedded stack.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import deque
from typing import Any

import requests
from locust import HttpUser, between, task

JOBS_KEPT = 20
"""Own job ids a user remembers to read, follow and cancel."""
RETRY_SHARE = 0.25
"""Share of submissions a user sends twice with the same key (a client retry)."""


def job_spec(name: str, samples: int) -> dict[str, Any]:
    """A small synthetic job: 8x8 images of 4 classes, one epoch, one trainer."""
    return {
        "name": name,
        "model": {"name": "small_cnn", "num_classes": 4},
        "dataset": {
            "uri": f"synthetic://?n={samples}&shape=1x8x8&classes=4",
            "eval_fraction": 0.25,
        },
        "training": {
            "epochs": 1,
            "global_batch_size": 16,
            "micro_batch_size": 16,
            "optimizer": {"name": "sgd", "lr": 0.1},
            "seed": random.randrange(2**31),
        },
        "distribution": {"trainers": 1, "aggregator_shards": 1},
        "resources": {"device": "cpu", "threads": 1},
    }


class GatewayUser(HttpUser):
    """One user of the gateway's API."""

    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        token = os.environ.get("CONVEYOR_API_TOKEN")
        if token:
            self.client.headers["Authorization"] = f"Bearer {token}"
        self.samples = int(os.environ.get("CONVEYOR_LOCUST_SAMPLES", "64"))
        self.follow_s = float(os.environ.get("CONVEYOR_LOCUST_FOLLOW_S", "1"))
        self.jobs: deque[str] = deque(maxlen=JOBS_KEPT)
        # A first visit goes through every request once (submit a job, look at the list and
        # at it, watch it, check its stages, change one's mind and cancel it); the weighted
        # mix follows. So even a short run sends every kind of request.
        for visit in (self.submit, self.list_jobs, self.get_job, self.follow_events,
                      self.stages, self.cancel):  # fmt: skip
            visit()

    def _some_job(self) -> str | None:
        return random.choice(self.jobs) if self.jobs else None

    @task(2)
    def submit(self) -> None:
        key = str(uuid.uuid4())
        spec = job_spec(f"locust-{key[:8]}", self.samples)
        headers = {"Idempotency-Key": key}
        with self.client.post(
            "/v1/jobs", json=spec, headers=headers, name="/v1/jobs [submit]", catch_response=True
        ) as response:
            if response.status_code != 201:
                response.failure(f"submit answered {response.status_code}: {response.text[:200]}")
                return
            job_id = response.json()["id"]
            self.jobs.append(job_id)
        if random.random() < RETRY_SHARE:
            with self.client.post(
                "/v1/jobs", json=spec, headers=headers, name="/v1/jobs [retry]",
                catch_response=True,
            ) as retry:  # fmt: skip
                if retry.status_code != 200 or retry.json()["id"] != job_id:
                    retry.failure(f"retry answered {retry.status_code}: {retry.text[:200]}")

    @task(6)
    def list_jobs(self) -> None:
        with self.client.get("/v1/jobs?limit=20", catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"list answered {response.status_code}")
                return
            listed = response.json()
            if listed["count"] != len(listed["jobs"]):
                response.failure("count does not match the jobs listed")

    @task(6)
    def get_job(self) -> None:
        job_id = self._some_job()
        if job_id is None:
            return
        with self.client.get(
            f"/v1/jobs/{job_id}", name="/v1/jobs/[id]", catch_response=True
        ) as response:
            if response.status_code != 200 or response.json()["id"] != job_id:
                response.failure(f"get answered {response.status_code}")

    @task(1)
    def stages(self) -> None:
        job_id = self._some_job()
        if job_id is not None:
            self.client.get(f"/v1/jobs/{job_id}/stages", name="/v1/jobs/[id]/stages")

    @task(1)
    def follow_events(self) -> None:
        """Open the progress stream, read its snapshot and what follows for ``follow_s``."""
        job_id = self._some_job()
        if job_id is None:
            return
        # The read timeout ends a quiet stream: events arrive only as the job moves.
        with self.client.get(
            f"/v1/jobs/{job_id}/events", name="/v1/jobs/[id]/events", stream=True,
            catch_response=True, timeout=(10, self.follow_s),
        ) as response:  # fmt: skip
            if response.status_code != 200:
                response.failure(f"events answered {response.status_code}")
                return
            events: list[str] = []
            deadline = time.monotonic() + self.follow_s
            try:
                for line in response.iter_lines(decode_unicode=True):
                    if line.startswith("event: "):
                        events.append(line.removeprefix("event: "))
                    if events and time.monotonic() > deadline:
                        break
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout):
                pass  # quiet for follow_s: what was read is judged below
            if not events or events[0] != "snapshot":
                response.failure(f"the stream did not start with a snapshot: {events[:3]}")

    @task(1)
    def cancel(self) -> None:
        job_id = self._some_job()
        if job_id is None:
            return
        with self.client.post(
            f"/v1/jobs/{job_id}/cancel", name="/v1/jobs/[id]/cancel", catch_response=True
        ) as response:
            # 409: the job finished before the request; both are correct answers.
            if response.status_code in (202, 409):
                response.success()
            else:
                response.failure(f"cancel answered {response.status_code}")
