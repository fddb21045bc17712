"""Inductor's fusion distance counted without our ops (``fxoffload.backend.fusion_distance``). The fusions it
brings back are checked on OLMoE's backward (``tests/test_sweep_kernels.py``)."""

import torch
import torch.fx as fx
from torch._inductor.virtualized import V

from fxoffload.backend.fusion_distance import distances_without_our_ops, ranks_without
from fxoffload.passes import OFFLOAD


def test_a_position_ranks_among_the_nodes_that_are_not_ours():
    assert ranks_without([]) == []
    assert ranks_without([False, False, False]) == [0, 1, 2]
    # Two of ours between two kernels: the kernels are one apart, as in plain compile's graph.
    ranks = ranks_without([False, True, True, False, False])
    assert ranks == [0, 1, 1, 1, 2]
    assert ranks[3] - ranks[0] == 1
    assert ranks_without([True, True]) == [0, 0]


def _graph(with_offload: bool) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    if with_offload:
        graph.call_function(OFFLOAD, (y, 0, [1]))
    graph.output(y)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_handler_changes_only_while_a_graph_of_ours_compiles():
    plain_handler = type(V.choices)
    with distances_without_our_ops(_graph(with_offload=False)):
        assert type(V.choices) is plain_handler  # a plain graph compiles as without fxoffload
    with distances_without_our_ops(_graph(with_offload=True)):
        handler = type(V.choices)
        assert handler is not plain_handler and issubclass(handler, plain_handler)
        assert handler.can_fuse_horizontal is not plain_handler.can_fuse_horizontal
    assert type(V.choices) is plain_handler


def test_a_graph_whose_ops_are_all_wrapped_in_subgraphs_is_one_of_ours():
    """``pin_offload_order`` wraps our ops in ``control_deps``: the op is in a child graph, not the graph."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    module = fx.GraphModule(torch.nn.Module(), graph)
    module.add_submodule("subgraph_offload", _graph(with_offload=True))
    plain_handler = type(V.choices)
    with distances_without_our_ops(module):
        assert type(V.choices) is not plain_handler


def test_a_compile_inside_a_compile_counts_our_ops_out_once():
    with distances_without_our_ops(_graph(with_offload=True)):
        outer = V.choices
        with distances_without_our_ops(_graph(with_offload=True)):
            assert V.choices is outer  # not wrapped twice: ranks of ranks would halve every distance again
