"""A small GPT-style language model written by hand, as a user would write it (no transformers).

Token embedding tied to the output projection (weight sharing), learned positions, pre-LayerNorm blocks
whose attention is written with nn.Linear, a causal mask and softmax (no SDPA), a GELU MLP, dropout and
residual connections; loss = cross-entropy of the next token, computed by `loss` (passed as --loss).
Estimate it with

    planner estimate --model examples/custom_lm.py:build --inputs examples/custom_lm.py:batch \\
        --loss examples/custom_lm.py:loss --instance ml.g5.xlarge --batch-size 8 --seq-len 512

Options (`-o KEY=VALUE`) are the keyword arguments of `build`; `vocab` reaches `batch` too.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.attn_drop(torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1))
        return self.resid_drop(self.proj((probs @ v).transpose(1, 2).reshape(b, s, d)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CustomLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight  # weight tying: one parameter, counted once

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tokens(input_ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(vocab: int = 32000, dim: int = 768, heads: int = 12, layers: int = 12, max_len: int = 2048,
          dropout: float = 0.1) -> nn.Module:
    return CustomLM(vocab, dim, heads, layers, max_len, dropout)


def batch(batch_size: int, seq_len: int, vocab: int = 32000) -> tuple[torch.Tensor]:
    """Token ids (int64), passed positionally: model(input_ids)."""
    return (torch.randint(0, vocab, (batch_size, seq_len)),)


def loss(logits: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t + 1."""
    ids = batch[0]
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
