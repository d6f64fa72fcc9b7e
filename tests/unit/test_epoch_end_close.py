"""A sync step that ends an epoch closes as soon as its batches are in: the members that
hold none of them are not waited for (they used to wait ``empty_contribution_wait_s`` and send
an empty contribution at every epoch whose batch count is not a multiple of the step's), and an
empty contribution that comes after its step closed is dropped unanswered."""

from __future__ import annotations

from coordinator_cases import T0, batch, beat, contrib, coordinator, echo

from conveyor.services.aggregator.coordinator import Decisions


def test_a_step_holding_the_epochs_last_batch_closes_without_the_other_members() -> None:
    c = coordinator(train=5)  # 4 micro-batches a step: the epoch's last step holds one
    c.fold(beat("a", T0, 100.0))
    c.fold(beat("b", T0, 100.0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)]))
    c.fold(contrib("b", 0, [batch(0, 2), batch(0, 3)]))
    echo(c, c.decide(T0 + 1))
    assert c.version == 1

    last = contrib("a", 1, [batch(0, 4)])
    c.fold(last)
    decisions = c.decide(T0 + 2)
    close = decisions.close
    assert close is not None and decisions.rejections == []
    assert [e.contribution_id for e in close.contributions] == [last.contribution_id]
    assert close.batch_ids == [batch(0, 4)] and close.version == 2
    echo(c, decisions)
    assert c.current_epoch == 1 and c.epochs.end_version == {0: 2}

    # b's empty contribution for that step, sent before it saw the close: no answer, no step.
    late = contrib("b", 1, [])
    c.fold(late)
    assert c.undecided() == [] and c.decide(T0 + 3) == Decisions()
    assert c.rejected == 0 and c.version == 2


def test_a_step_that_does_not_end_the_epoch_still_waits_for_every_member() -> None:
    c = coordinator(train=8)
    c.fold(beat("a", T0, 100.0))
    c.fold(beat("b", T0, 100.0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)]))
    assert c.decide(T0 + 1) == Decisions()  # 6 batches of the epoch are left: b may hold some
    empty = contrib("b", 0, [])
    c.fold(empty)
    close = c.decide(T0 + 1).close
    assert close is not None and close.batch_ids == [batch(0, 0), batch(0, 1)]
    assert {e.contribution_id for e in close.contributions} >= {empty.contribution_id}


def test_a_batch_counted_twice_does_not_end_the_epoch_early() -> None:
    c = coordinator(train=2)
    c.fold(beat("a", T0, 100.0))
    c.fold(beat("b", T0, 100.0))
    c.fold(contrib("a", 0, [batch(0, 0)]))
    c.fold(contrib("c", 0, [batch(0, 0)]))  # the same batch from a member that died since
    assert c.decide(T0 + 1) == Decisions()  # one distinct batch of two: b is waited for
