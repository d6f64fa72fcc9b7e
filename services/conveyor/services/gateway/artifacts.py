"""What a job leaves in the object store, as the gateway serves it: checkpoints and the
exported model. Blocking store I/O: the routes call these in a thread."""

from __future__ import annotations

from conveyor.platform.config import StorageSettings
from conveyor.platform.storage import ObjectNotFound, ObjectStore, open_store
from conveyor.services.gateway.errors import ArtifactNotFound
from conveyor.training.checkpoint import (
    CheckpointInfo,
    CheckpointStore,
    JobProgress,
    resume_point,
)
from conveyor.training.exported import MODEL_FILES
from conveyor.training.jobspec import JobSpec
from conveyor.training.jobview import JobView
from conveyor.training.locations import output_uri


class JobArtifacts:
    """Reads a job's objects from its store (the spec's ``checkpoint.uri``, else the stack's;
    the roots' check applies as it does where they were written)."""

    def __init__(self, storage: StorageSettings) -> None:
        self.storage = storage

    def store_of(self, job: JobView) -> ObjectStore:
        """The job's object store (inside the operator's roots). ValueError for a spec that
        names no usable or allowed store."""
        spec = JobSpec.from_dict(job.spec)
        return open_store(output_uri(spec, self.storage), self.storage)

    def checkpoints(self, job: JobView) -> list[CheckpointInfo]:
        """Every checkpoint of the job, newest first (committed and incomplete)."""
        return CheckpointStore(self.store_of(job), job.job_id).listing()

    def resume_point(self, job: JobView) -> tuple[JobProgress | None, list[str]]:
        """The newest checkpoint the job can resume from (None: none), and why each newer one
        could not be used."""
        return resume_point(CheckpointStore(self.store_of(job), job.job_id))

    def model_file(self, job: JobView, name: str) -> bytes:
        """One file of the exported model (verified against its recorded sha256).
        :class:`ArtifactNotFound` when the job exported none (yet)."""
        if name not in MODEL_FILES:
            raise ArtifactNotFound(
                f"no model file {name!r}; the files are {', '.join(MODEL_FILES)}"
            )
        try:
            return self.store_of(job).get_bytes(f"jobs/{job.job_id}/{name}")
        except ObjectNotFound as exc:
            raise ArtifactNotFound(
                f"job {job.job_id!r} has no exported model yet (state: {job.state})"
            ) from exc
