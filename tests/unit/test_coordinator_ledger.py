"""The coordinator's ledger and figures: what applied contributions computed on is counted (and
what it cannot account for rejected), the summary's samples per second, and the rejection
reasons' metric labels."""

from __future__ import annotations

import pytest
from coordinator_cases import JOB, SAMPLES, T0, batch, beat, contrib, coordinator, echo

from conveyor.platform.messages import AppliedContribution, Contribution, Rejection, StepClose
from conveyor.services.aggregator.metrics import rejection_label


def test_the_ledger_counts_what_applied_contributions_computed_on() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    c.fold(beat("b", T0))
    c.fold(contrib("a", 0, [batch(0, 0), batch(0, 1)]))
    # b ran its micro-batch twice and says so: its batch ids are distinct, so nothing but the
    # sample ids shows it, and the ledger counts what was computed.
    c.fold(contrib("b", 0, [batch(0, 2)], samples=[2, 2]))
    assert c.ledger.epochs() == []  # nothing is counted before a close applies it
    echo(c, c.decide(T0))
    assert c.ledger.counts(0) == {0: 1, 1: 1, 2: 2}
    assert c.ledger.total(0) == c.samples_trained == 4
    # Neither a rejected contribution nor one still waiting for its step counts.
    c.fold(contrib("a", 0, [batch(0, 3)]))
    echo(c, c.decide(T0))
    assert c.rejected == 1
    c.fold(contrib("a", 1, [batch(1, 0)]))
    assert c.decide(T0).close is None  # b's is missing
    assert c.ledger.epochs() == [0] and c.ledger.total(0) == 4
    # Each contribution counts under its own epoch.
    c.fold(contrib("b", 1, [batch(1, 1)]))
    echo(c, c.decide(T0))
    assert c.ledger.counts(1) == {0: 1, 1: 1} and c.ledger.counts(0) == {0: 1, 1: 1, 2: 2}


def applying(version: int, contribution: Contribution) -> StepClose:
    """A StepClose of ``version`` that applies ``contribution`` (as another coordinator
    might have decided it)."""
    return StepClose(
        job_id=JOB, version=version,
        contributions=[AppliedContribution(
            contribution_id=contribution.contribution_id, worker_id=contribution.worker_id,
            base_version=contribution.base_version, num_samples=contribution.num_samples,
            staleness=version - 1 - contribution.base_version,
        )],
        batch_ids=contribution.batch_ids, num_samples=contribution.num_samples, epoch=0, lr=0.5,
        allocation={}, closed_at=T0,
    )  # fmt: skip


def test_a_contribution_rejected_then_applied_counts_while_a_close_may_apply_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = coordinator(mode="ssp", staleness=1)
    c.fold(beat("a", T0))
    x, y = contrib("a", 0, [batch(0, 0)]), contrib("a", 0, [batch(0, 1)])
    for contribution in (x, y):
        c.fold(contribution)
        # During a handover one coordinator rejects it, the other (which has not read the
        # rejection) applies it: the slice owners apply the close, so the ledger counts it.
        c.fold(Rejection(job_id=JOB, contribution_id=contribution.contribution_id,
                         worker_id="a", current_version=0, reason="handover"))  # fmt: skip
    assert c.rejected == 2 and c.undecided() == []
    c.fold(applying(1, x))
    assert c.ledger.counts(0) == {0: 1} and c.last_loss == pytest.approx(1.0)
    # Two versions on, no close may take y (base 0) within the staleness bound of 1: forgotten.
    fresh = contrib("a", 1, [batch(0, 2)])
    c.fold(fresh)
    c.fold(applying(2, fresh))
    assert c.ledger.counts(0) == {0: 1, 2: 1}
    with caplog.at_level("ERROR"):
        c.fold(applying(3, y))
    assert "missing from the ledger" in caplog.text
    assert c.ledger.counts(0) == {0: 1, 2: 1}


def test_contributions_the_ledger_cannot_account_for_are_rejected() -> None:
    c = coordinator()
    c.fold(beat("a", T0))
    outside = contrib("a", 0, [batch(0, 0)], samples=[SAMPLES])  # no such sample
    mixed = contrib("a", 0, [batch(0, 1), batch(1, 2)])  # says epoch 0, a batch of epoch 1
    mislabelled = contrib("a", 0, [batch(0, 3)], epoch=1)
    for contribution in (outside, mixed, mislabelled):
        c.fold(contribution)
    decisions = c.decide(T0)
    assert decisions.close is None
    assert [(r.contribution_id, r.reason) for r in decisions.rejections] == [
        (outside.contribution_id, "invalid sample ids"),
        (mixed.contribution_id, "invalid batch ids"),
        (mislabelled.contribution_id, "invalid batch ids"),
    ]
    echo(c, decisions)
    assert c.ledger.epochs() == [] and c.rejected == 3


def test_the_summary_counts_samples_per_second_from_the_first_step_begun() -> None:
    """A local-mode window's samples count with its time: the window opens when the first
    step began (``started_at``), not when its contribution was sent after it."""
    from dataclasses import replace

    from conveyor.services.aggregator.finish import summarise

    c = coordinator()
    c.fold(beat("a", T0, 100.0))
    c.fold(beat("b", T0, 100.0))
    c.fold(replace(contrib("a", 0, [batch(0, 0), batch(0, 1)], at=T0), started_at=T0 - 2.0))
    c.fold(replace(contrib("b", 0, [batch(0, 2), batch(0, 3)], at=T0 + 0.5), started_at=T0 - 1.0))
    echo(c, c.decide(T0 + 1.0))
    assert c.first_started_at == T0 - 2.0
    assert summarise(c, "file:///m")["samples_per_second"] == pytest.approx(4 / 3.0)
    empty = coordinator()  # no stamps (an empty contribution, an older trainer): sent_at
    empty.fold(contrib("a", 0, [], at=T0 + 3.0))
    assert empty.first_started_at == T0 + 3.0


def test_each_rejection_reason_counts_under_its_own_label() -> None:
    reasons = ["stale: base 1, current 4", "duplicate batches", "invalid batch ids",
               "invalid sample ids", "over the global batch", "training finished"]  # fmt: skip
    assert [rejection_label(r) for r in reasons] == [r.split(":")[0] for r in reasons]
    assert rejection_label("a reason added later") == "other"
