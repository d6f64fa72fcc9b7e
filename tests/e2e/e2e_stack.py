"""End-to-end helpers: a real stack (`conveyor up` as a subprocess: Tansu broker, gateway,
sharder, preprocessors, trainer as child processes), driven through the gateway's HTTP API.

Every stack runs with a 3 s consumer-group session (a killed member is noticed in seconds) and
is stopped (as by `conveyor down`) when its fixture ends. When a test fails, conftest.py attaches
the tail of every log file of the stacks alive at that moment to the failure report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from ledger_check import train_split
from numpy.typing import NDArray
from prometheus_client.parser import text_string_to_metric_families

from conveyor.cli.client import TERMINAL_STATES, GatewayClient
from conveyor.embedded.broker import free_port
from conveyor.embedded.procs import ProcessInfo, is_alive
from conveyor.embedded.stack import stop_stack
from conveyor.embedded.state import ServiceInfo, StackState, load_state
from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import ObjectStore, open_store

E2E_ENV = {
    # A SIGKILLed group member is evicted after 3 s (and Tansu completes joins after half).
    "CONVEYOR_KAFKA_SESSION_TIMEOUT_S": "3",
    "CONVEYOR_KAFKA_HEARTBEAT_INTERVAL_S": "1",
    # A SIGKILLed trainer leaves the scheduler's pool 3 s (of the jobs log's clock) after its
    # last presence, so that its replacement gets its place.
    "CONVEYOR_TRAINER_PRESENCE_TTL_S": "3",
}
LOG_TAIL_LINES = 40
DIGITS_SAMPLES = 1797
"""Samples of scikit-learn's digits (builtin://sklearn-digits)."""

ACTIVE: list[RunningStack] = []
"""Stacks whose logs go into the report of a failing test."""


def base_env() -> dict[str, str]:
    """This process's environment without Conveyor settings (they would change what the stack
    does), plus :data:`E2E_ENV`."""
    keep = {"CONVEYOR_TANSU_BIN"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") or k in keep}
    return {**env, **E2E_ENV}


def conveyor(
    *args: str, env: dict[str, str], timeout_s: float = 180.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``conveyor`` command line as a subprocess (in ``cwd``, default this one's)."""
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        cwd=cwd,
    )


def digits_spec(name: str = "digits-e2e", *, epochs: int = 2, **sections: Any) -> dict[str, Any]:
    """A small digits job (2 epochs: ~15 s on two loaded cores); ``sections`` replace whole
    top-level sections of the spec."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {"name": "small_cnn", "num_classes": 10},
        "dataset": {"uri": "builtin://sklearn-digits", "eval_fraction": 0.2},
        "preprocess": {"normalize": {"mean": [0.5], "std": [0.5]}, "augment": []},
        "training": {
            "epochs": epochs,
            "global_batch_size": 64,
            "micro_batch_size": 32,
            # Batches reach the trainer in any order, which changes how micro-batches pair up
            # into steps: Adam at this rate reached 0.90-0.96 eval accuracy after 2 epochs in
            # 28 random arrival orders (SGD lr 0.1 momentum 0.9: 0.74-0.93).
            "optimizer": {"name": "adam", "lr": 0.004},
            "seed": 0,
        },
        # One torch thread: every process of the stack shares this machine's cores.
        "resources": {"device": "cpu", "threads": 1},
    }
    spec.update(sections)
    return spec


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus exposition text -> {(sample name, sorted labels): value}."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def metric_sum(
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    name: str,
    **labels: str,
) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        value
        for (sample, sample_labels), value in values.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def wait_for(
    condition: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.1, what: str
) -> Any:
    """Poll ``condition`` until it returns something truthy (returned); AssertionError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def wait_checkpoint_committed(
    state_dir: Path, job_id: str, version: int, *, timeout_s: float = 60.0
) -> None:
    """Until a checkpointer of the stack in ``state_dir`` logged the commit of ``job_id``'s
    checkpoint ``version``. The coordinator publishes ``completed`` once every slice *saved*
    the job's last checkpoint; the checkpointer commits it (manifest, ``latest``, retention)
    on its own time and logs that after the retention, so the store read right after the job
    turned completed in the gateway may not have it yet."""
    committed = f"job {job_id}: checkpoint v{version} committed ("

    def logged() -> bool:
        logs = (state_dir / "logs").glob("checkpointer*.log")
        return any(committed in path.read_text(errors="replace") for path in logs)

    wait_for(logged, timeout_s=timeout_s, interval_s=0.2,
             what=f"a checkpointer to commit v{version} of job {job_id}")  # fmt: skip


@dataclass
class RunningStack:
    """A stack started by `conveyor up`, and what the tests do with it."""

    state_dir: Path
    env: dict[str, str]
    """Environment `conveyor up` ran with (the services inherit it)."""
    storage: StorageSettings
    """How the tests reach the stack's object store."""
    state: StackState = field(init=False)
    gateway: GatewayClient = field(init=False)
    extra: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    """Processes a test started next to the stack (a replacement trainer)."""

    def __post_init__(self) -> None:
        state = load_state(self.state_dir)
        assert state is not None and state.gateway_url is not None
        self.state = state
        self.gateway = GatewayClient(state.gateway_url)
        self.gateway.wait_ready()

    # -- processes ------------------------------------------------------------------------

    def service(self, name: str) -> ServiceInfo:
        """The recorded process called ``name`` (``trainer``, ``preprocessor-2``, ...)."""
        found = [s for s in self.state.services if s.name == name]
        assert found, f"no service {name!r} in {[s.name for s in self.state.services]}"
        return found[0]

    def kill(self, name: str) -> None:
        """SIGKILL the service ``name`` (no drain, no commit) and wait until it is gone."""
        process = self.service(name).process
        os.kill(process.pid, signal.SIGKILL)
        wait_for(lambda: not is_alive(process), timeout_s=10, what=f"{name} to die")

    def environ_of(self, name: str) -> dict[str, str]:
        """The environment the stack gave service ``name`` (Linux: /proc/<pid>/environ)."""
        raw = Path(f"/proc/{self.service(name).process.pid}/environ").read_bytes()
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        return {key.decode(): value.decode() for key, value in pairs}

    def start_extra(self, name: str, service: str, env: dict[str, str]) -> ServiceInfo:
        """Start ``conveyor service <service>`` next to the stack with ``env`` (its HTTP port
        replaced by a free one), logging to ``logs/<name>.log``; stopped with the stack."""
        port = free_port()
        env = {**env, "CONVEYOR_TELEMETRY_HTTP_PORT": str(port)}
        log_path = self.state_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "conveyor", "service", service],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.extra.append((name, process))
        return ServiceInfo(
            name=name,
            process=ProcessInfo.of(process.pid, log_path),
            host=env.get("CONVEYOR_TELEMETRY_HTTP_HOST", "127.0.0.1"),
            port=port,
        )

    def wait_ready(self, service: ServiceInfo, *, timeout_s: float = 60.0) -> None:
        """Until ``service`` answers ``/readyz`` with 200."""

        def ready() -> bool:
            try:
                return httpx.get(f"{service.base_url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout_s=timeout_s, what=f"{service.name} ready")

    def stop_extra(self, name: str) -> None:
        """Stop the process :meth:`start_extra` started as ``name`` (SIGTERM: drains, leaves)."""
        process = next(p for n, p in self.extra if n == name)
        process.terminate()
        process.wait(timeout=30)
        self.extra.remove((name, process))

    def alive(self) -> dict[str, bool]:
        """Which recorded services run (SIGKILLed ones do not)."""
        return {s.name: is_alive(s.process) for s in self.state.services}

    def metrics(self, service: ServiceInfo) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return metric_values(httpx.get(service.metrics_url, timeout=5).text)

    # -- jobs -----------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any]) -> str:
        return str(self.gateway.submit(spec)["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return self.gateway.job(job_id)

    def wait_job(self, job_id: str, *, timeout_s: float = 90.0) -> dict[str, Any]:
        """The job once it is terminal; AssertionError with its last view after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["state"] in TERMINAL_STATES:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout_s:g}s: {job}")
            time.sleep(0.2)

    def store(self) -> ObjectStore:
        return open_store(self.state.storage_uri, self.storage)

    def ledger(self, job_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.store().get_bytes(f"jobs/{job_id}/ledger.json"))
        return data

    def train_ids(self, job: dict[str, Any]) -> set[int]:
        """The job's train split (from its spec) checked against its plan's counts."""
        spec, plan = job["spec"], job["plan"]
        num_samples = plan["num_train"] + plan["num_eval"]
        ids = train_split(num_samples, spec["dataset"]["eval_fraction"], spec["training"]["seed"])
        assert len(ids) == plan["num_train"]
        return ids

    # -- failures -------------------------------------------------------------------------

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        parts = []
        for path in sorted((self.state_dir / "logs").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {path} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        self.gateway.close()
        for _, process in self.extra:
            if process.poll() is None:
                process.terminate()
        for _, process in self.extra:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # In-process `conveyor down` (the command itself is covered by the stack's own tests).
        stop_stack(self.state_dir, timeout_s=5.0)


@contextlib.contextmanager
def running_stack(
    state_dir: Path,
    *,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    storage: StorageSettings | None = None,
    cwd: Path | None = None,
) -> Iterator[RunningStack]:
    """`conveyor up --state-dir state_dir ARGS` with :func:`base_env` plus ``env``, in ``cwd``
    (the services' working directory); stopped (with every extra process) on exit.
    ``storage``: how to reach an S3 object store."""
    full_env = {**base_env(), **(env or {})}
    try:
        started = conveyor(
            "up", "--state-dir", str(state_dir), "--json", *args, env=full_env, cwd=cwd
        )
        if started.returncode != 0:
            raise AssertionError(f"conveyor up failed ({started.returncode}):\n{started.stderr}")
        stack = RunningStack(
            state_dir=state_dir, env=full_env, storage=storage or StorageSettings(uri="file:///")
        )
    except BaseException:
        stop_stack(state_dir, timeout_s=5.0)  # whatever a failed or timed-out `up` left running
        raise
    ACTIVE.append(stack)
    try:
        yield stack
    finally:
        ACTIVE.remove(stack)
        stack.stop()


def digits_arrays() -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """scikit-learn's digits: ``x`` uint8 [N,8,8] (0..16 scaled to 0..255), ``y`` int64 [N]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # [N,8,8]
    return x, digits.target.astype(np.int64)


def write_digits_npz(path: Path) -> Path:
    """The digits as a ``.npz`` of ``x`` and ``y``, the input of `conveyor dataset pack`."""
    x, y = digits_arrays()
    np.savez(path, x=x, y=y)
    return path


def pack_dataset(
    source: Path, dest: str, *, shard_size: int, env: dict[str, str] | None = None
) -> str:
    """`conveyor dataset pack SOURCE DEST --shard-size N`; returns the URI it prints."""
    packed = conveyor(
        "dataset", "pack", str(source), dest, "--shard-size", str(shard_size),
        env={**base_env(), **(env or {})},
    )  # fmt: skip
    assert packed.returncode == 0, packed.stderr
    return packed.stdout.strip().splitlines()[-1]


def list_topics(bootstrap: str) -> set[str]:
    """Topic names on the broker."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def names() -> set[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    return asyncio.run(names())
