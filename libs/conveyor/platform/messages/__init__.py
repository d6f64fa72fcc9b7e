"""Message schemas and topic names: the wire contract between Conveyor's services.

A schema is a ``@dataclass(kw_only=True, slots=True)`` subclass of :class:`Message`,
registered under its wire name and schema version::

    @message("Example", version=1)
    @dataclass(kw_only=True, slots=True)
    class Example(Message):
        \"\"\"What it means, who sends it, on which topic.\"\"\"

        job_id: str
        \"\"\"Id of the job.\"\"\"
        x: Tensor
        \"\"\"uint8 [B, C, H, W] images.\"\"\"

Field types allowed: ``None``, ``bool``, ``int``, ``float`` (an ``int`` is accepted too),
``str``, ``bytes``, ``list[...]``, ``dict[str, ...]`` (nested of those), ``Any`` (a plain value
of those types), a union of those with ``None``, ``torch.Tensor`` either as a whole field or as
the values of a ``dict[str, Tensor]`` field, and typed rows: a :class:`Record` subclass (a
frozen kw-only slotted dataclass of plain fields) as a field or as ``list[Row]``. Registration
turns each annotation into a :class:`FieldSpec` that the codec (:mod:`conveyor.platform.codec`)
checks values against, so annotations must resolve at import time: every name but ``Tensor``
imported for real; ``Tensor`` is imported from torch under ``TYPE_CHECKING`` and resolves to
:class:`~conveyor.platform.messages.registry.TensorAnnotation`, so that the schemas (and the
services that never see a tensor) load without torch. Changing a schema's fields means a new
version number.

The package keeps the whole wire contract in one place: the registry
(:mod:`~conveyor.platform.messages.registry`), the topic names
and layout (:mod:`~conveyor.platform.messages.topics`) and the schemas, grouped by plane
(:mod:`~conveyor.platform.messages.data_plane`, :mod:`~conveyor.platform.messages.job_events`,
:mod:`~conveyor.platform.messages.gradient_plane`). Import from the package itself: importing
it registers every schema.
"""

from conveyor.platform.messages.registry import (
    ENVELOPE_KEYS,
    FieldKind,
    FieldSpec,
    Message,
    MessageSchema,
    Record,
    message,
    registered_messages,
    schema_for,
)
from conveyor.platform.messages.topics import (
    SPLITS,
    Topics,
    TopicSpec,
    batch_id_for,
    shard_id_for,
)

# isort: split
# The schema modules register their schemas when imported, in this order (the order of
# registered_messages()).
from conveyor.platform.messages.data_plane import (
    Batch,
    DeadLetter,
    Heartbeat,
    ShardTask,
    TrainerState,
)

# isort: split
from conveyor.platform.messages.job_events import (
    COORDINATOR_WORKER_ID,
    TERMINAL_EVENTS,
    CancelRequested,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointUnusable,
    CoordinatorProgress,
    EpochCompleted,
    JobCancelled,
    JobCompleted,
    JobEvent,
    JobFailed,
    JobPlanned,
    JobResumed,
    JobSubmitted,
    SamplesSkipped,
    TrainerJoined,
    TrainerPresence,
    TrainerProgress,
)

# isort: split
from conveyor.platform.messages.gradient_plane import (
    AppliedContribution,
    CheckpointRequest,
    Contribution,
    EndedEpoch,
    EvalResult,
    GradSlice,
    ParamSlice,
    Rejection,
    ResumePoint,
    SliceSaved,
    StepClose,
    sample_ids_tensor,
)

# isort: split
from conveyor.platform.messages.scaling import (
    SCALING_ACTIONS,
    JobSignals,
    PreprocessorLoad,
    ScalingDecision,
    ServiceRestarted,
)

__all__ = [
    "COORDINATOR_WORKER_ID",
    "ENVELOPE_KEYS",
    "SCALING_ACTIONS",
    "SPLITS",
    "TERMINAL_EVENTS",
    "AppliedContribution",
    "Batch",
    "CancelRequested",
    "CheckpointCommitted",
    "CheckpointFailed",
    "CheckpointRequest",
    "CheckpointUnusable",
    "Contribution",
    "CoordinatorProgress",
    "DeadLetter",
    "EndedEpoch",
    "EpochCompleted",
    "EvalResult",
    "FieldKind",
    "FieldSpec",
    "GradSlice",
    "Heartbeat",
    "JobCancelled",
    "JobCompleted",
    "JobEvent",
    "JobFailed",
    "JobPlanned",
    "JobResumed",
    "JobSignals",
    "JobSubmitted",
    "Message",
    "MessageSchema",
    "ParamSlice",
    "PreprocessorLoad",
    "Record",
    "Rejection",
    "ResumePoint",
    "SamplesSkipped",
    "ScalingDecision",
    "ServiceRestarted",
    "ShardTask",
    "SliceSaved",
    "StepClose",
    "TopicSpec",
    "Topics",
    "TrainerJoined",
    "TrainerPresence",
    "TrainerProgress",
    "TrainerState",
    "batch_id_for",
    "message",
    "registered_messages",
    "sample_ids_tensor",
    "schema_for",
    "shard_id_for",
]
