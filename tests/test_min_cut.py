"""PyTorch's partitioner under ``partition.quick_min_cut``: the same cuts, by another max-flow.

``networkx.minimum_cut`` reads the cut off the residual network as the nodes that can still reach
the sink. Every maximum flow (and preflow-push's maximum preflow) leaves that same set, so
Boykov-Kolmogorov must cut where the default preflow-push does. These tests check it on graphs
with many minimum cuts, where a solver that picked another one would be caught, and check that the
partitioner, with its solves remembered across its two runs, makes the pair it makes without.
"""

import copy
import gc
import math
import random

import networkx as nx
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch import partitioners
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from fxoffload.backend.partition import quick_min_cut
from tests.conftest import tiny_llama


def _flow_graph(rng: random.Random, n: int) -> nx.DiGraph:
    """A layered graph like the partitioner's: small integer capacities (so cuts tie), and
    infinite edges, some of them backwards, as the partitioner writes for banned recomputes."""
    graph = nx.DiGraph()
    for v in range(n):
        if rng.random() < 0.3:
            graph.add_edge("source", v, capacity=rng.choice([1, 2, 3]))
        if rng.random() < 0.3:
            graph.add_edge(v, "sink", capacity=rng.choice([1, 2, 3, math.inf]))
        for _ in range(2):
            w = rng.randrange(n)
            if w > v:
                graph.add_edge(v, w, capacity=rng.choice([1, 2, 2, 3, math.inf]))
            elif w < v and rng.random() < 0.2:
                graph.add_edge(v, w, capacity=math.inf)
    graph.add_nodes_from(["source", "sink"])
    return graph


def _cut(graph: nx.DiGraph, flow_func=None):
    try:
        value, (source_side, _) = nx.minimum_cut(graph, "source", "sink", flow_func=flow_func)
    except nx.NetworkXUnbounded:
        return "unbounded", None
    return value, frozenset(source_side)


def _smallest_source_side(graph: nx.DiGraph) -> frozenset:
    """The other extreme minimum cut: what the source still reaches in the residual network."""
    residual = nx.algorithms.flow.preflow_push(graph, "source", "sink")
    open_edges = nx.DiGraph((u, v) for u, v, d in residual.edges(data=True) if d["flow"] < d["capacity"])
    open_edges.add_node("source")
    return frozenset(nx.descendants(open_edges, "source") | {"source"})


def test_boykov_kolmogorov_cuts_where_preflow_push_does_on_graphs_with_many_minimum_cuts():
    rng = random.Random(0)
    tied = 0
    for _ in range(300):
        graph = _flow_graph(rng, rng.randrange(4, 40))
        expected = _cut(graph)
        with quick_min_cut():
            assert _cut(graph) == expected
        assert _cut(graph, nx.algorithms.flow.boykov_kolmogorov) == expected
        if expected[0] != "unbounded" and _smallest_source_side(graph) != expected[1]:
            tied += 1  # another minimum cut exists: a solver returning it would fail above
    assert tied >= 50, f"only {tied} graphs have more than one minimum cut"


def test_the_context_restores_the_default_flow_and_the_collector_after_a_raise():
    default, solve = nx.algorithms.flow.maxflow.default_flow_func, partitioners.solve_min_cut
    cse = partitioners.fx_graph_cse
    assert gc.isenabled()
    with pytest.raises(RuntimeError), quick_min_cut():
        assert not gc.isenabled()
        assert nx.algorithms.flow.maxflow.default_flow_func is nx.algorithms.flow.boykov_kolmogorov
        raise RuntimeError("inside")
    assert gc.isenabled() and nx.algorithms.flow.maxflow.default_flow_func is default
    assert partitioners.solve_min_cut is solve and partitioners.fx_graph_cse is cse


def _joint_graph():
    captured = {}

    def partition(gm, joint_inputs, **kwargs):
        captured.update(gm=copy.deepcopy(gm), inputs=joint_inputs, kwargs=kwargs)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    nop = lambda gm, _: gm  # noqa: E731
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                           decompositions=select_decomp_table())
    torch.manual_seed(0)
    model = tiny_llama()
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(input_ids=torch.randint(0, 256, (2, 32)), labels=None).logits.sum()
    return captured


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.1])
def test_the_partitioner_makes_the_same_pair_under_the_quick_min_cut(budget):
    """As the backend runs it: the default partition, then (below budget 1, PyTorch's recompute-only
    search: up to four solves) the partition at ``budget`` of the same joint graph, whose first
    solve is the remembered one."""
    joint = _joint_graph()

    def partition(gm, at):
        with functorch_config.patch(activation_memory_budget=at):
            fw, bw = min_cut_rematerialization_partition(gm, joint["inputs"], **joint["kwargs"])
        return fw.code, bw.code

    plain = partition(copy.deepcopy(joint["gm"]), budget)
    gm = copy.deepcopy(joint["gm"])
    with quick_min_cut():
        memo, cse = partitioners.solve_min_cut, partitioners.fx_graph_cse
        partition(gm, 1.0)
        quick = partition(gm, budget)
    assert memo.hits == 1  # the second partition's default solve was the first one's
    assert cse.hits == 1  # and its graph the first one's, its common subexpressions eliminated
    assert quick == plain
