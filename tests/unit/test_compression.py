"""Slice encodings round trip within their error bounds; top-k with error feedback loses nothing."""

from __future__ import annotations

import pytest
import torch

from conveyor.training.compression import (
    CompressionError,
    TopKFeedback,
    decode_slice,
    encode_slice,
    encoding_for,
    select_topk,
    topk_count,
)


def grad(n: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_dense_round_trip_is_exact() -> None:
    g = grad()
    enc = encode_slice(g, "dense")
    assert enc.nbytes == 4000 and enc.indices.numel() == 0
    assert torch.equal(decode_slice(enc.encoding, enc.values, enc.indices, enc.numel), g)


@pytest.mark.parametrize(
    ("encoding", "dtype", "rel"), [("fp16", torch.float16, 2**-11), ("bf16", torch.bfloat16, 2**-8)]
)
def test_cast_round_trip_within_rounding(encoding: str, dtype: torch.dtype, rel: float) -> None:
    g = grad()
    enc = encode_slice(g, encoding_for(encoding))
    assert enc.values.dtype == dtype and enc.nbytes == 2000
    back = decode_slice(encoding, enc.values, enc.indices, enc.numel)
    assert back.dtype == torch.float32
    # round-to-nearest: relative error at most half an ulp (normal range)
    assert torch.all((back - g).abs() <= g.abs() * rel + 1e-30)


def test_topk_keeps_exactly_the_k_largest() -> None:
    g = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 3.0, 0.0, -2.5])
    values, indices = select_topk(g, 3)
    assert indices.dtype == torch.int32 and indices.tolist() == [1, 3, 5]
    assert values.tolist() == [-5.0, 4.0, 3.0]
    enc = encode_slice(g, "topk", k=3)
    dense = decode_slice("topk", enc.values, enc.indices, 8)
    assert dense.tolist() == [0.0, -5.0, 0.0, 4.0, 0.0, 3.0, 0.0, 0.0]
    assert enc.values.dtype == torch.bfloat16  # -5, 4, 3 are exact in bf16
    assert enc.nbytes == 3 * 2 + 3 * 4  # bf16 values + int32 indices


def test_topk_random_matches_sorted_magnitudes() -> None:
    g = grad(10_000, seed=3)
    k = topk_count(g.numel(), 0.01)
    assert k == 100
    values, indices = select_topk(g, k)
    threshold = g.abs().sort(descending=True).values[k - 1]
    assert torch.all(values.abs() >= threshold)
    assert int((g.abs() > threshold).sum()) <= k
    assert torch.equal(g[indices.long()], values)


def test_topk_count_bounds() -> None:
    assert topk_count(1000, 0.001) == 1
    assert topk_count(10, 0.01) == 1
    assert topk_count(10, 1.0) == 10
    assert topk_count(0, 0.5) == 0
    with pytest.raises(ValueError):
        topk_count(10, 0.0)


def test_error_feedback_conserves_the_gradient_sum() -> None:
    feedback = TopKFeedback(0.05)
    true_sum = torch.zeros(500)
    sent_sum = torch.zeros(500)
    for step in range(20):
        g = grad(500, seed=step)
        enc = feedback.encode(2, g)
        assert enc.values.numel() == 25
        true_sum += g
        sent_sum += decode_slice("topk", enc.values, enc.indices, enc.numel)
    residual = feedback.residual(2)
    assert residual is not None and feedback.residual(0) is None
    # The bf16 rounding of what was sent stays in the residual: nothing is lost.
    torch.testing.assert_close(sent_sum + residual, true_sum, rtol=0, atol=1e-5)
    # what was sent each step was the top-k of gradient + residual: residual stays bounded
    assert residual.abs().max() < true_sum.abs().max() + 10


def test_the_bf16_rounding_of_a_sent_value_is_kept_in_the_residual() -> None:
    feedback = TopKFeedback(0.25)
    g = torch.tensor([1.0 + 2**-10, 0.0, 0.0, 0.0])  # not representable in bf16 (8 bits)
    enc = feedback.encode(0, g)
    assert enc.indices.tolist() == [0] and enc.values.tolist() == [1.0]
    assert feedback.residual(0).tolist() == [2**-10, 0.0, 0.0, 0.0]  # type: ignore[union-attr]
    # scale: the values go out multiplied by it; the residual stays in the input's units
    enc = TopKFeedback(0.25).encode(0, torch.tensor([0.0, -3.0, 1.0, 0.5]), scale=4.0)
    assert enc.values.tolist() == [-12.0]


def test_undo_gives_back_what_a_rejected_step_sent() -> None:
    feedback = TopKFeedback(0.1)
    g = grad(100, seed=1)
    enc = feedback.encode(0, g)
    assert not torch.equal(feedback.residual(0), g)  # type: ignore[arg-type]
    # the contribution is rejected: nothing was applied, and its batches are computed again
    feedback.undo(0, g, enc, 1.0)
    torch.testing.assert_close(feedback.residual(0), torch.zeros(100), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="changed size"):
        feedback.undo(0, torch.zeros(3), encode_slice(torch.zeros(3), "topk", k=1), 1.0)


def test_momentum_correction_accumulates_the_velocity_and_masks_what_was_sent() -> None:
    # DGC by hand, m = 0.5, k = 1 of 3: u = m*u + g; v += u; send top-1 of v; zero u, v there.
    feedback = TopKFeedback(1 / 3, momentum=0.5)
    enc = feedback.encode(0, torch.tensor([4.0, 1.0, 2.0]))
    # u = v = [4, 1, 2] -> send 4 at 0
    assert enc.indices.tolist() == [0] and enc.values.tolist() == [4.0]
    assert feedback.velocity(0).tolist() == [0.0, 1.0, 2.0]  # type: ignore[union-attr]
    assert feedback.residual(0).tolist() == [0.0, 1.0, 2.0]  # type: ignore[union-attr]
    enc = feedback.encode(0, torch.tensor([1.0, 1.0, 0.0]))
    # u = [0, 1, 2] * 0.5 + [1, 1, 0] = [1, 1.5, 1]; v = [0, 1, 2] + u = [1, 2.5, 3] -> 3 at 2
    assert enc.indices.tolist() == [2] and enc.values.tolist() == [3.0]
    assert feedback.velocity(0).tolist() == [1.0, 1.5, 0.0]  # type: ignore[union-attr]
    assert feedback.residual(0).tolist() == [1.0, 2.5, 0.0]  # type: ignore[union-attr]
    # Nesterov adds g + m*u instead of u: [1, 1] -> u = [1, 1], added = [1.5, 1.5]
    nesterov = TopKFeedback(0.5, momentum=0.5, nesterov=True)
    enc = nesterov.encode(0, torch.tensor([1.0, 1.0]))
    assert enc.values.tolist() == [1.5] and nesterov.residual(0).tolist().count(1.5) == 1  # type: ignore[union-attr]
    # A rejected step: its gradient leaves the velocity (where it sent, the masked velocity
    # stays 0) and what it sent returns to the residual.
    u, v = feedback.velocity(0).clone(), feedback.residual(0).clone()  # type: ignore[union-attr]
    g = torch.tensor([0.0, 1.0, 8.0])
    enc = feedback.encode(0, g)
    assert enc.indices.tolist() == [2]  # v = [1, 2.5, 0] + [0.5, 1.75, 8] -> 8 at 2
    feedback.undo(0, g, enc, 1.0)
    assert feedback.velocity(0).tolist() == [0.5, 0.75, 0.0]  # type: ignore[union-attr]
    assert feedback.residual(0).tolist() == (v + 0.5 * u).tolist()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="error feedback"):
        TopKFeedback(0.1, error_feedback=False, momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        TopKFeedback(0.1, momentum=1.0)


def test_without_error_feedback_nothing_is_kept() -> None:
    feedback = TopKFeedback(0.1, error_feedback=False)
    feedback.encode(0, grad(100))
    assert feedback.residual(0) is None


@pytest.mark.parametrize(
    ("encoding", "values", "indices", "numel"),
    [
        ("dense", torch.zeros(3), torch.zeros(0, dtype=torch.int32), 4),
        ("fp16", torch.zeros(4), torch.zeros(0, dtype=torch.int32), 4),
        ("topk", torch.zeros(2, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), 4),
        ("topk", torch.zeros(2, dtype=torch.bfloat16), torch.tensor([0], dtype=torch.int32), 4),
        ("topk", torch.zeros(1, dtype=torch.bfloat16), torch.tensor([-1], dtype=torch.int32), 4),
        ("topk", torch.zeros(1), torch.tensor([0], dtype=torch.int32), 4),  # fp32 values
        ("zstd", torch.zeros(4), torch.zeros(0, dtype=torch.int32), 4),
    ],
)
def test_decode_rejects_inconsistent_slices(
    encoding: str, values: torch.Tensor, indices: torch.Tensor, numel: int
) -> None:
    with pytest.raises(CompressionError):
        decode_slice(encoding, values, indices, numel)
