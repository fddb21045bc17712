"""Pin the planned order of fxoffload ops through Inductor.

Inductor reorders nodes (peak-memory and locality passes, scheduler fusion);
a custom op whose only inputs are early values can be hoisted to the top of
the generated code. For every fxoffload op we add two ordering edges with
PyTorch's ``control_deps`` higher-order op
(``torch/_inductor/fx_passes/control_dependencies.py``):

* the op depends on the nearest compute op before it (it cannot rise), and
  a ``wait`` or ``defer`` also on every earlier reader of the storage it releases (a fused
  reader moved later, or a view's reader, must not outlive the release);
* the nearest compute op after it depends on the op (it cannot sink);
* it depends on the fxoffload op before it, so ours keep their planned order
  even when Inductor moves an anchor earlier (a fused reduction, say);
* a ``defer`` also depends on every last kernel of the graph (a compute op no
  other compute op reads, even through views), so that every kernel runs
  before it. Inductor takes a source as dead after its ``defer`` and may hand
  its memory to a later kernel of the same graph (a buffer reuse, no allocator
  call, so the runtime's reference cannot stop it) while the deferred copy
  still reads it. Deferred releases sit at the forward's end, so this only
  stops Inductor from sinking a kernel past them.

Anchors are compute ops that read a value computed in the graph: an op of
graph inputs only (or of nothing, like ``scalar_tensor``) can be hoisted to the
top by Inductor and would drag the pinned op with it.

Every edge ends at a tensor: an edge to a multi-output op (a tuple, such as
attention's) goes to one of its tensor outputs, moved up to right after the op,
since torch 2.11's lowering of ``control_deps`` drops any other edge without a
word (``fxoffload.compat``). An op none of whose outputs is read keeps its edge,
which holds on later releases.

Applied only when the inner compiler is Inductor; the eager path runs the
graph in its own order. fxoffload nodes are recognised by their op, never by
name.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

from fxoffload.compat import ensure_control_deps
from fxoffload.passes.analysis import is_anchored_compute, is_compute, storage_key
from fxoffload.passes.ops import DEFER, FXOFFLOAD_OPS, RELEASES

__all__ = ["pin_offload_order"]

ensure_control_deps()


def _ordering_edges(graph: fx.Graph) -> dict[fx.Node, OrderedSet[fx.Node]]:
    edges: dict[fx.Node, OrderedSet[fx.Node]] = {}
    previous_compute: fx.Node | None = None
    previous_op: fx.Node | None = None  # the last fxoffload op: ours keep their planned order
    waiting: list[fx.Node] = []  # fxoffload ops since the last compute op
    readers: dict[int, list[fx.Node]] = {}  # storage -> compute nodes that read it so far
    last_kernels = _last_kernels(graph)
    seen: set[fx.Node] = set()  # nodes before this one (never a user of it: the graph is in order)
    for node in graph.nodes:
        seen.add(node)
        if node.op == "call_function" and node.target in FXOFFLOAD_OPS:
            deps = OrderedSet(d for d in (previous_compute, previous_op) if d is not None)
            previous_op = node
            if node.target in RELEASES:
                # A wait releases its keepalive: it must follow every reader of
                # that storage, even one Inductor fuses or moves earlier.
                deps.update(readers.get(storage_key(node.args[1]), []))
            if node.target is DEFER:
                deps.update(k for k in last_kernels if k in seen)
            deps = OrderedSet(d for d in deps if d not in node.all_input_nodes)
            if deps:
                edges[node] = deps
            waiting.append(node)
        elif is_anchored_compute(node):
            for op in waiting:
                if op not in node.all_input_nodes:
                    edges.setdefault(node, OrderedSet()).add(op)
            waiting = []
            previous_compute = node
            for arg in node.all_input_nodes:
                readers.setdefault(storage_key(arg), []).append(node)
    return edges


def _last_kernels(graph: fx.Graph) -> list[fx.Node]:
    """The compute ops whose results no other compute op reads, directly or through views, getitems
    or fxoffload ops: every kernel of the graph runs before all of them have run."""
    feeds_compute: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if any(is_compute(u) or u in feeds_compute for u in node.users):
            feeds_compute.add(node)
    return [n for n in graph.nodes if is_compute(n) and n not in feeds_compute]


def _on_tensors(edges: dict[fx.Node, OrderedSet[fx.Node]]) -> dict[fx.Node, OrderedSet[fx.Node]]:
    """The same edges, each dependency that yields no single tensor (a multi-output op) replaced by
    one of its tensor outputs (a ``getitem``), moved to right after the op if it came later: the
    same order, since that output is made by the op, and moving a ``getitem`` changes nothing else.
    A dependency with no tensor output read stays as it is."""

    def tensor_of(dep: fx.Node) -> fx.Node:
        if isinstance(dep.meta.get("val"), torch.Tensor):
            return dep
        outputs = [u for u in dep.users
                   if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
        if not outputs:
            return dep
        output = min(outputs, key=lambda u: u.args[1])  # the same one whatever the users' order
        dep.append(output)
        return output

    return {node: OrderedSet(tensor_of(d) for d in deps) for node, deps in edges.items()}


def pin_offload_order(module: fx.GraphModule) -> int:
    """Add control dependencies around every fxoffload op; return how many nodes were wrapped."""
    edges = _on_tensors(_ordering_edges(module.graph))
    preserve_node_ordering(module.graph, edges)
    module.recompile()
    return len(edges)
