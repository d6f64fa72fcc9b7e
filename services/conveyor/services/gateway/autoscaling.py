"""What the gateway shows at ``GET /v1/autoscaler``: the autoscaler's topic folded into the
current state of each pool it sizes, its recent decisions and its supervisor's restarts."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

from conveyor.platform.bus import TopicTail, wait_for_topics
from conveyor.platform.config import KafkaSettings
from conveyor.platform.messages import (
    Message,
    PreprocessorLoad,
    ScalingDecision,
    ServiceRestarted,
)

logger = logging.getLogger(__name__)

KEPT = 50
"""Recent decisions and restarts kept (the topic holds them all)."""
DATA_POOL = "preprocessor"
"""The pool whose state is ``state`` (the trainer pool's, when scaled, is under ``pools``)."""


class AutoscalerLog:
    """The fold of ``Topics.autoscaler`` (:meth:`apply`, no I/O) and the loop that feeds it
    (:meth:`follow`)."""

    def __init__(self) -> None:
        self.pools: dict[str, ScalingDecision] = {}
        """Pool -> its latest decision: its size and every input it was decided from."""
        self.changes = 0
        """Decisions that changed the pool (``up``, ``down``, ``clamp``)."""
        self.decisions: deque[ScalingDecision] = deque(maxlen=KEPT)
        """Recent decisions that changed the pool, oldest first."""
        self.restarts: deque[ServiceRestarted] = deque(maxlen=KEPT)

    def apply(self, message: Message) -> None:
        match message:
            case ScalingDecision():
                self.pools[message.service] = message
                if message.replicas_after != message.replicas_before:
                    self.changes += 1
                    self.decisions.append(message)
            case ServiceRestarted():
                self.restarts.append(message)
            case PreprocessorLoad():
                pass  # the autoscaler's input; its decisions carry the pool's mean
            case _:
                logger.warning("skipping %s on the autoscaler topic", type(message).__name__)

    @property
    def state(self) -> ScalingDecision | None:
        """The preprocessor pool's latest decision."""
        return self.pools.get(DATA_POOL)

    def snapshot(self) -> dict[str, Any]:
        """Plain values, newest first."""
        return {
            "state": _plain(self.state) if self.state is not None else None,
            "pools": {pool: _plain(decision) for pool, decision in sorted(self.pools.items())},
            "changes": self.changes,
            "decisions": [_plain(d) for d in reversed(self.decisions)],
            "restarts": [_plain(r) for r in reversed(self.restarts)],
        }

    async def follow(self, kafka: KafkaSettings, topic: str, poll_s: float = 1.0) -> None:
        """Wait for ``topic`` (the sharder creates it), then fold it until cancelled."""
        await wait_for_topics(kafka, [topic])
        async with TopicTail(kafka, topic) as tail:
            while True:
                for record in await tail.get_many(poll_s):
                    self.apply(record.message)


def _plain(message: Message) -> dict[str, Any]:
    return dataclasses.asdict(message)
