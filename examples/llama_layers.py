"""Llama-3-style decoder layers built from a config (random weights, nothing downloaded): RMSNorm,
grouped-query attention with rotary embeddings (SDPA, causal), RMSNorm, SwiGLU feed-forward.

``LlamaStack(shape)`` is the embedding, ``shape.layers`` blocks, the final norm and the head; each block
is a module of its own, so that it can be compiled (and checkpointed) on its own, torchtitan style.
``benchmarks/frontier.py`` measures it on a GPU; ``tests/test_fusions.py`` reads one block's generated
code on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of the stack. The defaults are Llama-3-8B's layer."""

    layers: int = 8
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"LlamaShape: hidden {self.hidden} must split into {self.heads} heads of an even "
                             f"size, and the heads into {self.kv_heads} KV heads")


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(positions: int, head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and sines of the rotary embedding, one row per position."""
    inverse = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inverse
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., ::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class LlamaBlock(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.hidden // shape.heads
        d, kv = shape.hidden, shape.kv_heads * self.head_dim
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = _linear(d, d), _linear(d, kv), _linear(d, kv), _linear(d, d)
        self.gate, self.up, self.down = _linear(d, shape.ffn), _linear(d, shape.ffn), _linear(shape.ffn, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True,
                                           enable_gqa=self.heads != self.kv_heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class LlamaStack(nn.Module):
    """Tokens in, logits out; ``blocks`` may be replaced one by one (compiled, checkpointed)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.hidden(tokens)))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last block's output (before the final norm and the head)."""
        cos, sin = rotary(tokens.shape[1], self.shape.hidden // self.shape.heads, tokens.device)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return h
