"""Top-k with error feedback on the trainer's side: what is not sent is kept per slice and
added to the next step's gradient; a rejected contribution's share is taken back out."""

from __future__ import annotations

import pytest
import torch

from conveyor.libs.compression import decode_slice
from conveyor.libs.jobspec import CompressionSpec
from conveyor.libs.slicing import slice_bounds
from conveyor.services.trainer.gradients import EncodedGrad, SliceEncoder

N = 40
BOUNDS = slice_bounds(N, 2)  # [0, 20) and [20, 40)


def sent(encoded: EncodedGrad) -> torch.Tensor:
    """The dense vector a shard decodes from the slices, [N]."""
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
    encoded = encoder.encode(grad)
    assert [s.values.numel() for s in encoded.slices] == [2, 2]  # ceil(20 * 0.1) per slice
    # Slice 0 = grad[0:20]: largest |g| at 0 and 1; slice 1 = grad[20:40]: at 38 and 39.
    assert encoded.slices[0].indices.tolist() == [0, 1]
    assert encoded.slices[1].indices.tolist() == [18, 19]  # positions within the slice
    assert encoded.nbytes == 4 * (4 + 4)  # fp32 values + int32 indices
    torch.testing.assert_close(sent(encoded) + residuals(encoder), grad)


def test_error_feedback_loses_nothing_over_steps() -> None:
    encoder = topk()
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(N, generator=generator) for _ in range(6)]
    total_sent, total_true = torch.zeros(N), torch.zeros(N)
    for grad in grads:
        total_sent += sent(encoder.encode(grad))
        total_true += grad
        # sum(sent) + residual == sum(true gradients), after every step
        torch.testing.assert_close(total_sent + residuals(encoder), total_true)
    # The residual is added before selecting: an element small each step is sent eventually.
    small = torch.zeros(N)
    small[5] = 0.2
    encoder = topk()
    big = torch.zeros(N)
    big[[0, 1]] = 1.0
    steps = [encoder.encode(big + small) for _ in range(6)]
    assert any(5 in s.slices[0].indices.tolist() for s in steps)


def test_without_error_feedback_the_rest_is_dropped() -> None:
    encoder = topk(error_feedback=False)
    encoded = encoder.encode(torch.ones(N))
    assert encoded.feedback_delta is None
    assert encoder._feedback is not None and encoder._feedback.residual(0) is None


def test_undo_of_a_rejected_contribution_restores_the_residuals() -> None:
    encoder = topk()
    generator = torch.Generator().manual_seed(1)
    g1, g2, g3 = (torch.randn(N, generator=generator) for _ in range(3))
    first = encoder.encode(g1)
    before = residuals(encoder).clone()
    rejected = encoder.encode(g2)
    applied = encoder.encode(g3)  # sent after the rejected one, before its Rejection came
    assert rejected.feedback_delta is not None
    encoder.undo(rejected.feedback_delta)
    # As if g2 had never been encoded: sent(applied) + residual == g1 + g3 - sent(first).
    torch.testing.assert_close(
        sent(first) + sent(applied) + residuals(encoder), g1 + g3, rtol=1e-5, atol=1e-6
    )
    assert not torch.equal(before, residuals(encoder))


def test_a_gradient_that_does_not_fit_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        SliceEncoder(CompressionSpec(), BOUNDS).encode(torch.zeros(N + 1))
