"""Variable sequence lengths: after the second distinct length dynamo recompiles with a symbolic
sequence dimension, and the dynamic graph keeps offloading (one compiled graph for every length)."""

import copy

import pytest
import torch

import fxoffload
from fxoffload import runtime
from passes.ops import PREFETCH
from tests.conftest import assert_same_step, lm_step

LENGTHS = (64, 96, 128, 80)


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, use_cache=False))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False))


def symbolic(record) -> bool:
    return any(isinstance(s, torch.SymInt) for n in record.timeline.fw_nodes
               if isinstance(v := n.meta.get("val"), torch.Tensor) for s in v.shape)


def symbolic_prefetches(record) -> list:
    """Prefetches in the rewritten backward whose size is computed in the graph (not constants)."""
    return [n for n in record.backward.graph.nodes
            if n.target is PREFETCH and any(isinstance(s, torch.fx.Node) for s in n.args[2])]


@pytest.mark.parametrize("strategy", ["offload", "auto"])
@pytest.mark.parametrize("build", [llama, gpt2])
def test_the_dynamic_graph_offloads_and_matches_eager_at_every_length(build, strategy):
    torch.manual_seed(0)
    eager = build().train()
    model = copy.deepcopy(eager)
    # (on_infeasible="warn": GPT-2's loss is a graph of its own whose few small activations no
    # strategy takes to half; its model graph is the one that matters here)
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, strategy=strategy,
                                        on_infeasible="warn")
    compiled = torch.compile(model, backend=backend)
    with runtime.copy_delay(0.001):  # every copy lands late: a missing wait reads garbage
        for length in LENGTHS:
            ids = torch.randint(0, 256, (2, length))
            assert_same_step(lm_step(eager, ids), lm_step(compiled, ids))
    assert runtime.pending_transfers() == 0
    dynamic = [r for r in backend.records if symbolic(r)]
    # Each region: a static graph for the first length, then one dynamic graph for every other.
    assert len(backend.records) == 2 * len(dynamic) > 0
    model_graph = max(dynamic, key=lambda r: r.plan.activation_peak_before)
    assert model_graph.plan.transfers, fxoffload.explain(model_graph)
    assert model_graph.plan.activation_peak_after <= model_graph.plan.budget_bytes
    assert symbolic_prefetches(model_graph)


@pytest.mark.slow
def test_under_inductor_the_dynamic_graph_offloads_and_matches_eager_at_every_length():
    torch.manual_seed(0)
    eager = llama().train()
    model = copy.deepcopy(eager)
    backend = fxoffload.offload_backend(inner="inductor", min_bytes=0, memory_budget=0.5, strategy="offload")
    compiled = torch.compile(model, backend=backend)
    with runtime.copy_delay(0.001):
        for length in LENGTHS:
            ids = torch.randint(0, 256, (2, length))
            assert_same_step(lm_step(eager, ids), lm_step(compiled, ids), rtol=1e-3, atol=1e-4)
    assert runtime.pending_transfers() == 0
    dynamic = [r for r in backend.records if symbolic(r)]
    assert len(dynamic) == 1 and len(backend.records) == 2 and dynamic[0].plan.transfers
