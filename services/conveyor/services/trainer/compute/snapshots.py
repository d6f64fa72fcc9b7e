"""End-of-epoch parameters for evaluation: epoch E's eval batches are evaluated on the
parameters of the version at which E ended (all its train batches applied).

The runner hands over every complete parameter version that ended an epoch, as it sees them
(:meth:`EpochSnapshots.keep`); evaluation waits until the params topic reached that version
(a StepClose comes before its ParamSlices), and a trainer that never saw it whole (it joined
later) reads it back from the topic's history. Models are
built lazily, on the first eval batch of the epoch, and dropped once the control log shows the
epoch's eval covered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch
from torch import nn

from conveyor.platform.config import KafkaSettings
from conveyor.services.trainer.compute.session import JobSession
from conveyor.services.trainer.plane.control import ControlState
from conveyor.services.trainer.plane.params import fetch_version
from conveyor.training.jobhost import JobFailure

logger = logging.getLogger(__name__)

BuildSnapshot = Callable[[torch.Tensor], Awaitable[nn.Module]]
"""Builds a frozen model from fp32 [N] parameters (on the compute thread)."""
Reached = Callable[[int], Awaitable[None]]
"""Returns once the params topic was read up to (at least) a version."""


class EpochSnapshots:
    """Per open epoch: its end-of-epoch parameters, then the frozen model built from them."""

    def __init__(
        self, session: JobSession, kafka: KafkaSettings, build: BuildSnapshot, reached: Reached
    ) -> None:
        self._session = session
        self._kafka = kafka
        self._build = build
        self._reached = reached
        self._params: dict[int, torch.Tensor] = {}
        self._models: dict[int, nn.Module] = {}

    def __len__(self) -> int:
        return len(self._params) + len(self._models)

    def keep(self, version: int, flat: torch.Tensor, control: ControlState) -> None:
        """Remember ``flat`` (the parameters of ``version``, just loaded) for every epoch that
        ended at ``version`` and still has eval batches to cover."""
        for epoch, end_version in control.epoch_end.items():
            if end_version == version and not control.eval_done(epoch) and epoch not in self:
                self._params[epoch] = flat  # the assembler builds a new tensor per version

    def __contains__(self, epoch: int) -> bool:
        return epoch in self._params or epoch in self._models

    def drop_done(self, control: ControlState) -> None:
        """Forget the epochs whose eval the log shows covered."""
        for epoch in [e for e in (*self._params, *self._models) if control.eval_done(e)]:
            self._params.pop(epoch, None)
            self._models.pop(epoch, None)

    async def model(self, epoch: int, control: ControlState) -> nn.Module:
        """The frozen model at ``epoch``'s end. Raises :class:`JobFailure` when its parameters
        are gone from the params topic (retention), ``BusError`` when the broker fails."""
        model = self._models.get(epoch)
        if model is not None:
            return model
        version = control.epoch_end[epoch]
        if epoch not in self._params:
            await self._reached(version)
        flat = self._params.pop(epoch, None)
        if flat is None:
            session = self._session
            logger.info(
                "job %s: reading version %d back for epoch %d", session.job_id, version, epoch
            )
            flat = await fetch_version(
                self._kafka, session.params_topic, version, session.num_slices
            )
            if flat is None:
                raise JobFailure(
                    f"the parameters of version {version} (end of epoch {epoch}) are no longer "
                    f"on {session.params_topic}: its eval batches cannot be evaluated"
                )
        model = self._models[epoch] = await self._build(flat)
        return model
