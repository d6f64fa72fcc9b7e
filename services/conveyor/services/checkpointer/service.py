"""The checkpointer service: commits every job's checkpoints.

A :class:`~conveyor.training.jobhost.JobHostService` that hosts every planned job. For each it
tails the job's control topic from the beginning into a :class:`~.book.CheckpointBook` and:

- commits each checkpointed version once all its slices are saved: checks the files, writes
  the manifest (the commit), moves ``latest``, applies ``checkpoint.keep_last``, and publishes
  ``CheckpointCommitted`` on the jobs topic; a version a slice failed to save (or whose commit
  fails) gets ``CheckpointFailed`` and the previous checkpoint stays the latest;
- asks for a checkpoint (``CheckpointRequest``) every ``checkpoint.every_s`` seconds;
- at the job's end (let go when it turns terminal), reads the control topic up to its end
  first: the jobs topic can say ``completed`` before this reader reached the final
  checkpoint's announcements (the aggregator publishes it only after them); what is not
  announced by then (the topics went with the job) is committed from the store.

The final checkpoint of a completed job is also committed from the store when none of that
did it: the job completed while no checkpointer hosted it (it was down or restarting, or its
task had failed), or its task was let go before it read the final StepClose. Each completed job
is checked once per process, once no task of it hosts the job: on the first pass after start
(when the view holds the whole jobs topic) or the pass after it completed
(:meth:`CheckpointerService._commit_finals`).

Versions already committed (a restart, a second replica) are not committed again.

Beside the jobs it keeps the registry of live jobs in the stack's object store and, on a jobs
topic that lost them (the whole stack, broker included, restarted), brings them back from their
latest checkpoints (:mod:`.registry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from conveyor.platform.bus import BusError, TopicTail
from conveyor.platform.config import KafkaSettings, StorageSettings, TelemetrySettings
from conveyor.platform.messages import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointRequest,
    JobEvent,
)
from conveyor.platform.storage import StorageError, open_store
from conveyor.platform.telemetry import LATENCY_BUCKETS_S, counter, histogram
from conveyor.services.checkpointer.book import CheckpointBook, Checkpointed, final_checkpointed
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
    JobProgress,
    Manifest,
    SliceFile,
    slice_key,
)
from conveyor.training.checkpoint.slicehead import read_slice_head
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

_FINAL_READ_S = 10.0
"""Longest read of a let-go job's control topic up to its end (see ``_finish``)."""


class CheckpointerService(JobHostService[Prepared]):
    """One checkpointer process."""

    name = "checkpointer"
    needs_ended_specs = True  # a completed job's final checkpoint is committed after its end

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
        self.finals_settled: set[tuple[str, int]] = set()
        """(job id, incarnation) of the completed jobs whose final checkpoint
        :meth:`_commit_finals` committed, found committed, or found that it cannot be (the
        reason logged): not looked at again."""

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._keep_registry(), self._commit_finals()]

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

    async def _commit_finals(self) -> None:
        """Commit the final checkpoint of every completed job that lacks it (see the module
        docstring), once per job: a pass looks only at the completed jobs not settled yet and
        not hosted; a retriable storage failure leaves one for the next pass."""
        await self.view_ready()  # the jobs that completed while this process was down
        while True:
            hosted = set(self.hosted_jobs)  # a task's let-go (_finish) may be committing it
            for job in self.view.list(state="completed", limit=len(self.view) or 1):
                settled = (job.job_id, job.incarnation)
                if settled in self.finals_settled or job.job_id in hosted:
                    continue
                if await self._commit_final(job):
                    self.finals_settled.add(settled)
            await asyncio.sleep(self.settings.registry_interval_s)

    async def _commit_final(self, job: JobView) -> bool:
        """Commit completed ``job``'s final checkpoint from the store unless it is committed.
        False after a retriable storage failure; True otherwise (a reason is logged when it
        cannot be committed)."""
        version = (job.summary or {}).get("versions")
        if type(version) is not int or version < 0:
            logger.warning("job %s: its summary names no final version: no final checkpoint "
                           "to commit", job.job_id)  # fmt: skip
            return True
        if version == 0:  # it trained nothing: nothing was checkpointed
            return True
        try:
            spec, checkpoints = await self.prepare_job(job)
            found = await asyncio.to_thread(
                _final_in_store, checkpoints, version, spec.distribution.aggregator_shards,
                job.updated_at,
            )  # fmt: skip
        except (JobFailure, StorageError, ValueError) as exc:
            logger.warning("job %s: its final checkpoint v%d, not committed when the job "
                           "ended, cannot be committed: %s", job.job_id, version, exc)  # fmt: skip
            return not getattr(exc, "retriable", False)
        if found is None:
            return True
        point, files = found
        logger.info("job %s: its final checkpoint v%d was not committed when the job ended; "
                    "committing it from the store", job.job_id, version)  # fmt: skip
        await self._commit(job, spec, checkpoints, point, files)
        return True

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
        control_topic = job.plan.control_topic  # the view's plan changes on a resume
        async with TopicTail(self.kafka, control_topic, types=book.FOLDED) as control:
            committing: asyncio.Future[None] | None = None
            try:
                while True:
                    for record in await control.get_many(self.settings.poll_s):
                        book.fold(record.message)
                    # Shielded: the let-go below must not cut a commit in half (manifest
                    # written, its version marked done, but no ``checkpoint`` event).
                    committing = asyncio.ensure_future(
                        self._commit_ready(job, spec, checkpoints, book)
                    )
                    await asyncio.shield(committing)
                    await self._ask_on_time(job, spec, book, control_topic)
            except asyncio.CancelledError:
                # Let go: the job ended (or this process stops). A commit under way ends first.
                if committing is not None:
                    await committing
                await self._finish(job, spec, checkpoints, book, control)
                raise

    async def _commit_ready(
        self, job: JobView, spec: JobSpec, checkpoints: CheckpointStore, book: CheckpointBook
    ) -> None:
        """Commit every version whose slices are all saved; fail those a slice failed."""
        for version in book.failed():
            book.done.add(version)
            await self._failed(job.job_id, version, "; ".join(book.errors(version)))
        for version in book.ready():
            book.done.add(version)
            await self._commit(
                job, spec, checkpoints, book.checkpointed(version), book.files(version)
            )

    async def _ask_on_time(
        self, job: JobView, spec: JobSpec, book: CheckpointBook, control_topic: str
    ) -> None:
        """Ask for a checkpoint when ``checkpoint.every_s`` is due."""
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
        point: Checkpointed,
        files: list[SliceFile],
    ) -> None:
        """Commit ``point`` over ``files``: the manifest, ``latest``, retention, then
        ``CheckpointCommitted``; ``CheckpointFailed`` when the store refuses."""
        version = point.version
        plan = job.plan
        assert plan is not None
        manifest = Manifest(
            job_id=job.job_id,
            version=version,
            step=point.step,
            trigger=point.trigger,
            created_at=time.time(),
            files=files,
            data_cursor=point.data_cursor,
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
        seconds = max(0.0, time.time() - point.asked_at)
        _COMMITS.inc()
        _BYTES.inc(manifest.size_bytes)
        _COMMIT_SECONDS.observe(seconds)
        logger.info("job %s: checkpoint v%d committed (%s, %d bytes, %.2f s); retention removed %s",
                    job.job_id, version, manifest.trigger, manifest.size_bytes, seconds,
                    deleted or "nothing")  # fmt: skip
        await self._publish(CheckpointCommitted(
            job_id=job.job_id, version=version, step=point.step, trigger=manifest.trigger, uri=uri,
            size_bytes=manifest.size_bytes, seconds=seconds,
        ))  # fmt: skip

    async def _failed(self, job_id: str, version: int, reason: str) -> None:
        _FAILURES.inc()
        logger.warning("job %s: checkpoint v%d not committed: %s", job_id, version, reason)
        await self._publish(CheckpointFailed(job_id=job_id, version=version, reason=reason))

    async def _finish(
        self,
        job: JobView,
        spec: JobSpec,
        checkpoints: CheckpointStore,
        book: CheckpointBook,
        control: TopicTail,
    ) -> None:
        """The job was let go: commit its final checkpoint unless this process stops.

        The aggregator publishes ``completed`` only once every slice announced the final
        checkpoint on the control topic, but this reader may not have read those announcements
        yet (the jobs topic and the control topic are read apart): read the control topic up
        to its end of now first (at most ``_FINAL_READ_S``). What is still missing then (the
        topic went with the job, or the read timed out) is committed from the store."""
        if self.stopping:
            return
        try:
            await _read_to_end(control, book, self.settings.poll_s)
        except (BusError, TimeoutError) as exc:
            logger.info("job %s: its control topic could not be read to its end (%s); its "
                        "final checkpoint comes from the store", job.job_id, exc)  # fmt: skip
        await self._commit_ready(job, spec, checkpoints, book)
        version = book.last_unfinished()
        if version is None:
            return
        announced = functools.partial(book.file, version)
        try:
            files, _ = await asyncio.to_thread(
                _files_in_store, checkpoints, version, book.num_slices, announced
            )
        except (StorageError, ValueError) as exc:
            logger.warning("job %s: the final checkpoint v%d is not complete in the store: %s",
                           job.job_id, version, exc)  # fmt: skip
            return
        book.done.add(version)
        with contextlib.suppress(Exception):  # the jobs topic may be gone too when stopping
            await self._commit(job, spec, checkpoints, book.checkpointed(version), files)

    async def _publish(self, event: JobEvent) -> None:
        await self.producer.publish(self.topics.jobs, event, key=event.job_id)


async def _read_to_end(control: TopicTail, book: CheckpointBook, poll_s: float) -> None:
    """Fold ``control`` into ``book`` up to the end offsets it has now, within
    ``_FINAL_READ_S`` (TimeoutError past it; BusError when the topic is gone)."""
    async with asyncio.timeout(_FINAL_READ_S):
        ends = await control.end_offsets()
        while any((control.position(p) or 0) < end for p, end in ends.items()):
            for record in await control.get_many(poll_s):
                book.fold(record.message)


def _files_in_store(
    checkpoints: CheckpointStore,
    version: int,
    num_slices: int,
    announced: Callable[[int], SliceFile | None] = lambda index: None,
) -> tuple[list[SliceFile], JobProgress | None]:
    """The files of ``version`` as written (their announcements may be lost): the
    ``announced`` file of a slice (by index), else its file read back for its recorded offset;
    and slice 0's job progress when its file was read. StorageError (ObjectNotFound,
    ChecksumMismatch, CheckpointError: the reason names the file) when one is missing, torn
    or holds another slice or version."""
    files: list[SliceFile] = []
    progress: JobProgress | None = None
    for index in range(num_slices):
        entry = announced(index)
        if entry is not None:
            files.append(entry)
            continue
        key = slice_key(checkpoints.job_id, version, index)
        info = checkpoints.store.info(key)
        data = checkpoints.store.get_bytes(key, expected_sha256=info.sha256 or None)
        try:
            state = read_slice_head(data)  # without torch, which nothing here needs
        except ValueError as exc:
            raise CheckpointError(f"{key}: {exc}") from exc
        if (state.slice_index, state.version) != (index, version):
            raise CheckpointError(
                f"{key} holds slice {state.slice_index} of version {state.version}"
            )
        if index == 0:
            progress = state.progress
        files.append(SliceFile(slice_index=index, key=key, size_bytes=info.size_bytes,
                               sha256=info.sha256, grads_offset=state.grads_offset))  # fmt: skip
    return files, progress


def _final_in_store(
    checkpoints: CheckpointStore, version: int, num_slices: int, completed_at: float
) -> tuple[Checkpointed, list[SliceFile]] | None:
    """What commits a completed job's final ``version`` from its files alone (see
    :func:`~.book.final_checkpointed`); None when it is committed already. StorageError
    (the reason names the file) when a file is missing, torn or without the job's progress."""
    committed = checkpoints.committed_versions()
    if committed and committed[0] >= version:
        return None
    files, progress = _files_in_store(checkpoints, version, num_slices)
    if progress is None or progress.version != version:
        key = slice_key(checkpoints.job_id, version, 0)
        raise CheckpointError(f"{key} holds no job progress of version {version}")
    return final_checkpointed(progress, completed_at=completed_at), files
