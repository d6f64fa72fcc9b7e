"""Local mode's window: how many of its inner steps may wait for a batch to arrive."""

from __future__ import annotations

import pytest

from conveyor.services.trainer.compute.inner import waiting_steps


@pytest.mark.parametrize(
    ("train_left", "per_step", "waiting"),
    [
        (45, 2, 22),  # the digits demo's epoch: 22 whole steps of 2, then 1 batch left
        (13, 2, 6),  # its last window: 6 whole steps; the 7th is the remainder
        (12, 2, 6),  # no remainder: every step of the epoch is whole
        (1, 2, 1),  # the remainder alone: it waits (late data is not an empty version)
        (0, 2, 1),
        (7, 4, 1),
        (8, 1, 8),
    ],
)
def test_the_steps_that_wait_are_the_epochs_whole_steps_at_least_one(
    train_left: int, per_step: int, waiting: int
) -> None:
    assert waiting_steps(train_left, per_step) == waiting


def test_a_step_without_micro_batches_is_refused() -> None:
    with pytest.raises(ValueError, match="micro_batches_per_step"):
        waiting_steps(10, 0)
