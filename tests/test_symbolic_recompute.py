"""Recompute chains in graphs with symbolic sizes (dynamic shapes): a chain's size arguments are forward
values (``sym_size`` of an input, arithmetic on sizes), which the backward builds from the size symbols its
own inputs carry, so a graph that serves every length recomputes as the graph of one length does."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxoffload
from fxoffload.passes.analysis import RecomputeChain, recompute_chain
from tests.conftest import assert_same_step, lm_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from variable_lengths import llama  # noqa: E402

LENGTHS = (64, 96, 128, 80)  # the second length recompiles with a symbolic sequence dimension


def reshaped_tanh(x):
    return torch.tanh(x).reshape(x.shape[0] * 2, -1)


def traced_symbolically():
    graph = make_fx(reshaped_tanh, tracing_mode="symbolic")(torch.randn(4, 6)).graph
    x, = graph.find_nodes(op="placeholder")
    out, = graph.output_node().all_input_nodes
    return graph, x, out


def test_a_chain_reads_a_symbolic_size_the_backward_can_build():
    graph, x, out = traced_symbolically()
    order = {n: i for i, n in enumerate(graph.nodes)}
    symbols = frozenset(s.node.expr for s in x.meta["val"].shape)
    found = recompute_chain(out, {x}, order, symbols=symbols)
    assert isinstance(found, RecomputeChain), found
    assert found.reads == (x,)
    assert [n.target for n in found.ops] == [torch.ops.aten.tanh.default, torch.ops.aten.view.default]
    assert found.sizes and all(isinstance(n.meta["val"], torch.SymInt) for n in found.sizes)
    assert not set(found.sizes) & set(found.ops)  # built in the backward, not recomputed or saved


def test_a_chain_whose_size_the_backward_cannot_build_is_refused_naming_it():
    graph, x, out = traced_symbolically()
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = recompute_chain(out, {x}, order, symbols=frozenset())
    assert isinstance(found, str) and "cannot build" in found and "no backward input carries it" in found


def dynamic_records(backend):
    return [r for r in backend.records if any(isinstance(s, torch.SymInt) for n in r.timeline.fw_nodes
                                              if isinstance(v := n.meta.get("val"), torch.Tensor) for s in v.shape)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["recompute", "auto"])
def test_the_graph_of_every_length_recomputes_and_matches_eager(strategy):
    """The tiny Llama at four lengths: a static graph for the first, one dynamic graph for the others.
    The dynamic graph rebuilds as many storages as the static one, some through chains that read a
    size, and every step equals eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = llama().train()
    backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, strategy=strategy,
                                        on_infeasible="warn")
    compiled = torch.compile(copy.deepcopy(eager), backend=backend)
    for length in LENGTHS:
        ids = torch.randint(0, 256, (2, length))
        assert_same_step(lm_step(eager, ids), lm_step(compiled, ids))
    dynamic, = dynamic_records(backend)
    static, = [r for r in backend.records if r is not dynamic]
    assert static.plan.recomputes, fxoffload.explain(static)
    assert len(dynamic.plan.recomputes) == len(static.plan.recomputes), fxoffload.explain(dynamic)
    assert any(r.cost.sizes for r in dynamic.plan.recomputes)
