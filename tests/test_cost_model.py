"""The cost model's roofline of single ops, checked against FLOPs and bytes counted by hand.

Issue 37: the first GPU session (benchmarks/gpu_session.py on an H200) found attention predicted 15 times
slower than it ran: an op with several outputs (attention returns its output and the logsumexp) was
priced at the fp32 rate whatever its dtype.
"""

from __future__ import annotations

import re

import pytest
import torch

from fxoffload.passes.cost_model import DeviceProfile, node_work, roofline

PROFILE = DeviceProfile("toy", ((torch.bfloat16, 1e15), (torch.float32, 5e13)), memory_bandwidth=1e30,
                        h2d_bandwidth=1e9, d2h_bandwidth=1e9, duplex=True, copy_latency=0.0)
B, H, S, D = 2, 4, 64, 32


def _attention_node(dtype: torch.dtype) -> torch.fx.Node:
    """cuDNN attention as a CUDA graph holds it (built by hand: this machine has no CUDA): query, key and
    value in, (output, logsumexp in fp32, seeds...) out, traced values on the meta device."""
    graph = torch.fx.Graph()
    inputs = []
    for name in "qkv":
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(B, H, S, D, dtype=dtype, device="meta")
        inputs.append(node)
    node = graph.call_function(torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                               (*inputs, None, True, 0.0, True))
    empty = torch.empty((), dtype=torch.int64, device="meta")
    node.meta["val"] = (torch.empty(B, H, S, D, dtype=dtype, device="meta"),
                        torch.empty(B, H, S, dtype=torch.float32, device="meta"), None, None, S, S, empty, empty,
                        torch.empty(0, dtype=dtype, device="meta"))
    return node


def test_attention_runs_at_its_outputs_dtype_rate():
    node = _attention_node(torch.bfloat16)
    work = node_work(node)
    # Q K^T and P V: two batched matmuls of B*H x S x S x D multiply-adds each (PyTorch's counter's count).
    flops = 2 * (2 * B * H * S * S * D)
    assert work.flops == flops
    assert work.dtype == torch.bfloat16
    assert roofline(work, PROFILE) == flops / 1e15


def test_fp32_attention_stays_at_the_fp32_rate():
    work = node_work(_attention_node(torch.float32))
    assert work.dtype == torch.float32
    assert roofline(work, PROFILE) == work.flops / 5e13


def _cpu_attention_nodes() -> dict[str, torch.fx.Node]:
    """Attention forward and backward as `fxoffload plan` traces them: on the CPU, fake tensors, bf16."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, grad):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)

    q, k, v, grad = (torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=i < 3) for i in range(4))
    gm = make_fx(step, tracing_mode="fake")(q, k, v, grad)
    return {str(n.target.overloadpacket.__name__): n for n in gm.graph.nodes
            if n.op == "call_function" and "attention" in str(n.target)}


def test_cpu_traced_attention_is_priced_as_the_gpu_s_flash_attention():
    nodes = _cpu_attention_nodes()
    forward = node_work(nodes["_scaled_dot_product_flash_attention_for_cpu"])
    backward = node_work(nodes["_scaled_dot_product_flash_attention_for_cpu_backward"])
    # Forward: Q K^T and P V; backward: the scores again, then grad P, grad V, grad Q and grad K. Each a
    # batched matmul of B*H x S x S x D multiply-adds (2 FLOPs each); no causal discount.
    assert forward.flops == 2 * (2 * B * H * S * S * D)
    assert backward.flops == 5 * (2 * B * H * S * S * D)
    assert forward.dtype == backward.dtype == torch.bfloat16
    assert roofline(backward, PROFILE) == backward.flops / 1e15


def _swiglu_graph() -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """A forward as AOTAutograd hands it over: two matmuls, SwiGLU's pointwise chain between them (silu
    decomposed), the chain's output saved for the backward beside the matmul's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(x, w1, w2, w3):
        gate, up = torch.mm(x, w1), torch.mm(x, w3)
        h = gate / (1 + torch.exp(-gate)) * up  # silu(gate) * up
        return torch.mm(h, w2), h

    with FakeTensorMode():
        args = (torch.empty(64, 32), torch.empty(32, 128), torch.empty(128, 32), torch.empty(32, 128))
        gm = make_fx(forward)(*args)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_a_pointwise_chain_reads_what_enters_it_and_writes_what_leaves_it():
    from fxoffload.passes.cost_model import fused_work

    gm, nodes = _swiglu_graph()
    order = list(gm.graph.nodes)
    fused = dict(zip(order, fused_work(order)))
    chain = [n for n in order if n.op == "call_function" and "mm" not in str(n.target)]
    assert [str(n.target) for n in chain] == ["aten.neg.default", "aten.exp.default", "aten.add.Tensor",
                                             "aten.div.Tensor", "aten.mul.Tensor"]
    matrix = 64 * 128 * 4  # every value of the chain: 64 x 128 fp32
    # The chain reads gate (by neg and div) and up (by mul), from the matmuls, and writes its output once:
    # the next matmul reads it, and the graph returns it (saved).
    assert sum(fused[n].moved for n in chain) == 4 * matrix
    assert [fused[n].moved for n in chain] == [matrix, 0, 0, matrix, 2 * matrix]
    # Op by op, each reads its inputs and writes its output: 2 + 2 + 2 + 3 + 3 matrices (scalars aside).
    assert sum(node_work(n).moved for n in chain) >= 11 * matrix
    for n in order:  # matmuls, and what is not compute, are unchanged
        if n not in chain:
            assert fused[n] == node_work(n)


@pytest.mark.slow
def test_graphs_inductor_compiles_are_priced_fused_and_eager_ones_op_by_op():
    import fxoffload

    def moved(inner: str) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32),
                                    torch.nn.GELU())
        backend = fxoffload.offload_backend(memory_budget=0.5, inner=inner, min_bytes=0, strategy="offload")
        torch.compile(model, backend=backend)(torch.randn(64, 32, requires_grad=True)).sum().backward()
        return sum(w.moved for w in backend.records[-1].work if w is not None)

    assert fxoffload.OffloadConfig(inner="inductor").plan_options.fused_kernels
    assert not fxoffload.OffloadConfig(inner="eager").plan_options.fused_kernels
    assert moved("inductor") < 0.7 * moved("eager")


def test_grouped_query_attention_counts_its_flops_per_query_head():
    """torch 2.11's FLOP counter refuses keys and values with fewer heads than the query (GQA, as Llama-3
    has): the cost model priced such attention by its bytes only, 0.1 ms for a layer's 1.5 ms forward on the
    H200 (whose torch is 2.11). Counted per query head, as torch 2.13 counts it."""
    graph = torch.fx.Graph()
    inputs = []
    for name, heads in (("q", 8), ("k", 2), ("v", 2)):
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(B, heads, S, D, dtype=torch.bfloat16, device="meta")
        inputs.append(node)
    node = graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention.default, (*inputs, 0.0, True))
    empty = torch.empty((), dtype=torch.int64, device="meta")
    node.meta["val"] = (torch.empty(B, 8, S, D, dtype=torch.bfloat16, device="meta"),
                        torch.empty(B, 8, S, dtype=torch.float32, device="meta"), None, None, S, S, empty, empty,
                        torch.empty(0, dtype=torch.bfloat16, device="meta"))
    # Q K^T and P V over the query's 8 heads: two batched matmuls of B*8 x S x S x D multiply-adds each.
    assert node_work(node).flops == 2 * 2 * B * 8 * S * S * D


@pytest.mark.parametrize("field, value, accepted", [
    # a NaN rate hung the greedy solver (its cheapest-per-byte pick never matched), before 2026-12-06
    ("copy_latency", float("nan"), "a finite number of seconds >= 0"),
    ("op_seconds", -1e-6, "a finite number of seconds >= 0"),
    ("h2d_bandwidth", 0.0, "a finite number > 0 (bytes per second)"),  # divided by zero
    ("d2h_bandwidth", -1e9, "a finite number > 0 (bytes per second)"),  # copies that cost nothing
    ("memory_bandwidth", float("inf"), "a finite number > 0 (bytes per second)"),
    ("h2d_bandwidth", "25GB", "a finite number > 0 (bytes per second)"),
    ("flops", (), "a non-empty tuple of (torch.dtype, FLOP/s) pairs"),
    ("flops", ((torch.float32, float("nan")),), "a non-empty tuple of (torch.dtype, FLOP/s) pairs"),
    ("duplex", "yes", "True or False"),
])
def test_a_device_profile_with_a_bad_figure_is_refused_where_it_is_made(field, value, accepted):
    import dataclasses

    import fxoffload

    message = rf"DeviceProfile 'h100-pcie5': {field}: got .*; accepted: {re.escape(accepted)}"
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(fxoffload.PROFILES["h100-pcie5"], **{field: value})


def test_a_device_profile_of_numpy_figures_is_accepted():
    # what a user's own measurement hands over: NumPy's scalars, which the check must not refuse
    import dataclasses

    import numpy as np

    import fxoffload

    made = dataclasses.replace(fxoffload.PROFILES["h100-pcie5"], h2d_bandwidth=np.float32(5e10),
                               duplex=np.bool_(True), copy_latency=np.int64(0))
    assert made.h2d_bandwidth == 5e10 and made.duplex
