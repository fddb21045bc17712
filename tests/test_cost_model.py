"""The cost model's roofline of single ops, checked against FLOPs and bytes counted by hand.

Issue 37: the first GPU session (benchmarks/gpu_session.py on an H200) found attention predicted 15 times
slower than it ran: an op with several outputs (attention returns its output and the logsumexp) was
priced at the fp32 rate whatever its dtype.
"""

from __future__ import annotations

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
