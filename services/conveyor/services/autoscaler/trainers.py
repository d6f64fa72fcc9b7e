"""The sizing of the trainer pool from the queue of jobs: a pure fold, like :mod:`.policy`.

The scheduler (``conveyor.training.scheduling``) places the pool's trainers on jobs; this fold
sizes the pool so that the jobs get what they ask for, within ``[min_replicas,
max_replicas]``. Its input is the trainers that the servable jobs (running or queued) ask for,
``distribution.trainers`` each (not ``max_trainers``: growth past what a job asks is for spare
trainers, not a reason to add machines). The rules:

1. **Clamp** a pool outside the bounds into them.
2. **Up at once** to what the jobs ask (within the bounds) when it is more than the pool: a job
   waits in the queue or runs short of what it asked, and a new trainer takes minutes only
   where a machine must be found (the driver's part).
3. **Down after a cooldown** to what the jobs ask (at least ``min_replicas``) once the pool has
   had more trainers than that for ``cooldown_s`` (no change meanwhile): a job that ends is
   often followed by the next one.
4. Otherwise hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.services.autoscaler.policy import Verdict


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainerPoolConfig:
    """Bounds and cooldown of the trainer pool (``CONVEYOR_AUTOSCALER_TRAINER_*``)."""

    min_replicas: int
    """Fewest trainers (>= 0)."""
    max_replicas: int
    """Most trainers (>= min_replicas, >= 1)."""
    cooldown_s: float = 60.0
    """Seconds the pool must have had more trainers than asked before it shrinks."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                "need 0 <= trainer min_replicas <= max_replicas and max_replicas >= 1, got "
                f"{self.min_replicas}, {self.max_replicas}"
            )
        if self.cooldown_s < 0:
            raise ValueError("trainer cooldown_s must be >= 0")


class TrainerPolicy:
    """The fold: :meth:`decide` once per measurement, in time order."""

    def __init__(self, config: TrainerPoolConfig) -> None:
        self.config = config
        self._surplus_since: float | None = None

    def decide(self, *, at: float, replicas: int, asked: int, queued: int) -> Verdict:
        """``at``: seconds (any one clock); ``replicas``: trainers the driver counts;
        ``asked``: trainers the servable jobs ask for; ``queued``: jobs waiting in the queue."""
        config = self.config
        if not config.min_replicas <= replicas <= config.max_replicas:
            self._surplus_since = None
            target = min(max(replicas, config.min_replicas), config.max_replicas)
            return Verdict(action="clamp", target=target,
                           reason=f"{replicas} trainers outside [{config.min_replicas}, "
                                  f"{config.max_replicas}]")  # fmt: skip
        target = min(max(asked, config.min_replicas), config.max_replicas)
        why = f"jobs ask {asked} trainers, {queued} queued"
        if target > replicas:
            self._surplus_since = None
            return Verdict(action="up", target=target, reason=why)
        if target == replicas:
            self._surplus_since = None
            return Verdict(action="hold", target=replicas, reason=why)
        if self._surplus_since is None:
            self._surplus_since = at
        if at - self._surplus_since < config.cooldown_s:
            return Verdict(action="hold", target=replicas, reason=f"{why}; cooling down")
        self._surplus_since = None
        return Verdict(action="down", target=target,
                       reason=f"{why} for {config.cooldown_s:.0f} s")  # fmt: skip
