"""Layer copies: the joint graph of a model of many repeating layers, made from a trace of a few.

Inputs: the joint forward/backward graph AOTAutograd traced of a model whose layers (one
``nn.ModuleList`` of one class) were cut to :func:`traced_layers` of them (``TRACED_LAYERS``, four, where
every layer after the first is alike), the count of layers wanted, and the period the layers repeat with
(1 where all are alike; 6 for Gemma-3, whose every sixth layer attends globally, 2 for Gemma-2).
Outputs: :class:`CopiedLayers`: the joint graph of that many layers, each of its nodes a copy of a
traced one, with fresh fake values, and which traced placeholder each of its placeholders copies.

Why: tracing is most of ``fxoffload fit``'s time (an 8B step's joint graph about two seconds a
layer here), and a model's layers trace alike; a graph of four is traced in a few seconds.

Algorithm. Each traced node belongs to a layer by the outermost numbered module in its module stack
(``nn_module_stack``, or the forward's for a backward node); the nodes of layer ``i`` form blocks,
contiguous in the graph's order: its parameters (placeholders only its nodes read), its forward
(from its first node to the next layer's first) and its backward (from its first backward node to the
next-lower layer's first, the gradient sums between them included). With period ``p``, ``T`` traced
layers (``T >= 2p + 2``, ``T - 1`` and ``n - 1`` alike modulo ``p``: the traced last layer is of the
model's last layer's kind), the middle layers ``1`` to ``T - 2`` each have a layer before and after them:
the graph is accepted only where each middle layer ``i + p``'s blocks are layer ``i``'s shifted by ``p``
layers, node by node (the same op, the same arguments with each node of layer ``k`` read as the same
node of layer ``k + p`` and every other node the same, the same sizes, dtypes and checkpoint tags).
The new graph keeps layer 0 and the nodes outside the layers, copies layer ``1 + (j - 1) mod p`` for
each layer ``j`` of ``1`` to ``n - 2`` and layer ``T - 1`` for the last, in the traced order (forward
up, backward down): a copy for layer ``j`` of a node of layer ``s`` reads, for a node of layer ``i``,
the same node of layer ``j + i - s``. Why the neighbours' offsets agree: a copy of layer ``p`` reads
the copy of layer 1 above it as layer ``p`` reads layer ``p + 1`` (layer 1 shifted), a copy of layer 1
reads the copy of layer ``p`` below it as layer ``p + 1`` reads layer ``p``, and the copy for ``n - 2``
reads the last layer as layer ``T - 2`` (its source shifted) reads layer ``T - 1``.

A head: a model whose first layers are unlike the rest (DeepSeek's dense layers before its experts) keeps
its first ``h`` layers as traced (``h = 1``: layer 0 alone, as above), and the above holds with layer
``h`` in layer 1's place: ``T >= h + 2p + 1``, the pairs checked from layer ``h`` on, layer
``h + (j - h) mod p`` copied for each layer ``j`` from ``h`` to ``n - 2``. The caller picks ``h`` two layers
past the unlike ones: the first layer of the rest reads an unlike layer's outputs (at other offsets in
its block), and may hold the size nodes every later layer reads (``sym_size`` of its input, made once),
so only the second one on reads a layer of its own kind laid out as the rest.
A node outside the layers reads layer 0 and the last layer only. A node that computes a size from
the graph's symbolic sizes alone (no tensor in or out: ``batch * length``, which a symbolic batch, or
a batch above one beside a symbolic length, makes for every layer's views to read) belongs to no
layer, wherever it sits: it is copied once, in its place, and every copy reads it (``_size_nodes``).
Activation checkpointing's region ids
(``ac_graph_id``) shift with the layer, so that they still grow along the forward.

Fresh values: every copy of a middle layer but the first gets fake tensors of its own (the planner tells
storages apart by identity): each storage the traced graph made is made again, as large, by the copy
of the node that made it, and every view of it becomes the same view of the new one.

Limits: one list of layers; layers that read only their neighbours; nothing outside the layers that
reads a middle layer (a head layer may be read); at least as many layers as traced. The layers past those
traced are not seen here: the caller first checks that the model builds them repeating with the period
(``fxoffload.tools.models.layer_period``) and the traced ones as the model's.
Node names are FX's own for the new graph (a trace of all the layers numbers some of them otherwise).
Anything else raises :class:`LayerCopyError`, and the caller traces every layer instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from .analysis import tensor_nbytes, tensor_storage_key, traced_value

__all__ = ["TRACED_LAYERS", "CopiedLayers", "LayerCopyError", "copy_layers", "traced_layers"]

TRACED_LAYERS = 4  # layer 0, two middle layers to compare, the last: traced_layers(n, 1)
_NUMBERED = re.compile(r"^(.*)\.(\d+)$")
_KINDS = ("params", "forward", "backward")


class LayerCopyError(ValueError):
    """The traced graph's layers do not repeat as :func:`copy_layers` needs (the reason in words)."""


def traced_layers(layers: int, period: int = 1, head: int = 1) -> int:
    """How many layers to trace for copies to ``layers`` of ``period`` after ``head`` layers kept as traced:
    the fewest ``t`` with two whole periods between the head and the last (``t >= head + 2 * period + 1``)
    whose last is of the model's last's kind (``t - layers`` a multiple of ``period``). May exceed
    ``layers``: then every layer is traced."""
    if period < 1 or head < 1:
        raise ValueError(f"period {period}, head {head}: accepted: 1 or more each")
    least = head + 2 * period + 1
    return least + (layers - least) % period


class Place(NamedTuple):
    """Where a traced node sits: its layer, its block (``_KINDS``) and its position in the block."""

    layer: int
    kind: str
    offset: int


@dataclasses.dataclass(frozen=True)
class CopiedLayers:
    """The new joint graph, and for each of its placeholders (in order) the traced one it copies."""

    module: fx.GraphModule
    sources: tuple[fx.Node, ...]
    layers: int
    added_parameter_bytes: int  # of the inputs that get a gradient (parameters), the copies' over the trace's

    def primal_indices(self, traced: Sequence[int]) -> list[int]:
        """The positions among the new primal inputs of those that copy the traced primals at ``traced``."""
        primals = [n for n in self.sources if n.name.startswith("primals_")]
        wanted = set(traced)  # AOTAutograd names the traced primal inputs primals_1, primals_2, ... in order
        return [i for i, n in enumerate(primals) if int(n.name.rsplit("_", 1)[1]) - 1 in wanted]


def copy_layers(gm: fx.GraphModule, layers: int, fake_mode: Any, period: int = 1, head: int = 1) -> CopiedLayers:
    """The joint graph ``gm`` (of ``traced_layers(layers, period, head)`` layers) made again with ``layers``
    layers that repeat every ``period`` after the first ``head``; see the module's docstring. ``fake_mode``:
    the trace's fake tensor mode (the copies' values are made in it)."""
    traced = traced_layers(layers, period, head)
    if layers < traced:
        raise LayerCopyError(f"{layers} layers: copies of period {period} after {head} need at least {traced}")
    sizes = _size_nodes(gm.graph)
    spans = _blocks(gm.graph, traced, sizes)
    blocks = {key: [n for n in span if n not in sizes] for key, span in spans.items()}
    places = {node: Place(layer, kind, offset) for (layer, kind), nodes in blocks.items()
              for offset, node in enumerate(nodes)}
    repeat = _Repeat(period, traced, head)
    _check_repeats(blocks, places, repeat, sizes)
    return _Copier(gm, spans, places, repeat, layers, fake_mode, sizes).run()


class _Repeat(NamedTuple):
    """How the traced layers repeat: ``period``, how many were traced, and how many lead kept as traced."""

    period: int
    traced: int
    head: int

    def source(self, layer: int, layers: int) -> int:
        """The traced layer a new layer (of ``layers``) copies."""
        if layer == layers - 1:
            return self.traced - 1
        if layer < self.head:
            return layer
        return self.head + (layer - self.head) % self.period

    def middle(self) -> range:
        """The traced layers the middle's copies are made of (the first period) or checked by."""
        return range(self.head, self.traced - 1)


def _size_nodes(graph: fx.Graph) -> frozenset[fx.Node]:
    """The nodes that compute a size from the graph's symbolic sizes alone (``batch * length`` as a view
    of every layer reads it): no tensor in or out. Such a node sits in the first layer that reads it,
    and every layer reads that one node (a symbolic batch, or a batch above one beside a symbolic
    length, makes them)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not node.all_input_nodes or _holds_tensor(node):
            continue
        if all(a in found or (a.op == "placeholder" and not _holds_tensor(a)) for a in node.all_input_nodes):
            found.add(node)
    return frozenset(found)


def _holds_tensor(node: fx.Node) -> bool:
    return any(isinstance(v, torch.Tensor) for v in tree_flatten(traced_value(node))[0])


def _layer_of(node: fx.Node) -> tuple[str, int] | None:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, _ in stack.values():
        match = _NUMBERED.match(str(path))
        if match:
            return match.group(1), int(match.group(2))
    return None


def _blocks(graph: fx.Graph, traced: int, sizes: frozenset = frozenset()) -> dict[tuple[int, str], list[fx.Node]]:
    """Each layer's blocks, spans of the graph's order: a size node (``sizes``) in a span belongs to no layer."""
    nodes = list(graph.nodes)
    owners = {n: None if n in sizes else _layer_of(n) for n in nodes if n.op == "call_function"}
    lists = {owner[0] for owner in owners.values() if owner}
    if len(lists) != 1:
        raise LayerCopyError(f"the graph's nodes sit in {len(lists)} numbered module lists, not one")
    found = sorted({owner[1] for owner in owners.values() if owner})
    if found != list(range(traced)):
        raise LayerCopyError(f"the graph's layers are {found}, not 0 to {traced - 1} (the {traced} traced layers "
                             "these copies are made from)")
    layer_of = {n: owner[1] for n, owner in owners.items() if owner}
    forward = [n for n in nodes if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"]
    backward = [n for n in nodes if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_backward"]
    if len(forward) + len(backward) != len(owners) or nodes.index(backward[0]) < nodes.index(forward[-1]):
        raise LayerCopyError("the graph's forward and backward nodes are not two runs, one after the other")
    blocks = {}
    for kind, section, order in (("forward", forward, range(traced)),
                                 ("backward", backward, reversed(range(traced)))):
        blocks.update(_runs(section, layer_of, list(order), kind))
    for layer in range(traced):
        blocks[(layer, "params")] = _parameters(graph, layer, blocks, sizes)
    return blocks


def _runs(section: list[fx.Node], layer_of: dict, order: list[int], kind: str) -> dict:
    """Each layer's block of ``section``: from its first node to the next layer's first (the last layer's
    to its own last node); every node of a layer must fall in its block."""
    firsts = [next(i for i, n in enumerate(section) if layer_of.get(n) == layer) for layer in order]
    last = max(i for i, n in enumerate(section) if layer_of.get(n) == order[-1])
    ends = firsts[1:] + [last + 1]
    if firsts != sorted(firsts):
        raise LayerCopyError(f"the layers' {kind} nodes are not in the layers' order")
    runs = {}
    for layer, start, end in zip(order, firsts, ends):
        run = section[start:end]
        if any(layer_of.get(n, layer) != layer for n in run):
            raise LayerCopyError(f"layer {layer}'s {kind} nodes interleave with another layer's")
        runs[(layer, kind)] = run
    inside = {n for run in runs.values() for n in run}
    if any(n in layer_of and n not in inside for n in section):
        raise LayerCopyError(f"some {kind} nodes of the layers fall outside their blocks")
    return runs


def _parameters(graph: fx.Graph, layer: int, blocks: dict, sizes: frozenset = frozenset()) -> list[fx.Node]:
    own = (set(blocks[(layer, "forward")]) | set(blocks[(layer, "backward")])) - sizes
    placeholders = list(graph.find_nodes(op="placeholder"))
    mine = [p for p in placeholders if p.users and all(u in own for u in p.users)]
    positions = [placeholders.index(p) for p in mine]
    if not mine or positions != list(range(positions[0], positions[0] + len(mine))):
        raise LayerCopyError(f"layer {layer}'s parameters are not one run of the graph's inputs")
    return mine


def _signature(node: fx.Node, places: dict, shift: int, sizes: frozenset = frozenset()) -> tuple:
    """What must match between a node of layer 1 and its shifted twin of layer 2 (``shift`` added to
    every layer it reads but a size node's, ``sizes``: one node, whichever layer it sits in)."""

    def read(a: Any) -> Any:
        if isinstance(a, fx.Node) and a in sizes:
            return ("size", a)
        if isinstance(a, fx.Node):
            place = places.get(a)
            return ("node", a) if place is None else (place.layer + shift, place.kind, place.offset)
        return a

    flat, _ = tree_flatten(traced_value(node))
    vals = tuple((tuple(map(str, v.shape)), tuple(map(str, v.stride())), str(v.storage_offset()), v.dtype)
                 if isinstance(v, torch.Tensor) else str(v) for v in flat)
    target = None if node.op == "placeholder" else node.target  # a placeholder's is its name
    return (node.op, target, str(tree_map(read, (node.args, node.kwargs))), vals,
            node.meta.get("recompute"), node.meta.get("partitioner_tag"))


def _check_repeats(blocks: dict, places: dict, repeat: _Repeat, sizes: frozenset = frozenset()) -> None:
    """Each middle layer ``i + p``'s blocks are layer ``i``'s shifted by the period ``p``, node by node."""
    step = repeat.period
    for low in range(repeat.head, repeat.traced - 1 - step):
        high = low + step
        for kind in _KINDS:
            one, two = blocks[(low, kind)], blocks[(high, kind)]
            if len(one) != len(two):
                raise LayerCopyError(f"layers {low} and {high} have {len(one)} and {len(two)} {kind} nodes")
            for a, b in zip(one, two):
                if _signature(a, places, step, sizes) != _signature(b, places, 0, sizes):
                    raise LayerCopyError(f"layer {high}'s {kind} node {b.name} is not layer {low}'s {a.name} "
                                         f"{step} layer{'s' if step > 1 else ''} on")


class _Copier:
    def __init__(self, gm: fx.GraphModule, spans: dict, places: dict, repeat: _Repeat, layers: int, fake_mode: Any,
                 sizes: frozenset = frozenset()) -> None:
        # spans: the blocks with the size nodes among them (``_size_nodes``: copied once, where they sit)
        self.gm, self.spans, self.places, self.layers, self.fake_mode = gm, spans, places, layers, fake_mode
        self.repeat = repeat
        self.blocks = {key: [n for n in span if n not in sizes] for key, span in spans.items()}
        self.sizes = sizes
        self.graph = fx.Graph()
        self.new: dict[tuple[int, str, int], fx.Node] = {}  # (new layer, kind, offset) -> its node
        self.shared: dict[fx.Node, fx.Node] = {}  # a traced node outside the layers -> its copy
        self.sources: list[fx.Node] = []  # per new placeholder, the traced one it copies
        self.copied_as: list[tuple[int, int] | None] = []  # per new placeholder: (traced layer, new layer)
        self.made: dict[tuple[int, int], Any] = {}  # (new layer, traced storage) -> the copy's storage
        self.owners = _storage_owners(gm.graph)
        self.id_step = _ac_id_step(self.blocks, repeat.head)
        self.primals = 0
        primals = [p for p in gm.graph.find_nodes(op="placeholder") if p.name.startswith("primals_")]
        flat = list(next(iter(gm.graph.find_nodes(op="output"))).args[0])
        self.head = len(flat) - len(primals)  # the forward's outputs; then one gradient per primal input
        self.grad_of = dict(zip(primals, flat[self.head:]))

    def run(self) -> CopiedLayers:
        last = self.layers - 1
        for node in self.gm.graph.nodes:
            place = self.places.get(node)
            if node.op == "output":
                self.graph.output(self.outputs(node))
            elif place is None and node not in self.shared:  # (a size node in a block: copied with it)
                self.shared[node] = self.copy_node(node, self.read_from_shared)
            elif place is None:
                continue
            elif place.offset != 0 or place.layer in self.repeat.middle()[1:]:
                continue  # a block is copied whole at its first node; the middle's later layers only checked
            elif place.layer == self.repeat.head:  # every middle layer's block, each a copy of its source's
                head = self.repeat.head
                order = range(head, last) if place.kind != "backward" else range(last - 1, head - 1, -1)
                for layer in order:
                    self.copy_block(place.kind, self.repeat.source(layer, self.layers), layer)
            else:  # a layer of the head, or the last
                self.copy_block(place.kind, place.layer, place.layer if place.layer < self.repeat.head else last)
        self.graph.lint()
        return CopiedLayers(fx.GraphModule(self.gm, self.graph), tuple(self.sources), self.layers,
                            self.added_parameter_bytes())

    def added_parameter_bytes(self) -> int:
        """The parameters' bytes (inputs that get a gradient) of the new middle layers over the traced ones'."""
        of = [sum(int(tensor_nbytes(traced_value(p))) for p in self.blocks[(layer, "params")]
                  if isinstance(self.grad_of.get(p), fx.Node)) for layer in range(self.repeat.traced)]
        copied = sum(of[self.repeat.source(layer, self.layers)] for layer in range(1, self.layers - 1))
        return copied - sum(of[1:self.repeat.traced - 1])

    def copy_block(self, kind: str, source: int, layer: int) -> None:
        for node in self.spans[(source, kind)]:
            if node in self.sizes:  # one node for every layer, copied once, in its place
                if node not in self.shared:
                    self.shared[node] = self.copy_node(node, self.read_from_shared)
                continue
            self.new[(layer, kind, self.places[node].offset)] = self.copy_node(
                node, lambda a: self.read_from(a, source, layer), (source, layer))

    def copy_node(self, node: fx.Node, read: Callable[[fx.Node], fx.Node], layer: tuple | None = None) -> fx.Node:
        copied = self.placeholder(node, layer) if node.op == "placeholder" else self.graph.node_copy(node, read)
        if layer is not None:
            source, new_layer = layer
            if "ac_graph_id" in node.meta:
                copied.meta["ac_graph_id"] = node.meta["ac_graph_id"] + (new_layer - source) * self.id_step
            copied.meta["val"] = tree_map(lambda v: self.value_for(v, node, source, new_layer), traced_value(node))
        return copied

    def placeholder(self, node: fx.Node, layer: tuple | None) -> fx.Node:
        desc = node.meta.get("desc")
        name = node.name
        if name.startswith("primals_"):
            self.primals += 1
            name = f"primals_{self.primals}"
            if dataclasses.is_dataclass(desc) and hasattr(desc, "idx"):
                desc = dataclasses.replace(desc, idx=self.primals - 1)
        copied = self.graph.placeholder(name)
        copied.meta = {**node.meta, **({"desc": desc} if desc is not None else {})}
        self.sources.append(node)
        self.copied_as.append(layer)
        return copied

    def read_from(self, a: fx.Node, source: int, layer: int) -> fx.Node:
        place = self.places.get(a)
        if place is None and a not in self.shared:
            raise LayerCopyError(f"layer {source}'s node reads {a.name} before its place in the graph")
        if place is None:
            return self.shared[a]
        target = layer + place.layer - source
        if abs(place.layer - source) > 1 or not 0 <= target < self.layers:
            raise LayerCopyError(f"layer {source}'s node reads layer {place.layer}'s {a.name}: not a neighbour")
        return self.new[(target, place.kind, place.offset)]

    def read_from_shared(self, a: fx.Node) -> fx.Node:
        place = self.places.get(a)
        if place is None and a not in self.shared:
            raise LayerCopyError(f"a node outside the layers reads {a.name} before its place in the graph")
        if place is None:
            return self.shared[a]
        if self.repeat.head <= place.layer < self.repeat.traced - 1:
            raise LayerCopyError(f"a node outside the layers reads layer {place.layer}'s {a.name}")
        target = place.layer if place.layer < self.repeat.head else self.layers - 1
        return self.new[(target, place.kind, place.offset)]

    def outputs(self, node: fx.Node) -> Any:
        """The joint graph's outputs: the forward's, then one gradient per primal input, in its order."""
        out = [self.read_from_shared(a) if isinstance(a, fx.Node) else a for a in node.args[0][:self.head]]
        for traced, layer in zip(self.sources, self.copied_as):
            if not traced.name.startswith("primals_"):
                continue
            grad = self.grad_of[traced]
            if not isinstance(grad, fx.Node):
                out.append(grad)
            else:
                out.append(self.read_from_shared(grad) if layer is None else self.read_from(grad, *layer))
        return type(node.args[0])(out)

    def value_for(self, value: Any, node: fx.Node, source: int, layer: int) -> Any:
        """The fake value of ``node``'s copy for ``layer``: ``value`` itself where its storage is the one
        the new graph holds there, else the same view of the storage that stands for it (made anew by the
        copy of the node that made it)."""
        if not isinstance(value, torch.Tensor):
            return value
        key = tensor_storage_key(value)
        owner, leaf = self.owners.get(key, (None, 0))
        place = self.places.get(owner) if owner is not None else None
        if place is None:
            return value  # made outside the layers (or a graph input's)
        target = layer + place.layer - source
        if owner is node:
            if source not in self.repeat.middle() or layer == source:
                return value  # the traced node itself stands here (layer 0, a middle source's first copy, the last)
            storage = self.made.get((target, key))
            if storage is None:  # made on the meta device: a fake tensor's own dispatch costs ten times more
                storage = self.made[(target, key)] = torch.empty(
                    (value.untyped_storage().nbytes(),), dtype=torch.uint8, device="meta").untyped_storage()
        else:
            stands = tree_flatten(self.new[(target, place.kind, place.offset)].meta["val"])[0][leaf]
            if tensor_storage_key(stands) == key:
                return value
            storage = stands.untyped_storage()
        # An empty tensor on the storage, then the view: ``set_`` to the view's sizes at once recomputes
        # their symbolic contiguity and bounds (about 1 ms a value at symbolic sizes, 8 s of an 8B model's
        # fit), where ``as_strided`` to them costs about 10 us.
        elem = torch.empty((0,), dtype=value.dtype, device="meta").set_(storage, 0, (0,), (1,)).as_strided(
            value.shape, value.stride(), value.storage_offset())
        return FakeTensor(self.fake_mode, elem, value.device)


def _storage_owners(graph: fx.Graph) -> dict[int, tuple[fx.Node, int]]:
    """Each traced storage's key -> the first node whose value holds it, and which of its values does."""
    owners: dict[int, tuple[fx.Node, int]] = {}
    for node in graph.nodes:
        flat, _ = tree_flatten(traced_value(node))
        for i, v in enumerate(flat):
            if isinstance(v, torch.Tensor):
                owners.setdefault(tensor_storage_key(v), (node, i))
    return owners


def _ac_id_step(blocks: dict, first: int) -> int:
    """Checkpointing's region ids a layer on: the first two middle layers' (``first`` on)."""
    ids = [next((n.meta["ac_graph_id"] for n in blocks[(layer, "forward")] if "ac_graph_id" in n.meta), None)
           for layer in (first, first + 1)]
    return ids[1] - ids[0] if None not in ids else 0

