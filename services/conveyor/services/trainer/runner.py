"""Training one job through the aggregator: the trainer's side of the gradient plane.

Reads as the loop it runs::

    replay the job's control log; publish "running"
    follow: control log (StepClose, Rejection, EvalResult, Heartbeat) and params topic
    while training is not over (every epoch ended, or max_steps reached):
        wait until a step may start (sync: the last contribution is decided; ssp: a new one
            would likely stay within the staleness bound) and load the newest parameters
        gather the allocated micro-batches of the current epoch, forward/backward each
            (eval batches of ended epochs are evaluated on the way, EvalResult per batch)
        none within empty_contribution_wait_s -> an empty contribution (sync; a deterministic
            job waits for its step's micro-batches instead, taken in plan order)
        local mode: take an inner optimizer step, gather again, for sync_every_steps steps
            (overlap_steps: the first of them may run while the last window's delta travels,
            on the batches in hand, and are then moved onto the new version)
        flat gradient (local: the window's weighted parameter delta) -> K slices -> encode ->
            send all GradSlices (sync, ssp: each as the last backward completes it), await
            acks -> Contribution (its batch ids, the sample ids of every pass it ran)
    then evaluate what still comes, until the job is terminal (the service cancels us)

What the control log says drives everything else (:meth:`JobRunner._on_control`): a StepClose
acknowledges the batches it lists and decides this trainer's contributions; a Rejection sends
the batches back to be recomputed on newer parameters; an epoch that ended releases the held
batches of the next one and its eval batches. The trainer keeps no training state: the
aggregators' slice owners hold parameters and optimizer state, the control log holds what is
applied.

The runner moves things between five parts: this trainer's end of the plane
(:class:`~conveyor.services.trainer.plane.endpoint.PlaneEndpoint`: the control fold, the
parameters, the outstanding contributions, the sender, the listener), the batches coming in
(:class:`~conveyor.services.trainer.data.intake.BatchIntake`), the end-of-epoch snapshots, the
figures and the reporter.

Why one module past the conventions' 500 lines: what is left here is the loop itself, whose
steps share the runner's state (the loaded version, whether a local window moved the model,
whether a carried window was rejected, the error-feedback undo list and the inner optimizer
state to put back after a rejection, the parameter stamps), and
whose gather is the one seam the fault-injection tests patch (``tests/faults.py``). The parts
that hold no such state already live in ``plane/``, ``data/``, ``compute/`` and ``reporting/``;
cutting the loop across modules would pass that state back and forth instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
from opentelemetry import trace
from torch import nn

from conveyor.platform.bus import Producer, Tailed, TopicTail
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    EvalResult,
    ParamSlice,
    StepClose,
    TrainerJoined,
    TrainerState,
)
from conveyor.services.trainer.compute.engine import MicroResult
from conveyor.services.trainer.compute.session import JobSession
from conveyor.services.trainer.compute.snapshots import EpochSnapshots
from conveyor.services.trainer.config import TrainerSettings
from conveyor.services.trainer.data.intake import BatchIntake
from conveyor.services.trainer.data.order import batch_seed
from conveyor.services.trainer.data.prefetch import TRACER_NAME, Prefetcher, ReadyBatch
from conveyor.services.trainer.plane.control import Applied, Outcome
from conveyor.services.trainer.plane.endpoint import PlaneEndpoint
from conveyor.services.trainer.plane.gradients import EncodedGrad
from conveyor.services.trainer.plane.outstanding import Pending
from conveyor.services.trainer.plane.param_traces import ParamTraces
from conveyor.services.trainer.plane.sending import Computed, StepStamps, StreamedGradient
from conveyor.services.trainer.reporting.figures import TrainerFigures
from conveyor.services.trainer.reporting.metrics import TrainerMetrics
from conveyor.services.trainer.reporting.reporter import Reporter
from conveyor.training.jobhost import JobFailure

logger = logging.getLogger(__name__)

R = TypeVar("R")
LastPass = Callable[[ReadyBatch, int | None, list[Computed]], Awaitable[MicroResult]]
"""A step's last micro-batch pass when it does more than accumulate (:meth:`JobRunner._gather`):
the batch, its seed, the passes before it in the step; returns the pass."""

_FOLLOW_POLL_S = 0.5
_EVAL_ONLY_POLL_S = 1.0
_LEAVE_TIMEOUT_S = 2.0
"""How long a trainer leaving a job tries to send its leaving heartbeat."""


@dataclass(slots=True)
class Window:
    """Local mode: a window's passes so far, with the passes of each inner step (sync, ssp:
    the step's passes alone); the first ``carried`` steps ran before its base version was in
    (overlap_steps)."""

    computed: list[Computed] = field(default_factory=list)
    inner_steps: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    carried: int = 0
    inner_state: dict[str, Any] | None = None
    """Local mode: the inner optimizer's state before the window's first step."""


class JobRunner:
    """Trains one job until cancelled (the service cancels it when the job is terminal).

    Raises :class:`JobFailure` when the job cannot go on, ``BusError`` when the broker failed
    (retriable ones: the service rejoins after a backoff).
    """

    def __init__(
        self,
        session: JobSession,
        *,
        settings: TrainerSettings,
        kafka: KafkaSettings,
        producer: Producer,
        metrics: TrainerMetrics,
        compute_executor: Executor,
        copy_executor: Executor,
        placed_trainers: Callable[[], Collection[str]],
    ) -> None:
        """``placed_trainers``: the trainers the schedule puts on this job now (the first step
        splits over them with the live ones, :meth:`ControlState.micro_batches_for`)."""
        self.session = session
        self.settings = settings
        self._placed_trainers = placed_trainers
        self._compute_executor = compute_executor
        self.figures = TrainerFigures(
            metrics,
            session.device,
            rate_window_s=settings.rate_window_s,
            stage_window=settings.stage_window,
        )
        self.plane = PlaneEndpoint(session, settings=settings, kafka=kafka, producer=producer)
        self.intake = BatchIntake(
            session,
            self.plane.control,
            self.figures,
            kafka=kafka,
            producer=producer,
            prefetch_batches=settings.prefetch_batches,
            copy_executor=copy_executor,
        )
        self.snapshots = EpochSnapshots(session, kafka, self._build_snapshot, self._params_reached)
        self.reporter = Reporter(
            producer,
            jobs_topic=session.topics.jobs,
            control_topic=session.plan.control_topic,
            job_id=session.job_id,
            worker_id=settings.worker_id,
            progress_interval_s=settings.progress_interval_s,
            progress_max_interval_s=settings.progress_max_interval_s,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            progress=self.progress,
            heartbeat=self.heartbeat,
        )
        self.loaded_version: int | None = None
        self._window_moved = False
        """Local mode: inner steps moved the model away from ``loaded_version``."""
        self._carry_lost = False
        """Local mode's overlap: the window the carried steps continue was rejected."""
        self._undo: list[EncodedGrad] = []
        """Error-feedback corrections of rejected contributions, applied on the compute thread."""
        self._rewind: dict[str, Any] | None = None
        """Local mode: the inner optimizer's state before a rejected window, put back before
        the next window (on the compute thread)."""
        self._tracer = trace.get_tracer(TRACER_NAME)
        self._param_traces = ParamTraces()
        self._loaded_stamps: tuple[float | None, float | None] = (None, None)
        """(published_at, received_at) of ``loaded_version``'s parameters."""

    # -- the job ------------------------------------------------------------------------------

    async def run(self) -> None:
        session, plane = self.session, self.plane
        async with plane.readers() as (control_tail, params_tail):
            while not control_tail.caught_up:  # replay: what is applied, where epochs ended
                self._on_control(await control_tail.get_many(_FOLLOW_POLL_S))
            plane.sender.next_sequence = plane.control.last_sequence + 1
            logger.info(
                "job %s: joined at version %d (epoch %d)",
                session.job_id, plane.control.version, plane.control.current_epoch,
            )  # fmt: skip
            await self.reporter.publish_event(
                TrainerJoined(job_id=session.job_id, worker_id=self.settings.worker_id)
            )
            async with self.intake.open() as prefetch:
                try:
                    await self._serve(prefetch, control_tail, params_tail)
                finally:
                    await self._leave()

    async def _serve(self, prefetch: Prefetcher, control: TopicTail, params: TopicTail) -> None:
        self.plane.listener.attach(control, params)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(prefetch.run(), name="trainer.prefetch"),
                    group.create_task(self.reporter.run(), name="trainer.report"),
                    group.create_task(self._follow(control, self._on_control), name="control"),
                    group.create_task(self._follow(params, self._on_params), name="params"),
                ]
                await self._train()
                await self._evaluate_until_cancelled()
                for task in tasks:
                    task.cancel()
        except BaseExceptionGroup as failed:
            if len(failed.exceptions) == 1:  # the failing task's own exception, not a group
                raise failed.exceptions[0] from None
            raise

    async def _leave(self) -> None:
        """Let go of the batches and tell the coordinator at once that this member is gone (not
        after its timeout)."""
        self.intake.let_go()
        try:
            # Bounded: a send to a deleted control topic waits out the request timeout.
            async with asyncio.timeout(_LEAVE_TIMEOUT_S):
                await self.reporter.send_heartbeat(leaving=True)
        except Exception as exc:  # leaving anyway; the member timeout covers it
            logger.info("job %s: no leaving heartbeat: %s", self.session.job_id, exc)

    def _training_over(self) -> bool:
        """Every epoch ended, or ``max_steps`` reached: the coordinator caps the version (what
        every trainer sees in the StepCloses, so all stop at the same point)."""
        max_steps = self.session.spec.training.max_steps
        if max_steps is not None and self.plane.control.version >= max_steps:
            return True
        return self.plane.control.train_done

    # -- following the logs -------------------------------------------------------------------

    async def _follow(self, tail: TopicTail, handle: Callable[[list[Tailed]], None]) -> None:
        while True:
            records = await tail.get_many(_FOLLOW_POLL_S)
            if records:
                handle(records)

    def _on_control(self, records: list[Tailed]) -> None:
        control, intake = self.plane.control, self.intake
        for record in records:
            message = record.message
            control.apply(message)
            if isinstance(message, StepClose | EvalResult):
                intake.done(message.batch_ids)
        for pending, outcome in self.plane.outstanding.resolve(control):
            self._decided(pending, outcome)
        intake.book.release(control)
        self._keep_epoch_params()
        self.snapshots.drop_done(control)
        self.plane.signal.fire()

    def _on_params(self, records: list[Tailed]) -> None:
        received_at = time.time()
        for record in records:
            if isinstance(record.message, ParamSlice):
                try:
                    self.plane.params.add(record.message, received_at=received_at)
                except ValueError as exc:
                    raise JobFailure(f"parameters on {record.topic} do not fit: {exc}") from exc
                self._param_traces.add(record, record.message.version)
        self._param_traces.forget_before(self.plane.params.version)
        self._keep_epoch_params()
        self.plane.signal.fire()

    def _keep_epoch_params(self) -> None:
        """Keep the newest complete parameters if they are an epoch's end-of-epoch version
        (also once training is over, when the last versions are no longer loaded)."""
        params = self.plane.params
        if params.version is not None and params.flat is not None:
            self.snapshots.keep(params.version, params.flat, self.plane.control)

    def _decided(self, pending: Pending[ReadyBatch], outcome: Outcome) -> None:
        if isinstance(outcome, Applied):
            self.figures.contribution_applied(
                samples=pending.num_samples, batches=len(pending.batches), loss_sum=pending.loss_sum
            )
        elif pending.batches:  # an empty one's step closed without it: nothing to redo
            self.figures.contribution_rejected()
            self._carry_lost = True
            logger.info(
                "job %s: contribution %s rejected (%s); recomputing its batches",
                self.session.job_id, pending.contribution_id, outcome.reason,
            )  # fmt: skip
            # Batches applied elsewhere meanwhile are dropped (acknowledged by their close).
            self.intake.book.requeue(pending.batches, self.plane.control)
            if pending.feedback is not None:
                self._undo.append(pending.feedback)
            if pending.inner_state is not None:
                self._rewind = pending.inner_state

    # -- training -----------------------------------------------------------------------------

    async def _train(self) -> None:
        listener, first = self.plane.listener, True
        if self.plane.control.version == 0:
            # A fresh job: no batch can come before the batches group is joined. Start-up, not
            # a step: the first step's stamps (and the job's samples/s) begin after it. Nothing
            # on the plane's logs matters before the first step, which waits on them: they
            # rest through the join (2-3 s on the embedded broker, ~130 empty fetches a second).
            with listener.quiet():
                await self.intake.joined()
        while not self._training_over():
            carried = await self._overlap()
            started = time.perf_counter()
            await listener.wait_for(lambda: self._may_start() or self._training_over())
            if self._training_over():
                break  # carried steps' batches stay unacknowledged: the job ends here
            carried = await self._load_newest(carried)
            # The first wait is for the job's first parameters: start-up, not the plane's cost.
            param_wait_s = 0.0 if first else time.perf_counter() - started
            first = False
            self.figures.params_waited(param_wait_s)
            with listener.quiet():
                await self._step(param_wait_s, started_at=time.time(), carried=carried)
        logger.info(
            "job %s: training over at version %d; evaluating until the job ends",
            self.session.job_id, self.plane.control.version,
        )  # fmt: skip
        self.reporter.request_progress()

    def _may_start(self) -> bool:
        """Sync: the last contribution is decided. Bounded staleness: at most ``s`` of this
        trainer's contributions are outstanding, and a new one would likely not arrive staler
        than ``s``: versions not loaded yet + contributions on the log waiting for their
        decision (every trainer's) stay within ``s`` (else it would mostly be rejected)."""
        outstanding = self.plane.outstanding
        if not outstanding.can_start or outstanding.mode == "sync":
            return outstanding.can_start
        control, newest = self.plane.control, self.plane.params.version or 0
        ahead = max(0, control.version - newest)
        waiting = max(control.undecided(time.time()), len(outstanding))
        return ahead + waiting <= outstanding.staleness

    async def _load_newest(self, carried: Window | None = None) -> Window | None:
        """Load the newest parameters whose StepClose has been folded (so epoch ends up to it
        are known); sync mode: the latest closed version exactly. ``carried``: local mode's
        overlapped steps, moved onto that version (:meth:`Engine.rebase`) unless the window
        they continue was rejected (then their batches go back, to be recomputed); returns
        what was kept of them."""
        plane = self.plane
        control, params = plane.control, plane.params
        if plane.outstanding.mode == "sync":
            await plane.listener.wait_for(lambda: params.version == control.version)
        else:
            await plane.listener.wait_for(
                lambda: params.version is not None and params.version <= control.version
            )
        version, flat = params.version, params.flat
        assert version is not None and flat is not None
        undo, self._undo = self._undo, []
        for encoded in undo:
            await self._compute(self.session.engine.encoder.undo, encoded)
        rewind, self._rewind = self._rewind, None
        if rewind is not None:
            assert self.session.engine.inner is not None
            await self._compute(self.session.engine.inner.restore, rewind)
        if carried is not None and self._carry_lost:
            self.intake.book.requeue([c.batch for c in carried.computed], control)
            carried = None
        self._carry_lost = False
        if version == self.loaded_version and not self._window_moved:
            return carried
        self._loaded_stamps = (params.published_at, params.received_at)
        engine = self.session.engine
        move = engine.load if carried is None else engine.rebase
        with self._param_traces.load_span(self._tracer, self.session.params_topic, version):
            load_s = await self._compute(move, flat)
        self._window_moved = False
        self.figures.params_loaded(version, load_s)
        self.loaded_version = version
        self.snapshots.keep(version, flat, control)
        return carried

    async def _step(
        self, param_wait_s: float, *, started_at: float, carried: Window | None = None
    ) -> None:
        """Gather, compute and send one contribution on the loaded version (loaded by
        ``started_at``, Unix seconds); local mode: ``carried`` are its window's first steps."""
        engine, base, plane = self.session.engine, self.loaded_version, self.plane
        assert base is not None
        spec = self.session.spec
        wanted = self._share()
        if spec.distribution.deterministic:  # the one trainer takes every step whole, also
            wanted = spec.micro_batches_per_step  # when an allocation counts a dead predecessor
        if plane.outstanding.mode == "ssp":
            # Each ssp contribution is a step of its own, and nothing would end a turn of 0
            # (sync answers it with an empty contribution and waits for the close).
            wanted = max(1, wanted)
        streamed: StreamedGradient | None = None
        if engine.inner is None:

            async def stream(
                item: ReadyBatch, seed: int | None, before: list[Computed]
            ) -> MicroResult:
                nonlocal streamed  # the slices leave as the step's last backward makes them
                samples = sum(c.result.samples for c in before) + int(item.y.shape[0])
                result, streamed = await plane.sender.stream(
                    base, [c.batch for c in before] + [item],
                    partial(self._compute, engine.accumulate_streamed, item.x, item.y, seed,
                            samples, span=item),
                )  # fmt: skip
                return result

            overlap = spec.distribution.overlaps_backward(engine.layout.numel * 4)
            patience_s = self.settings.empty_contribution_wait_s
            computed, wait_s = await self._gather(
                wanted, patience_s, last_pass=stream if overlap else None
            )
            window = Window()
        else:
            window = await self._window(wanted, base, carried or Window())
            computed, wait_s = window.computed, window.wait_s
        if not computed:
            # Not when the step closed without this trainer (the others ended the epoch).
            closed = plane.control.version != base
            if plane.outstanding.mode == "sync" and not self._training_over() and not closed:
                pending = await plane.sender.send_empty(base, plane.control.current_epoch)
                plane.outstanding.add(pending)
                self.figures.empty_sent()
            return
        if streamed is None:
            make = engine.gradient if engine.inner is None else engine.delta
            encoded, encode_s = await self._compute(make, sum(c.result.samples for c in computed))
            outgoing = plane.sender.start(base, [c.batch for c in computed])
        else:
            outgoing, encoded, encode_s = streamed.outgoing, streamed.encoded, streamed.encode_s
        published_at, received_at = self._loaded_stamps
        stamps = StepStamps(params_published_at=published_at, params_received_at=received_at,
                            started_at=started_at, computed_at=time.time())  # fmt: skip
        pending, grad_send_s = await outgoing.finish(
            computed, encoded, inner_steps=window.inner_steps, carried_steps=window.carried,
            inner_state=window.inner_state, stamps=stamps,
        )  # fmt: skip
        plane.outstanding.add(pending)
        self.figures.contribution_sent(
            grad_bytes=encoded.nbytes,
            data_wait_s=wait_s,
            h2d_s=sum(b.h2d_s for b in pending.batches),
            batches_compute_s=sum(c.result.compute_s for c in computed),
            encode_s=encode_s,
            grad_send_s=grad_send_s,
            param_wait_s=param_wait_s,
        )

    def _share(self) -> int:
        """This trainer's micro-batches for its next step. Before the first allocation the
        split counts the trainers placed on the job too: one that starts before another's
        first heartbeat reaches it would otherwise take the whole step beside the other's
        share, and one of the two (a whole local window) would be rejected as over the
        global batch."""
        control = self.plane.control
        placed = () if control.allocation else self._placed_trainers()
        return control.micro_batches_for(
            self.session.spec.micro_batches_per_step, time.time(), placed=placed
        )

    async def _window(self, wanted: int, base: int, window: Window) -> Window:
        """Local mode: ``window`` (its carried steps, if any) completed to ``sync_every_steps``
        inner steps of ``wanted`` micro-batches on ``base``, ending at one that finds fewer
        (past ``inner.waiting_steps``: waits for none)."""
        inner, control = self.session.engine.inner, self.plane.control
        assert inner is not None
        waiting = inner.waiting_steps(control.train_left(control.current_epoch))
        for index in range(len(window.inner_steps), inner.window):
            patience_s = self.settings.empty_contribution_wait_s if index < waiting else 0.0
            if not await self._inner_step(window, wanted, patience_s, inner.lr(base, index)):
                break
        self._window_moved = bool(window.computed)  # the model left the version: load anew
        return window

    async def _overlap(self) -> Window | None:
        """Local mode with ``overlap_steps``: while the last window's delta travels (sent, not
        decided, or its version not in yet), up to ``overlap_steps`` inner steps of the next
        window on the batches in hand (waiting for none), at the schedule of the version the
        delta should make. None when there is nothing to overlap."""
        engine, plane = self.session.engine, self.plane
        inner, control = engine.inner, plane.control
        if inner is None or not engine.can_overlap or len(plane.outstanding) != 1:
            return None
        assert self.loaded_version is not None
        wanted = self._share()
        window = Window()
        while (
            len(window.inner_steps) < inner.overlap_steps
            and wanted > 0
            and not self._training_over()
            and not (self._may_start() and plane.params.version == control.version)
        ):
            lr = inner.lr(self.loaded_version + 1, len(window.inner_steps))
            if not await self._inner_step(window, wanted, 0.0, lr):
                break
        window.carried = len(window.inner_steps)
        self.figures.steps_overlapped(window.carried)
        return window if window.computed else None

    async def _inner_step(self, window: Window, wanted: int, patience_s: float, lr: float) -> bool:
        """Gather up to ``wanted`` micro-batches and take one inner step on them, added to
        ``window``; whether the window may go on (it got all it wanted)."""
        engine, stepped = self.session.engine, False

        async def last(item: ReadyBatch, seed: int | None, before: list[Computed]) -> MicroResult:
            nonlocal stepped
            samples = sum(c.result.samples for c in before) + int(item.y.shape[0])
            first = window.inner_state is None  # keep what a rejection puts back
            result, state = await self._compute(
                engine.accumulate_and_step, item.x, item.y, seed, samples, lr, first, span=item
            )
            if first:
                window.inner_state = state
            stepped = True
            return result

        held = [c.batch for c in window.computed]
        step, waited = await self._gather(wanted, patience_s, held, last_pass=last)
        window.wait_s += waited
        if not step:
            return False
        if not stepped:  # fewer than wanted came: the step in a compute call of its own
            samples = sum(c.result.samples for c in step)
            if window.inner_state is None:
                window.inner_state = await self._compute(engine.first_inner_step, samples, lr)
            else:
                await self._compute(engine.inner_step, samples, lr)
        window.computed += step
        window.inner_steps.append(len(step))
        return len(step) == wanted

    async def _gather(
        self, wanted: int, patience_s: float, held: list[ReadyBatch] | None = None,
        *, last_pass: LastPass | None = None,
    ) -> tuple[list[Computed], float]:  # fmt: skip
        """Up to ``wanted`` micro-batches of the current epoch, each computed as it comes; stops
        early when none arrives within ``patience_s`` (a deterministic job waits, and takes them
        in plan order, each with its own seed). ``held``: batches computed for this contribution
        before (local mode's earlier inner steps); ``last_pass``: runs the ``wanted``-th pass
        instead of a plain accumulate (sync: sending the slices as its backward completes them;
        local: the inner step in the same compute call). Returns passes and seconds waited."""
        intake, spec, engine = self.intake, self.session.spec, self.session.engine
        deterministic = spec.distribution.deterministic
        computed: list[Computed] = []
        earlier = held or []
        wait_s = 0.0
        while len(computed) < wanted and not self._training_over():
            intake.drop_revoked()
            await self._evaluate_ready()
            item, dropped = intake.book.next_train(self.plane.control)
            self.figures.batches_dropped(dropped, "applied elsewhere")
            if item is None:
                gathered = earlier + [c.batch for c in computed]
                if gathered and self.plane.epoch_in_hand(gathered):
                    break  # the rest of the epoch is here: waiting would only stall the step
                if gathered or deterministic:
                    received, waited = await intake.receive(patience_s)
                else:  # a sync step closes without it once the others' batches end the epoch
                    with self.plane.listener.listening():
                        received, waited = await intake.receive_unless(
                            patience_s, lambda: self.plane.control.version != self.loaded_version
                        )
                wait_s += waited
                if not received and not deterministic:
                    break
                continue  # deterministic: a partial step would change the step's sums
            seed = batch_seed(spec.training.seed, item.batch_id) if deterministic else None
            if last_pass is not None and len(computed) + 1 == wanted:  # the step's last pass
                result = await last_pass(item, seed, computed)
            else:
                result = await self._compute(engine.accumulate, item.x, item.y, seed, span=item)
            self.figures.batch_done(item, result)
            computed.append(Computed(item, result))
        return computed, wait_s

    # -- evaluation ---------------------------------------------------------------------------

    async def _evaluate_until_cancelled(self) -> None:
        while True:
            await self._evaluate_ready()
            await self.intake.receive(_EVAL_ONLY_POLL_S, count_wait=False)

    async def _evaluate_ready(self) -> None:
        """Evaluate the queued eval batches of ended epochs; one EvalResult per batch (the
        batch is acknowledged once an EvalResult covering it is on the control log)."""
        control = self.plane.control
        while True:
            item, dropped = self.intake.book.next_eval(control)
            self.figures.batches_dropped(dropped, "evaluated elsewhere")
            if item is None:
                return
            model = await self.snapshots.model(item.epoch, control)
            result = await self._compute(
                self.session.engine.evaluate, model, item.x, item.y, span=item
            )
            self.figures.batch_done(item, result)
            await self.plane.sender.send_eval(item, result, version=control.epoch_end[item.epoch])
            self.figures.eval_sent()

    async def _params_reached(self, version: int) -> None:
        params = self.plane.params
        await self.plane.listener.wait_for(
            lambda: params.version is not None and params.version >= version
        )

    async def _build_snapshot(self, flat: torch.Tensor) -> nn.Module:
        return await self._compute(self.session.engine.snapshot, flat)

    # -- helpers ------------------------------------------------------------------------------

    async def _compute(self, fn: Callable[..., R], *args: Any, span: ReadyBatch | None = None) -> R:
        """Run ``fn`` on the compute thread; a failure there fails the job."""
        started_ns = time.time_ns()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._compute_executor, fn, *args)
        except Exception as exc:
            raise JobFailure(f"training failed: {type(exc).__name__}: {exc}") from exc
        if span is not None:
            parent = trace.set_span_in_context(span.span)
            self._tracer.start_span("compute", context=parent, start_time=started_ns).end()
        return result

    # -- reports ------------------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        control = self.plane.control
        return self.figures.progress(epoch=control.current_epoch, version=self.loaded_version)

    def heartbeat(self) -> TrainerState:
        queues = {"outstanding": len(self.plane.outstanding), **self.intake.queues()}
        return self.figures.heartbeat(
            epoch=self.plane.control.current_epoch,
            version=self.loaded_version,
            queues=queues,
            # What the coordinator weights the routing of batches by (conveyor.training.routing).
            batches_partitions=self.intake.partitions(),
        )
