"""Inductor's fusion distance counted without our ops (``fxoffload.backend.fusion_distance``; the fusions it
brings back are checked on OLMoE's backward, ``tests/test_sweep_kernels.py``), and its FX graph cache keyed
on our source."""

import pytest
import torch
import torch.fx as fx
from torch._inductor.virtualized import V

import fxoffload
from fxoffload.backend import fusion_distance
from fxoffload.backend.fusion_distance import (
    cached_under_our_source, distances_without_our_ops, ranks_without, source_digest,
)
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


# ------------------------------------------------------------------- the FX graph cache, keyed on our source


def test_the_source_digest_names_every_python_file_by_its_place_and_bytes(tmp_path):
    first, second = tmp_path / "a" / "fxoffload", tmp_path / "b" / "fxoffload"
    for root in (first, second):
        (root / "backend").mkdir(parents=True)
        (root / "__init__.py").write_text("x = 1\n")
        (root / "backend" / "ordering.py").write_text("y = 2\n")
        (root / "notes.txt").write_text("not source")
    assert source_digest([first]) == source_digest([second])  # wherever the checkout lies
    (second / "notes.txt").write_text("another text")
    assert source_digest([first]) == source_digest([second])  # Python files only
    (second / "backend" / "ordering.py").write_text("y = 3\n")
    assert source_digest([first]) != source_digest([second])
    (second / "backend" / "ordering.py").write_text("y = 2\n")
    (second / "backend" / "ordering.py").rename(second / "ordering.py")
    assert source_digest([first]) != source_digest([second])  # the same bytes at another place


def test_control_deps_is_cacheable_under_our_source_only_while_a_graph_of_ours_compiles():
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.control_dependencies import control_deps

    users = {"torch.ops.their_op": "their key"}
    with inductor_config.patch(unsafe_marked_cacheable_functions=users):
        with cached_under_our_source(_graph(with_offload=False)):
            assert not control_deps.cacheable()  # a plain graph is keyed as without fxoffload
        with cached_under_our_source(_graph(with_offload=True)):
            assert control_deps.cacheable()
            marked = dict(inductor_config.unsafe_marked_cacheable_functions)
        assert inductor_config.unsafe_marked_cacheable_functions == users
    assert not control_deps.cacheable()
    assert marked["torch.ops.their_op"] == "their key"  # the user's marks kept
    assert fusion_distance._our_digest() in marked["torch.ops.higher_order.control_deps"]


def _compile_step(monkeypatch, digest: str) -> fxoffload.OffloadBackend:
    """One step of a small MLP under fxoffload and Inductor, as an fxoffload whose source has ``digest``."""
    monkeypatch.setattr(fusion_distance, "_our_digest", lambda: digest)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    backend = fxoffload.offload_backend(inner="inductor", memory_budget=0.5, strategy="offload", min_bytes=0)
    torch.compile(model, backend=backend)(torch.randn(16, 32)).square().sum().backward()
    assert backend.records and backend.records[0].plan.transfers, "nothing offloaded: no graph of ours"
    return backend


def _cache_counts(step) -> dict[str, int]:
    """How many of the FX graph cache's hits, misses and bypasses ``step()`` made."""
    from torch._dynamo.utils import counters

    names = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    before = {name: counters["inductor"][name] for name in names}
    step()
    return {name.removeprefix("fxgraph_cache_"): counters["inductor"][name] - before[name] for name in names}


@pytest.mark.compat  # 7 s or more, and what it checks (Inductor's cache hooks) differs between releases
def test_an_entry_another_fxoffload_wrote_is_not_reused(monkeypatch):
    """Inductor's FX graph cache, on, in a fresh folder: the same source hits both entries its first compile
    wrote (a graph of ours, ordered by ``control_deps``, was bypassed), the forward, whose offloads tell the
    prefetches their layouts, among them (its code tells them: ``ordering.layouts_from_code``); another
    source (another fxoffload, whose lowering may differ) misses every entry."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), inductor_config.patch(fx_graph_cache=True):
        first = _cache_counts(lambda: _compile_step(monkeypatch, "0123456789abcdef"))
        assert first == {"hit": 0, "miss": 2, "bypass": 0}, first  # the forward and the backward
        again = _cache_counts(lambda: _compile_step(monkeypatch, "0123456789abcdef"))
        assert again == {"hit": 2, "miss": 0, "bypass": 0}, again
        other = _cache_counts(lambda: _compile_step(monkeypatch, "fedcba9876543210"))
        assert other == {"hit": 0, "miss": 2, "bypass": 0}, other
