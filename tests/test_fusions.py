"""Inductor's fusions survive the rewrite: one Llama-style block, compiled on this CPU, read from the
generated code. The ordering edges that keep our copies where the plan put them must not split a
kernel Inductor fuses without them (on an H200 each transfer added a Triton kernel)."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_fw_bw_and_get_code

import fxoffload
from fxoffload.passes.plan import OFFLOAD

pytestmark = pytest.mark.slow

FUSED_KERNEL = re.compile(r"^\s*cpp_fused_\w+\(", re.MULTILINE)
HIDDEN, HEADS, KV_HEADS, FFN, TOKENS = 256, 4, 2, 704, 512


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate(x, cos, sin):
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


class LlamaBlock(torch.nn.Module):
    """RMSNorm, grouped-query attention with RoPE (SDPA, causal), RMSNorm, SwiGLU: Llama-3's layer."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        kv = KV_HEADS * self.head_dim
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.norm1, self.norm2 = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.q, self.o = linear(HIDDEN, HIDDEN), linear(HIDDEN, HIDDEN)
        self.k, self.v = linear(HIDDEN, kv), linear(HIDDEN, kv)
        self.gate, self.up, self.down = linear(HIDDEN, FFN), linear(HIDDEN, FFN), linear(FFN, HIDDEN)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, t, HEADS, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, t, KV_HEADS, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, t, KV_HEADS, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True,
                                           enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, HIDDEN))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def block_inputs():
    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    angles = torch.arange(TOKENS)[:, None] / (10000 ** (torch.arange(0, HEADS * 16, 2) / (HEADS * 16)))
    return x, angles.cos(), angles.sin()


def compile_block(backend):
    """(forward kernels, backward kernels, gradients, the backend) of one step of the block."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = LlamaBlock()
    x, cos, sin = block_inputs()
    compiled = torch.compile(block, backend=backend)
    _, codes = run_fw_bw_and_get_code(lambda: compiled(x, cos, sin).square().sum())
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return len(FUSED_KERNEL.findall(codes[0])), len(FUSED_KERNEL.findall(codes[-1])), grads


def eager_grads():
    torch.manual_seed(0)
    block = LlamaBlock()
    x, cos, sin = block_inputs()
    block(x, cos, sin).square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


@pytest.fixture(scope="module")
def plain_kernels():
    forward, backward, _ = compile_block("inductor")
    return forward, backward


@pytest.mark.parametrize("budget", [0.7, 0.5])
def test_the_backward_keeps_inductor_s_fusions(plain_kernels, budget):
    # Before the ordering edges were chosen between kernels Inductor fuses anyway (fxoffload.ordering),
    # a prefetch or wait pinned between two fusible ops split them: 10 backward kernels against plain's
    # 7 at 0.5, here.
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=budget, strategy="offload", min_bytes=0)
    forward, backward, grads = compile_block(backend)
    offloads = [d for d in backend.records[0].plan.decisions if d.action == OFFLOAD]
    assert len(offloads) >= 3, "too few transfers for the count to say anything"
    assert backward <= plain_kernels[1], f"{backward} backward kernels against plain's {plain_kernels[1]}"
    for got, expected in zip(grads, eager_grads()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max().clamp(min=1)))


@pytest.mark.xfail(strict=True, reason=(
    "two forward kernels remain at 0.5: the offload of the rotated queries sits between the queries' and "
    "the keys' RoPE, which Inductor fuses horizontally without it, and the offload of the attention's "
    "transposed clone fixes its layout before the output projection reads it, which then needs a copy"))
def test_the_forward_keeps_inductor_s_fusions(plain_kernels):
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=0.5, strategy="offload", min_bytes=0)
    forward, _, _ = compile_block(backend)
    assert forward <= plain_kernels[0], f"{forward} forward kernels against plain's {plain_kernels[0]}"
