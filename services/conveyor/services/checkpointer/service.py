"""The checkpointer service: commits every job's checkpoints.

A :class:`~conveyor.training.jobhost.JobHostService` that hosts every planned job. For each it
tails the job's control topic from the beginning into a :class:`~.book.CheckpointBook` and:

- commits each checkpointed version once all its slices are saved: checks the files, writes
  the manifest (the commit), moves ``latest``, applies ``checkpoint.keep_last``, and publishes
  ``CheckpointCommitted`` on the jobs topic; a version a slice failed to save (or whose commit
  fails) gets ``CheckpointFailed`` and the previous checkpoint stays the latest;
- asks for a checkpoint (``CheckpointRequest``) every ``checkpoint.every_s`` seconds;
- at the job's end (let go when it turns terminal), commits the final checkpoint from the
  store when its announcements were not read before the job's topics went.

Versions already committed (a restart, a second replica) are not committed again.

Beside the jobs it keeps the registry of live jobs in the stack's object store and, on a jobs
topic that lost them (the whole stack, broker included, restarted), brings them back from their
latest checkpoints (:mod:`.registry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from conveyor.platform.bus import TopicTail
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.messages import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointRequest,
    JobEvent,
)
from conveyor.platform.storage import ObjectNotFound, StorageError, open_store
from conveyor.platform.telemetry import LATENCY_BUCKETS_S, counter, histogram
from conveyor.services.checkpointer.book import CheckpointBook
from conveyor.services.checkpointer.config import CheckpointerSettings
from conveyor.services.checkpointer.registry import (
    JobRegistry,
    RegistryEntry,
    recovery_event,
    registry_changes,
)
from conveyor.training.checkpoint import (
    CheckpointError,
    CheckpointStore,
    Manifest,
    SliceFile,
    slice_key,
)
from conveyor.training.jobhost import JobFailure, JobHostService
from conveyor.training.jobspec import JobSpec
from conveyor.training.jobview import JobView
from conveyor.training.locations import output_uri

logger = logging.getLogger(__name__)

RNG_DERIVATION = (
    "every random draw derives from (training.seed, epoch, sample id): shard order, "
    "augmentation and batch ids; no generator state to carry"
)

_COMMITS = counter("checkpointer", "commits_total", "Checkpoints committed.")
_FAILURES = counter("checkpointer", "failures_total", "Checkpoints that could not be committed.")
_COMMIT_SECONDS = histogram(
    "checkpointer",
    "checkpoint_seconds",
    "From the StepClose that asked for a checkpoint to its commit.",
    buckets=LATENCY_BUCKETS_S,
)
_BYTES = counter("checkpointer", "committed_bytes_total", "Bytes of the committed checkpoints.")

Prepared = tuple[JobSpec, CheckpointStore]


class CheckpointerService(JobHostService[Prepared]):
    """One checkpointer process."""

    name = "checkpointer"

    def __init__(
        self,
        *,
        settings: CheckpointerSettings,
        kafka: KafkaSettings,
        storage: StorageSettings,
        telemetry: TelemetrySettings,
    ) -> None:
        super().__init__(
            kafka=kafka,
            telemetry=telemetry,
            worker_id=settings.worker_id,
            retry_backoff_s=settings.retry_backoff_s,
        )
        self.settings = settings
        self.storage = storage

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._keep_registry()]

    async def _keep_registry(self) -> None:
        """Keep the registry of live jobs; on start, bring back the jobs the topic lost."""
        registry = JobRegistry(open_store(self.storage.uri, self.storage))
        await self.view_ready()  # "lost" means: not in a view of the whole jobs topic
        started = True
        while True:
            try:
                entries = await asyncio.to_thread(registry.entries)
                changes = registry_changes(self.view, entries)
                for entry in changes.lost if started else ():
                    await self._recover(entry)
                for entry in changes.write:
                    await asyncio.to_thread(registry.write, entry)
                for job_id in changes.delete:
                    await asyncio.to_thread(registry.delete, job_id)
                started = False
            except StorageError as exc:  # the jobs go on; the next pass tries again
                logger.warning("the registry of live jobs: %s", exc)
            await asyncio.sleep(self.settings.registry_interval_s)

    async def _recover(self, entry: RegistryEntry) -> None:
        try:
            spec = JobSpec.from_dict(entry.spec)
            store = open_store(output_uri(spec, self.storage), self.storage)
        except ValueError as exc:
            logger.error("job %s: cannot bring it back: %s", entry.job_id, exc)
            return
        event = await asyncio.to_thread(recovery_event, entry, CheckpointStore(store, entry.job_id))
        logger.warning("job %s: lost with the jobs topic; bringing it back: %s", entry.job_id,
                       event.details().get("checkpoint_version", "from the start"))  # fmt: skip
        await self._publish(event)

    async def prepare_job(self, job: JobView) -> Prepared:
        try:
            spec = JobSpec.from_dict(job.spec)
            store = open_store(output_uri(spec, self.storage), self.storage)  # in the roots
        except ValueError as exc:
            raise JobFailure(f"invalid job: {exc}") from exc
        return spec, CheckpointStore(store, job.job_id)

    async def run_job(self, job: JobView, prepared: Prepared) -> None:
        spec, checkpoints = prepared
        assert job.plan is not None  # servable jobs are planned
        book = CheckpointBook(
            job_id=job.job_id,
            num_slices=spec.distribution.aggregator_shards,
            train_batches_per_epoch=job.plan.train_batches_per_epoch,
            started_at=time.time(),
        )
        # A restart (or a second replica) does not commit again what is committed already.
        book.floor = max(await asyncio.to_thread(checkpoints.committed_versions), default=0)
        try:
            control_topic = job.plan.control_topic  # the view's plan changes on a resume
            async with TopicTail(self.kafka, control_topic, types=book.FOLDED) as control:
                while True:
                    for record in await control.get_many(self.settings.poll_s):
                        book.fold(record.message)
                    await self._act(job, spec, checkpoints, book, control_topic)
        except asyncio.CancelledError:
            # Let go: the job ended (or this process stops). Its final checkpoint's
            # announcements may have gone with its topics: commit it from the store.
            await self._finish(job, spec, checkpoints, book)
            raise

    async def _act(
        self,
        job: JobView,
        spec: JobSpec,
        checkpoints: CheckpointStore,
        book: CheckpointBook,
        control_topic: str,
    ) -> None:
        for version in book.failed():
            book.done.add(version)
            await self._failed(job.job_id, version, "; ".join(book.errors(version)))
        for version in book.ready():
            await self._commit(job, spec, checkpoints, book, version, book.files(version))
        if book.timer_due(spec.checkpoint.every_s, time.time()):
            book.timer_sent()
            await self.producer.publish(
                control_topic,
                CheckpointRequest(job_id=job.job_id, reason="every_s", requested_at=time.time()),
            )

    async def _commit(
        self,
        job: JobView,
        spec: JobSpec,
        checkpoints: CheckpointStore,
        book: CheckpointBook,
        version: int,
        files: list[SliceFile],
    ) -> None:
        book.done.add(version)
        close = book.requested[version]
        cursor, steps = book.cursors[version]
        plan = job.plan
        assert plan is not None
        manifest = Manifest(
            job_id=job.job_id,
            version=version,
            step=steps,
            trigger=close.checkpoint or "request",
            created_at=time.time(),
            files=files,
            data_cursor=cursor,
            rng={"seed": spec.training.seed, "derivation": RNG_DERIVATION},
            spec=spec.to_dict(),
            model={
                "name": spec.model.name,
                "options": spec.model.options,
                "num_classes": plan.num_classes,
                "sample_shape": list(plan.sample_shape),
            },
        )
        try:
            uri = await asyncio.to_thread(checkpoints.commit, manifest)
            deleted = await asyncio.to_thread(checkpoints.retain, spec.checkpoint.keep_last)
        except (CheckpointError, StorageError) as exc:
            await self._failed(job.job_id, version, str(exc))
            return
        seconds = max(0.0, time.time() - close.closed_at)
        _COMMITS.inc()
        _BYTES.inc(manifest.size_bytes)
        _COMMIT_SECONDS.observe(seconds)
        logger.info("job %s: checkpoint v%d committed (%s, %d bytes, %.2f s); retention removed %s",
                    job.job_id, version, manifest.trigger, manifest.size_bytes, seconds,
                    deleted or "nothing")  # fmt: skip
        await self._publish(CheckpointCommitted(
            job_id=job.job_id, version=version, step=steps, trigger=manifest.trigger, uri=uri,
            size_bytes=manifest.size_bytes, seconds=seconds,
        ))  # fmt: skip

    async def _failed(self, job_id: str, version: int, reason: str) -> None:
        _FAILURES.inc()
        logger.warning("job %s: checkpoint v%d not committed: %s", job_id, version, reason)
        await self._publish(CheckpointFailed(job_id=job_id, version=version, reason=reason))

    async def _finish(
        self, job: JobView, spec: JobSpec, checkpoints: CheckpointStore, book: CheckpointBook
    ) -> None:
        version = book.last_unfinished()
        if version is None or self.stopping:
            return
        try:
            files = await asyncio.to_thread(_files_in_store, checkpoints, version, book)
        except (StorageError, ValueError) as exc:
            logger.warning("job %s: the final checkpoint v%d is not complete in the store: %s",
                           job.job_id, version, exc)  # fmt: skip
            return
        with contextlib.suppress(Exception):  # the jobs topic may be gone too when stopping
            await self._commit(job, spec, checkpoints, book, version, files)

    async def _publish(self, event: JobEvent) -> None:
        await self.producer.publish(self.topics.jobs, event, key=event.job_id)


def _files_in_store(
    checkpoints: CheckpointStore, version: int, book: CheckpointBook
) -> list[SliceFile]:
    """The files of ``version`` as written (their announcements may be lost): each slice's
    file is read back for its recorded offset. ObjectNotFound when one is missing."""
    # Reading a slice file back imports torch, which the checkpointer needs only here.
    from conveyor.training.checkpoint.slicefile import decode_slice

    files: list[SliceFile] = []
    for index in range(book.num_slices):
        announced = book.file(version, index)
        if announced is not None:
            files.append(announced)
            continue
        key = slice_key(checkpoints.job_id, version, index)
        info = checkpoints.store.info(key)
        state = decode_slice(checkpoints.store.get_bytes(key, expected_sha256=info.sha256 or None))
        if state.version != version:
            raise ObjectNotFound(f"{key} holds version {state.version}")
        files.append(SliceFile(slice_index=index, key=key, size_bytes=info.size_bytes,
                               sha256=info.sha256, grads_offset=state.grads_offset))  # fmt: skip
    return files
