"""When the aggregator's control reader rests (resting.py): after each StepClose, for a
fraction of the lower quartile of the recent close-to-first-contribution intervals; never in
ssp mode, before enough steps were seen, or once the step's first contribution is read. Fed
the records of a real coordinator's sync steps."""

from __future__ import annotations

import pytest
from coordinator_cases import T0, batch, beat, contrib, coordinator, echo

from conveyor.services.aggregator.coordinator import Coordinator
from conveyor.services.aggregator.resting import ControlRest


def step(c: Coordinator, rest: ControlRest, at: float, computed_s: float) -> float:
    """One sync step of worker ``a``: its contribution read ``computed_s`` after ``at`` (when
    the previous close was read), then the close that it completes read 0.01 s later;
    returns when the close was read."""
    version = c.version
    contribution = contrib("a", version, [batch(0, 4 * version + i) for i in range(4)])
    c.fold(contribution)
    rest.folded(contribution, at + computed_s)
    decisions = c.decide(at + computed_s)
    assert decisions.close is not None and decisions.close.version == version + 1
    echo(c, decisions)
    rest.folded(decisions.close, at + computed_s + 0.01)
    return at + computed_s + 0.01


def test_rests_a_fraction_of_the_recent_intervals_lower_quartile_after_each_close() -> None:
    c, rest = coordinator(train=64), ControlRest(enabled=True, fraction=0.5)
    c.fold(beat("a", T0, 100.0))
    at = T0
    # the first close is not preceded by a timed interval: three steps make two
    at = step(c, rest, at, 0.50)
    at = step(c, rest, at, 0.40)
    at = step(c, rest, at, 0.60)
    assert rest.rest_s(at) == 0.0  # two intervals known: not warmed up
    at = step(c, rest, at, 0.45)
    assert rest.rest_s(at) == pytest.approx(0.5 * 0.40)  # of three: the shortest
    assert rest.rest_s(at + 0.1) == pytest.approx(0.1)
    assert rest.rest_s(at + 0.19) == 0.0  # 10 ms left: not worth a pause
    rest.folded(contrib("a", c.version, [batch(0, 40)]), at + 0.05)  # sooner than learnt
    assert rest.rest_s(at + 0.05) == 0.0  # its step is under way: fetch until it closes


def test_one_short_step_does_not_set_the_rest_and_a_long_one_is_capped() -> None:
    c, rest = coordinator(train=64), ControlRest(enabled=True, fraction=0.5, max_rest_s=1.0)
    c.fold(beat("a", T0, 100.0))
    at = T0
    for computed_s in (5.0, 5.0, 5.0, 5.0):
        at = step(c, rest, at, computed_s)
    assert rest.rest_s(at) == pytest.approx(1.0)  # 2.5 s capped
    for computed_s in (0.4, 0.1, 0.4, 0.4, 0.4):  # an epoch's last, short step among them
        at = step(c, rest, at, computed_s)
    assert rest.rest_s(at) == pytest.approx(0.5 * 0.4)  # not 0.5 x 0.1
    for _ in range(2):
        at = step(c, rest, at, 0.1)  # the steps got faster: so do the rests
    assert rest.rest_s(at) == pytest.approx(0.5 * 0.1)


def test_no_rest_when_disabled_or_for_an_older_steps_contribution() -> None:
    c, off = coordinator(train=64), ControlRest(enabled=False)
    c.fold(beat("a", T0, 100.0))
    at = T0
    for _ in range(5):
        at = step(c, off, at, 0.5)
    assert off.rest_s(at) == 0.0
    on = ControlRest(enabled=True)  # the default fraction, 0.9
    for version in range(1, 5):
        on.folded(c.closes[version], T0 + version)
        on.folded(contrib("a", version, [batch(1, version)]), T0 + version + 0.5)
    on.folded(c.closes[5], T0 + 5)
    on.folded(contrib("a", 3, [batch(1, 9)]), T0 + 5.01)  # computed on an older version
    assert on.rest_s(T0 + 5.02) == pytest.approx(0.9 * 0.5 - 0.02)  # still resting


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        ControlRest(enabled=True, fraction=1.0)
