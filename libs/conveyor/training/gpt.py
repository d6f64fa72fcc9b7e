"""A small GPT (nanoGPT's shape) for ``tokens://`` jobs: token ids ``[B, T]`` -> logits
``[B, T, vocab_size]``.

Pre-norm transformer blocks (LayerNorm, causal self-attention, LayerNorm, 4x GELU MLP), learned
token and position embeddings, the output head tied to the token embedding, GPT-2's
initialisation (normal 0.02, residual projections scaled by ``1 / sqrt(2 * n_layer)``). The
causal mask is ``scaled_dot_product_attention(is_causal=True)``, not a buffer, so the model's
whole state is its parameters. No dropout: the gradient plane averages gradients of
deterministic passes.

In the model registry (:mod:`conveyor.training.models`) a job's token sequences look like
one-channel images one row high: ``in_channels=1``, ``image_size=(1, block_size)`` and
``num_classes=vocab_size``, which is what the sharder plans for ``tokens://`` datasets.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.shape  # [B,T,E]
        q, k, v = self.qkv(x).split(width, dim=2)  # 3 x [B,T,E]
        heads = (batch, steps, self.n_head, width // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # [B,H,T,E/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B,H,T,E/H]
        y = y.transpose(1, 2).reshape(batch, steps, width)  # [B,T,E]
        out: torch.Tensor = self.proj(y)
        return out


class Block(nn.Module):
    """LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # [B,T,E]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """See the module docstring."""

    def __init__(
        self, *, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, listed once
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(param, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        steps = tokens.shape[1]  # tokens: int [B,T]
        if steps > self.block_size:
            raise ValueError(f"{steps} tokens exceed block_size {self.block_size}")
        positions = torch.arange(steps, device=tokens.device)  # [T]
        h = self.wte(tokens) + self.wpe(positions)  # [B,T,E]
        h = self.ln_f(self.blocks(h))  # [B,T,E]
        logits: torch.Tensor = self.head(h)  # [B,T,vocab_size]
        return logits


def build_gpt(
    *,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
) -> nn.Module:
    """The registry's builder: ``num_classes`` is the vocabulary, ``image_size`` is
    ``(1, block_size)``. ValueError for a shape that is not a token sequence or options out of
    range (``n_embd`` must be a multiple of ``n_head``)."""
    if in_channels != 1 or image_size[0] != 1:
        raise ValueError(
            f"gpt reads token sequences (a tokens:// dataset), not images of "
            f"{in_channels} x {image_size[0]} x {image_size[1]}"
        )
    for name, value, top in (("n_layer", n_layer, 64), ("n_head", n_head, 64),
                             ("n_embd", n_embd, 8192)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ValueError(f"{name} must be an integer in [1, {top}], got {value!r}")
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    return GPT(
        vocab_size=num_classes,
        block_size=image_size[1],
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
    )
