"""One trainer's end of a job's gradient plane, built in one place: what it knows from the
plane's logs (the control fold, the newest parameters, its own contributions still undecided),
what it writes with (the contribution sender), and when it reads (the listener and the signal
that wakes whatever waits on the logs). The step loop (:mod:`conveyor.services.trainer.runner`)
drives these; nothing here decides anything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from opentelemetry import trace

from conveyor.platform.bus import Producer, TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.services.trainer.compute.session import JobSession
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.data.prefetch import TRACER_NAME, ReadyBatch
from conveyor.services.trainer.plane.control import ControlState
from conveyor.services.trainer.plane.listening import PlaneListener, Signal
from conveyor.services.trainer.plane.outstanding import Mode, Outstanding
from conveyor.services.trainer.plane.params import ParamAssembler
from conveyor.services.trainer.plane.sending import ContributionSender


class PlaneEndpoint:
    """The plane's parts for one trainer in one job (see the module docstring)."""

    def __init__(
        self,
        session: JobSession,
        *,
        settings: TrainerSettings,
        kafka: KafkaSettings,
        producer: Producer,
    ) -> None:
        spec, plan = session.spec, session.plan
        self.control = ControlState(
            worker_id=settings.worker_id,
            epochs=spec.training.epochs,
            train_batches_per_epoch=plan.train_batches_per_epoch,
            eval_batches_per_epoch=plan.eval_batches_per_epoch,
            member_timeout_s=settings.member_timeout_s,
        )
        """The job's control log, folded."""
        self.params = ParamAssembler(session.bounds)
        """The newest complete parameter version read from the params topic."""
        # Local mode's windows follow sync's protocol: one contribution, decided before the next.
        protocol: Mode = "ssp" if spec.distribution.mode == "ssp" else "sync"
        self.outstanding: Outstanding[ReadyBatch] = Outstanding(
            mode=protocol, staleness=spec.distribution.staleness
        )
        """This trainer's contributions between sending and their decision."""
        self.sender = ContributionSender(
            producer, session, worker_id=settings.worker_id, tracer=trace.get_tracer(TRACER_NAME)
        )
        """Puts this trainer's GradSlices, Contributions and EvalResults on the plane."""
        self.signal = Signal()
        """Fired once new records of either log are folded."""
        self.listener = PlaneListener(self.signal, enabled=protocol == "sync")
        """Lets the two readers rest while a sync step needs nothing from them."""
        self._kafka = kafka.for_gradient_plane()  # every step waits on these two readers
        self._control_topic = plan.control_topic
        self._params_topic = session.params_topic

    def epoch_in_hand(self, gathered: list[ReadyBatch]) -> bool:
        """Every train batch of the current epoch not applied yet is ``gathered`` for this
        step or in this trainer's outstanding contributions, so no other can arrive for it
        (an epoch whose count is not a multiple of the step would otherwise wait
        ``empty_contribution_wait_s`` at its end for a batch that does not exist)."""
        control = self.control
        epoch = control.current_epoch
        outstanding = sum(
            1 for pending in self.outstanding for batch in pending.batches
            if batch.epoch == epoch
        )  # fmt: skip
        return control.train_left(epoch) <= len(gathered) + outstanding

    @asynccontextmanager
    async def readers(self) -> AsyncIterator[tuple[TopicTail, TopicTail]]:
        """The control log's reader (from its first record: a replay) and the params topic's
        (from the last record of each partition: the newest version), at the plane's short
        fetch wait; both closed on exit."""
        async with (
            TopicTail(self._kafka, self._control_topic) as control,
            TopicTail(self._kafka, self._params_topic, start="last") as params,
        ):
            yield control, params
