"""When the aggregator's control reader may rest: right after a step closes, for part of the time
the step's first contribution took to arrive in recent steps.

The control reader fetches at the gradient plane's short wait (``plane_fetch_max_wait_ms``, 10
ms), so that a step closes a hop after its last contribution. Between a StepClose and the next
step's first contribution it can only send empty fetches (measured in ``bench_decode``: the
aggregator's busiest work, about 100 a second, each costing CPU here and in the broker), while
the trainers compute, on the same cores when the machine is shared. In sync and local mode
nothing that changes a step's outcome arrives in that time: the step waits for its members'
contributions, and a member computes for about as long as it did in the last steps. So after
each close the reader pauses (:meth:`conveyor.platform.bus.TopicTail.pause`) until ``fraction``
(0.9) of the recent close-to-first-contribution intervals' lower quartile has passed, and then
fetches at the short wait as before (the quartile, not the shortest: an epoch's last step, with
fewer batches, is short, and a job of few steps per epoch would rest little). A contribution
that comes sooner than that waits at most the rest; heartbeats, eval results and the other
records wait too, and none of them is due within a step. Bounded staleness does not rest: its
contributions come at any time.
"""

from __future__ import annotations

from collections import deque

from conveyor.platform.messages import Contribution, Message, StepClose


class ControlRest:
    """Learns how long after each StepClose the next step's first contribution arrives, and
    says how long the control reader may rest. Pure: the caller passes the times (monotonic s).
    Not thread-safe."""

    def __init__(
        self,
        *,
        enabled: bool,
        fraction: float = 0.9,
        max_rest_s: float = 1.0,
        min_rest_s: float = 0.02,
        window: int = 8,
        warm_up: int = 3,
    ) -> None:
        """``enabled``: the job closes steps on its members' contributions (sync, local);
        ``fraction`` of the lower quartile of the last ``window`` intervals is rested once
        ``warm_up`` intervals are known; a rest shorter than ``min_rest_s`` is not worth a
        pause and one longer than ``max_rest_s`` is cut to it."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        self.enabled = enabled
        self.fraction = fraction
        self.max_rest_s = max_rest_s
        self.min_rest_s = min_rest_s
        self.warm_up = warm_up
        self._intervals: deque[float] = deque(maxlen=window)
        self._version = 0
        self._closed_at: float | None = None
        """When the latest StepClose was read; None once its step's first contribution was."""

    def folded(self, message: Message, now: float) -> None:
        """Note one control record read at ``now``."""
        if isinstance(message, StepClose) and message.version > self._version:
            self._version = message.version
            self._closed_at = now
        elif (
            isinstance(message, Contribution)
            and message.base_version >= self._version
            and self._closed_at is not None
        ):
            self._intervals.append(now - self._closed_at)
            self._closed_at = None

    def rest_s(self, now: float) -> float:
        """Seconds the reader may pause from ``now`` (0: fetch). The caller asks only when
        nothing is pending (no undecided contribution, every owned slice at the version)."""
        if not self.enabled or self._closed_at is None or len(self._intervals) < self.warm_up:
            return 0.0
        typical = sorted(self._intervals)[len(self._intervals) // 4]  # the lower quartile
        until = self._closed_at + self.fraction * typical
        rest = min(until - now, self.max_rest_s)
        return rest if rest >= self.min_rest_s else 0.0
