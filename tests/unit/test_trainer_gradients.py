"""Top-k with error feedback on the trainer's side: what is not sent is kept per slice and
added to the next step's gradient; a rejected contribution's share is taken back out."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conveyor.services.trainer.plane.gradients import EncodedGrad, SliceEncoder
from conveyor.training.compression import decode_slice
from conveyor.training.jobspec import CompressionSpec, JobSpec
from conveyor.training.optim import aggregator_optimizer, momentum_correction
from conveyor.training.slicing import slice_bounds

N = 40
BOUNDS = slice_bounds(N, 2)  # [0, 20) and [20, 40)


def sent(encoded: EncodedGrad) -> torch.Tensor:
    """The dense vector the slice owners decode from the slices, [N]."""
    return torch.cat(
        [decode_slice(s.encoding, s.values, s.indices, s.numel) for s in encoded.slices]
    )


def residuals(encoder: SliceEncoder) -> torch.Tensor:
    feedback = encoder._feedback
    assert feedback is not None
    parts = [feedback.residual(p) for p in range(len(BOUNDS))]
    return torch.cat([p if p is not None else torch.zeros(20) for p in parts])


def topk(error_feedback: bool = True) -> SliceEncoder:
    return SliceEncoder(
        CompressionSpec(kind="topk", ratio=0.1, error_feedback=error_feedback), BOUNDS
    )


def test_topk_sends_the_largest_of_each_slice_and_keeps_the_rest_as_residual() -> None:
    encoder = topk()
    grad = torch.arange(N, dtype=torch.float32) - 19.5  # distinct magnitudes
    encoded = encoder.encode(grad, 1)
    assert [s.values.numel() for s in encoded.slices] == [2, 2]  # ceil(20 * 0.1) per slice
    # Slice 0 = grad[0:20]: largest |g| at 0 and 1; slice 1 = grad[20:40]: at 38 and 39.
    assert encoded.slices[0].indices.tolist() == [0, 1]
    assert encoded.slices[1].indices.tolist() == [18, 19]  # positions within the slice
    assert encoded.nbytes == 4 * (2 + 4)  # bf16 values + int32 indices
    torch.testing.assert_close(sent(encoded) + residuals(encoder), grad)


def test_error_feedback_loses_nothing_over_steps() -> None:
    encoder = topk()
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(N, generator=generator) for _ in range(6)]
    total_sent, total_true = torch.zeros(N), torch.zeros(N)
    for grad in grads:
        total_sent += sent(encoder.encode(grad, 1))
        total_true += grad
        # sum(sent) + residual == sum(true gradients), after every step
        torch.testing.assert_close(total_sent + residuals(encoder), total_true)
    # The residual is added before selecting: an element small each step is sent eventually.
    small = torch.zeros(N)
    small[5] = 0.2
    encoder = topk()
    big = torch.zeros(N)
    big[[0, 1]] = 1.0
    steps = [encoder.encode(big + small, 1) for _ in range(6)]
    assert any(5 in s.slices[0].indices.tolist() for s in steps)


def test_without_error_feedback_the_rest_is_dropped() -> None:
    encoder = topk(error_feedback=False)
    encoded = encoder.encode(torch.ones(N), 1)
    assert encoded.feedback_inputs is None
    assert encoder._feedback is not None and encoder._feedback.residual(0) is None


def test_undo_of_a_rejected_contribution_restores_the_residuals() -> None:
    encoder = topk()
    generator = torch.Generator().manual_seed(1)
    g1, g2, g3 = (torch.randn(N, generator=generator) for _ in range(3))
    first = encoder.encode(g1, 1)
    before = residuals(encoder).clone()
    rejected = encoder.encode(g2, 1)
    applied = encoder.encode(g3, 1)  # sent after the rejected one, before its Rejection came
    assert rejected.feedback_inputs is not None
    encoder.undo(rejected)
    # As if g2 had never been encoded: sent(applied) + residual == g1 + g3 - sent(first).
    torch.testing.assert_close(
        sent(first) + sent(applied) + residuals(encoder), g1 + g3, rtol=1e-5, atol=1e-6
    )
    assert not torch.equal(before, residuals(encoder))


def test_a_gradient_that_does_not_fit_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        SliceEncoder(CompressionSpec(), BOUNDS).encode(torch.zeros(N + 1), 1)


def job(compression: dict[str, Any], optimizer: dict[str, Any]) -> JobSpec:
    return JobSpec.from_dict({
        "name": "g", "model": {"name": "small_cnn"},
        "dataset": {"uri": "builtin://sklearn-digits"},
        "training": {"epochs": 1, "global_batch_size": 8, "micro_batch_size": 4,
                     "optimizer": optimizer},
        "distribution": {"compression": compression},
    })  # fmt: skip


SGD_M = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
TOPK = {"kind": "topk", "ratio": 0.1}


@pytest.mark.parametrize(
    ("compression", "optimizer", "corrected"),
    [
        (TOPK, SGD_M, True),
        ({**TOPK, "momentum_correction": False}, SGD_M, False),
        ({**TOPK, "error_feedback": False}, SGD_M, False),
        (TOPK, {"name": "sgd", "lr": 0.1}, False),
        (TOPK, {"name": "adam", "lr": 0.01}, False),
        ({"kind": "fp16"}, SGD_M, False),
    ],
)
def test_momentum_moves_to_the_trainers_only_for_topk_with_error_feedback_and_sgd_momentum(
    compression: dict[str, Any], optimizer: dict[str, Any], corrected: bool
) -> None:
    spec = job(compression, optimizer)
    assert momentum_correction(spec) is corrected
    kept = aggregator_optimizer(spec)
    assert kept.momentum == (0.0 if corrected else spec.training.optimizer.momentum)
    assert kept.name == spec.training.optimizer.name and kept.lr == spec.training.optimizer.lr
    encoder = SliceEncoder.for_job(spec, BOUNDS)
    feedback = encoder._feedback
    assert (feedback is not None and feedback.momentum == 0.9) is corrected


def test_momentum_correction_works_in_mean_units_and_sends_sums() -> None:
    """The velocity is kept over per-sample mean gradients (steps of any size add up), the
    values go out times the step's samples (the aggregator divides by the step's samples)."""
    encoder = SliceEncoder.for_job(job(TOPK, SGD_M), BOUNDS)
    grad = torch.zeros(N)
    grad[3], grad[25] = 8.0, -4.0  # summed over 4 samples: means 2 and -1
    encoded = encoder.encode(grad, 4)
    assert encoded.scale == 4.0
    sent_first = sent(encoded)
    assert sent_first[3] == 8.0 and sent_first[25] == -4.0  # the sums, as without correction
    feedback = encoder._feedback
    assert feedback is not None
    velocity = feedback.velocity(0)
    assert velocity is not None and velocity[3] == 0.0  # masked: it was sent
    # Next step, 2 samples, gradient 0: the velocity (0.9 * mean) of unsent elements grows
    # the residual; an element is sent once its accumulated momentum is among the largest.
    small = torch.zeros(N)
    small[5] = 0.2  # mean 0.1 over 2 samples
    encoded = encoder.encode(small, 2)
    assert encoded.feedback_inputs is not None
    torch.testing.assert_close(encoded.feedback_inputs[0][5], torch.tensor(0.1))
    # Element 5 is the largest accumulated one of slice 0 now: it goes out as the mean 0.1
    # times this step's 2 samples (bf16 on the wire), and its velocity is masked.
    assert sent(encoded)[5].item() == pytest.approx(0.2, rel=1e-2)
    velocity = feedback.velocity(0)
    assert velocity is not None and velocity[5] == 0.0
