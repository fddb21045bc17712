"""Ordering edges for Inductor (``fxoffload.ordering``), checked on graphs without compiling them (fast)."""

from fxoffload.ordering import _ordering_edges
from fxoffload.passes.analysis import is_anchored_compute, storage_key
from fxoffload.passes.ops import RELEASES


def test_every_release_is_ordered_after_every_reader_of_the_storage_it_frees(offloaded_llama_record):
    """Fast (no Inductor compile): on the rewritten forward of a small Llama, each ``wait``/``defer``
    gets an ordering edge from every earlier compute op that reads its storage through any alias,
    not only from the op just before it. Inductor may fuse or move a reader later; without the edge
    the device copy could be freed under it."""
    graph = offloaded_llama_record.forward.graph
    edges = _ordering_edges(graph)
    seen, several = [], 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in RELEASES:
            freed = storage_key(node.args[1])
            readers = {n for n in seen if any(storage_key(a) == freed for a in n.all_input_nodes)}
            several += len(readers) > 1
            assert readers <= set(edges.get(node, ())) | set(node.all_input_nodes), node.name
        elif is_anchored_compute(node):
            seen.append(node)
    assert several, "no release frees a storage with several readers: the test would prove nothing"
