"""Helpers shared by the load tests: a real Conveyor stack (``conveyor up``) and a job watched
from the outside (its events, progress and backlog). What a process costs is in _bench_procs.py,
throughput windows and formatting in _bench_figures.py.

Linux only (``/proc``); nothing here needs psutil.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests._bench_procs import ProcMemory, cpu_seconds, proc_memory, runqueue_wait_seconds

# -- the real stack ----------------------------------------------------------------------------


def scale_supported() -> bool:
    """Whether ``conveyor up`` of this checkout accepts ``--scale NAME=N``."""
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "up", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    return "--scale" in result.stdout


def wait_until_ready(
    name: str, base_url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Until ``base_url``/readyz answers 200; RuntimeError when ``process`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see its log")
        try:
            if httpx.get(f"{base_url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready in {timeout_s:.0f} s")
        time.sleep(0.2)


class ConveyorStack:
    """One ``conveyor up`` stack in a fresh state directory, with ``preprocessors`` processes.

    Uses ``conveyor up --scale preprocessor=N`` where the CLI has it; otherwise starts the
    extra ``python -m conveyor service preprocessor`` processes itself, with the environment
    ``conveyor up`` gives its services. ``env`` is added to the services' environment (service
    settings such as ``CONVEYOR_TRAINER_...``). ``scale`` asks ``conveyor up --scale`` for N
    processes of other services (e.g. ``{"trainer": 2, "aggregator": 2}``; needs ``use_scale``).
    Raises RuntimeError when the stack fails to start.
    """

    def __init__(
        self,
        *,
        preprocessors: int,
        env: dict[str, str],
        use_scale: bool,
        scale: dict[str, int] | None = None,
    ) -> None:
        if preprocessors < 1:
            raise ValueError(f"preprocessors must be >= 1, got {preprocessors}")
        if scale and not use_scale:
            raise ValueError("scale needs a `conveyor up` with --scale")
        self.preprocessors = preprocessors
        self._scale = {name: n for name, n in (scale or {}).items() if name != "preprocessor"}
        self._env = {**os.environ, **env}
        self._use_scale = use_scale
        self.state_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
        self.state: dict[str, Any] = {}
        self._extras: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self) -> None:
        argv = [sys.executable, "-m", "conveyor", "up", "--state-dir", str(self.state_dir)]
        if self._use_scale and self.preprocessors != 1:
            argv += ["--scale", f"preprocessor={self.preprocessors}"]
        for name, count in sorted(self._scale.items()):
            argv += ["--scale", f"{name}={count}"]
        result = subprocess.run(
            [*argv, "--json"], capture_output=True, text=True, env=self._env, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"conveyor up failed ({result.returncode}): {result.stderr[-2000:]}")
        self.state = json.loads(result.stdout.strip().splitlines()[-1])["stack"]
        missing = self.preprocessors - sum(
            1 for name, _ in self.processes() if name.startswith("preprocessor")
        )
        for index in range(missing):
            self.start_service(f"preprocessor-x{index + 2}", "preprocessor")
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every service of ``conveyor up`` answers /readyz with 200. ``conveyor up``
        waits for liveness only; a service's start-up work after that (the aggregator imports
        torch's optimizer machinery, seconds of CPU) is then not counted as the job's."""
        deadline = time.monotonic() + timeout_s
        for service in self.state.get("services", []):
            url = f"http://{service['host']}:{service['port']}"
            wait_until_ready(service["name"], url, deadline - time.monotonic())

    def start_service(self, name: str, service: str, env: dict[str, str] | None = None) -> None:
        """Start one more ``python -m conveyor service SERVICE`` process named ``name``, with
        the environment ``conveyor up`` gives its services plus ``env``; wait until ready."""
        from conveyor.embedded.broker import free_port

        port = free_port("127.0.0.1")
        env = {
            **self._env,
            "CONVEYOR_KAFKA_BOOTSTRAP": self.state["bootstrap"],
            "CONVEYOR_STORAGE_URI": self.state["storage_uri"],
            "CONVEYOR_TELEMETRY_HTTP_HOST": "127.0.0.1",
            "CONVEYOR_TELEMETRY_HTTP_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        with open(self.state_dir / "logs" / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "conveyor", "service", service],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self._extras.append((name, process))
        wait_until_ready(name, f"http://127.0.0.1:{port}", 90.0, process)

    @property
    def bootstrap(self) -> str:
        return str(self.state["bootstrap"])

    @property
    def gateway_url(self) -> str:
        return str(self.state["gateway_url"])

    def processes(self) -> list[tuple[str, int]]:
        """(name, pid) of every process of the stack: broker, services, extra processes."""
        found: list[tuple[str, int]] = []
        if self.state.get("broker"):
            found.append(("broker", int(self.state["broker"]["pid"])))
        found += [(s["name"], int(s["process"]["pid"])) for s in self.state.get("services", [])]
        found += [(name, process.pid) for name, process in self._extras]
        return found

    def memory(self) -> dict[str, ProcMemory | None]:
        """Peak and current resident memory of every process, by name."""
        return {name: proc_memory(pid) for name, pid in self.processes()}

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds used so far by every process, by name."""
        return {name: cpu_seconds(pid) for name, pid in self.processes()}

    def runqueue_wait(self) -> dict[str, float | None]:
        """Seconds every process has waited for a CPU so far, by name."""
        return {name: runqueue_wait_seconds(pid) for name, pid in self.processes()}

    def stop(self) -> None:
        """``conveyor down``, then the extra processes; removes the state directory."""
        for _, process in self._extras:
            process.terminate()
        subprocess.run(
            [sys.executable, "-m", "conveyor", "down", "--state-dir", str(self.state_dir)],
            capture_output=True,
            env=self._env,
            check=False,
        )
        for _, process in self._extras:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.state_dir, ignore_errors=True)


# -- watching a job from the outside -------------------------------------------------------------

TERMINAL_EVENTS = frozenset({"completed", "failed", "cancelled"})


@dataclass(frozen=True, slots=True)
class BacklogSample:
    """Batch records produced to the job's batches topic minus those its trainer consumed."""

    at_s: float
    produced: int
    """Sum of the batches topic's end offsets."""
    consumed: int
    """``consumed_batches`` of the trainer's latest progress event."""

    @property
    def backlog(self) -> int:
        return self.produced - self.consumed


class JobWatcher:
    """Reads one job's lifecycle events, its trainers' heartbeats and its batches topic's end
    offsets, straight from the broker, in a background thread (own event loop).

    ``events`` holds ``(event, at, data)`` of the job in log order, ``heartbeats`` the
    ``(at, info)`` of every trainer heartbeat; the batches topic's end offsets are sampled
    every ``sample_interval_s`` once the job is planned (see :attr:`backlog`). Times are the
    publishers' ``time.time()``.
    """

    def __init__(
        self, *, bootstrap: str, topic_prefix: str, job_id: str, sample_interval_s: float = 0.2
    ) -> None:
        from conveyor.platform.messages import Topics

        self.job_id = job_id
        self._bootstrap = bootstrap
        self._topics = Topics(topic_prefix)
        self._sample_interval_s = sample_interval_s
        self.events: list[tuple[str, float, dict[str, Any]]] = []
        self.heartbeats: list[tuple[float, dict[str, Any]]] = []
        self._produced: list[tuple[float, int]] = []
        self.error: BaseException | None = None
        self.undecodable = 0
        """Records the watcher could not decode (skipped)."""
        self._terminal = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def backlog(self) -> list[BacklogSample]:
        """Each end-offset sample against the consumed count of the trainer's last progress
        event published before it: the most the sharder's flow control can have seen when it
        released what was produced, so ``max(backlog)`` is what flow control bounds (the real
        backlog, against what the trainer actually finished, is at most this)."""
        reports = sorted(
            (at, int(data.get("consumed_batches") or 0))
            for name, at, data in self.events
            if name == "progress"
        )
        samples: list[BacklogSample] = []
        index, consumed = 0, 0
        for at, produced in sorted(self._produced):
            while index < len(reports) and reports[index][0] <= at:
                consumed = max(consumed, reports[index][1])
                index += 1
            samples.append(BacklogSample(at, produced, consumed))
        return samples

    def wait_terminal(self, timeout_s: float) -> tuple[str, float, dict[str, Any]]:
        """The job's terminal event; TimeoutError after ``timeout_s``, RuntimeError when the
        watcher failed."""
        deadline = time.monotonic() + timeout_s
        while not self._terminal.wait(0.2):
            if self.error is not None:
                raise RuntimeError(f"job watcher failed: {self.error!r}") from self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} did not finish in {timeout_s:.0f} s")
        terminal: tuple[str, float, dict[str, Any]] = next(
            e for e in reversed(self.events) if e[0] in TERMINAL_EVENTS
        )
        return terminal

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            asyncio.run(self._watch())
        except BaseException as exc:
            self.error = exc
            raise

    async def _watch(self) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        def consumer(topic: str) -> AIOKafkaConsumer:
            # No group: every partition, from the beginning, nothing committed.
            return AIOKafkaConsumer(
                topic,
                bootstrap_servers=self._bootstrap,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
            )

        jobs = consumer(self._topics.jobs)
        await jobs.start()
        control: AIOKafkaConsumer | None = None
        batch_partitions: list[TopicPartition] = []
        next_sample = 0.0
        try:
            while not self._stop.is_set():
                for records in (await jobs.getmany(timeout_ms=50)).values():
                    for record in records:
                        event = self._job_event(record.value)
                        if event is None:
                            continue
                        name, _, data = event
                        if name == "planned" and control is None:
                            topic = data["batches_topic"]
                            batch_partitions = [
                                TopicPartition(topic, p)
                                for p in range(int(data["batches_partitions"]))
                            ]
                            control = consumer(data["control_topic"])
                            await control.start()
                        elif name in TERMINAL_EVENTS:
                            self._terminal.set()
                if control is not None:
                    for records in (await control.getmany(timeout_ms=50)).values():
                        for record in records:
                            self._heartbeat(record.value)
                if batch_partitions and time.monotonic() >= next_sample:
                    next_sample = time.monotonic() + self._sample_interval_s
                    try:
                        offsets = await jobs.end_offsets(batch_partitions)
                    except Exception:  # the topic is deleted when the job ends: stop sampling
                        batch_partitions = []
                    else:
                        # Dated when the answer came: every batch it counts was released on
                        # a progress report published before then.
                        self._produced.append((time.time(), sum(offsets.values())))
        finally:
            if control is not None:
                await control.stop()
            await jobs.stop()

    def _decode(self, value: bytes | None) -> object:
        """The message in ``value``; None (and counted in ``undecodable``) when it is not one
        this checkout's codec reads, e.g. written by services started from other code."""
        from conveyor.platform.codec import CodecError, decode

        if not value:
            return None
        try:
            return decode(value)
        except CodecError:
            self.undecodable += 1
            return None

    def _job_event(self, value: bytes | None) -> tuple[str, float, dict[str, Any]] | None:
        from conveyor.platform.messages import JobEvent

        message = self._decode(value)
        if not isinstance(message, JobEvent) or message.job_id != self.job_id:
            return None
        event = (message.EVENT, message.at, message.details())
        self.events.append(event)
        return event

    def _heartbeat(self, value: bytes | None) -> None:
        from conveyor.platform.messages import Heartbeat

        message = self._decode(value)
        if isinstance(message, Heartbeat):
            self.heartbeats.append((message.at, dataclasses.asdict(message.state)))
