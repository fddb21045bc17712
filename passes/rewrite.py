"""Rewrite: insert the fxoffload ops into the forward and backward graphs.

Inputs: the forward and backward graphs, the ``Plan`` and the ``Schedule``. Output: the pair,
edited in place (``offload``, ``wait``, ``defer``, ``prefetch``, ``prefetch_ahead`` nodes and
recompute chains).

Reads a :class:`~fxoffload.passes.plan.Plan` and a :class:`~fxoffload.passes.scheduling.Schedule`
and edits the pair in place; it decides nothing. Nodes are found through the
plan and schedule (which hold the nodes themselves), never by name or position.

Forward, per transfer: ``host = offload(base, order, stride)`` after ``offload_after``
(``order``: its place among the backward's prefetches; ``stride``: the base's traced strides, those
its prefetch asks for, which the host buffer's bytes follow: ``ops``),
``host = wait(host, base)`` after ``free_after`` (``defer`` instead when the
schedule lets the copy cross the graph's end; ``keep_last`` on the transfers
``scheduling.kept_in_last_run`` names); the saved outputs of the
transfer's members are replaced by the one released host buffer.
Backward, per transfer: a new input takes the host buffer;
``dev = prefetch(host, device, size, stride)`` before ``prefetch_before``,
``dev = wait(dev, host)`` before ``wait_before``, then each member's view
chain is replayed on ``dev`` and replaces the member's old input. Symbolic
sizes (dynamic shapes) become backward values (:class:`_Sizes`: ``sym_size`` of
an input that carries each symbol, then sums and products), and a member whose
chain takes forward values as arguments is rebuilt with ``as_strided``; one
``prefetch_ahead(after, bytes)`` before ``Schedule.ahead_before`` when the schedule
starts copies for the backward that runs next.
Recomputations (before the transfers, whose waits they may follow): each
chain of forward ops is copied into the backward right before its consumer,
reading the backward inputs of the saved values it needs, and the symbolic
sizes it reads as backward values (:class:`_Sizes`, from the inputs that stay);
the members are rebuilt from it as after a prefetch, and leave the saved tensors.
Both graphs keep AOTAutograd's calling convention (user outputs, saved
tensors, saved symints; backward inputs in the matching order), then are
linted; the caller regenerates their code (``module.recompile()``). Every new
node gets a fake ``meta["val"]``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .analysis import SavedActivation, SavedInterface, reads_size_only, symbol_sources
from .ops import DEFER, OFFLOAD, PREFETCH, PREFETCH_AHEAD, TRANSFER_META, WAIT
from .eligibility import replayable
from .plan import Plan
from .scheduling import Schedule, kept_in_last_run

__all__ = ["rewrite_pair"]


def _fake_of(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def _trace(target: Callable, args: tuple, kwargs: dict | None = None) -> Any:
    fake_args = torch.utils._pytree.tree_map(_fake_of, (args, kwargs or {}))
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves(fake_args))
    with mode:
        return target(*fake_args[0], **fake_args[1])


def _value(target: Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """The fake value of a new node: a wait returns its input; other ops are traced."""
    if target in (WAIT, DEFER):
        return args[0].meta["val"]
    return _trace(target, args, kwargs)


class _Inserter:
    """Inserts nodes after an anchor in call order (several inserts after one anchor stay ordered)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._last: dict[fx.Node, fx.Node] = {}

    def after(self, anchor: fx.Node, target: Callable, args: tuple) -> fx.Node:
        with self.graph.inserting_after(self._last.get(anchor, anchor)):
            node = self.graph.call_function(target, args)
        node.meta["val"] = _value(target, args)
        self._last[anchor] = node
        return node


def _before(graph: fx.Graph, anchor: fx.Node, target: Callable, args: tuple, kwargs=None, val=None) -> fx.Node:
    with graph.inserting_before(anchor):
        node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = _value(target, args, kwargs) if val is None else val
    return node


def _rewrite_forward(fw: fx.Graph, plan: Plan, schedule: Schedule, interface: SavedInterface) -> list[fx.Node]:
    """Insert offloads and their waits; return the waited host buffer of each transfer."""
    inserter = _Inserter(fw)
    hosts = []
    # Each offload carries its place among the backward's prefetches, for copies started ahead.
    order = {k: i for i, k in enumerate(schedule.prefetch_order or range(len(plan.transfers)))}
    kept = set(kept_in_last_run(plan, schedule))
    sizes = _Sizes(fw, list(fw.find_nodes(op="placeholder")))
    layouts = [_layout(sizes, transfer.base) for transfer in plan.transfers]  # their sizes first, at the top
    for k, (transfer, place) in enumerate(zip(plan.transfers, schedule.placements)):
        host = inserter.after(_after_sizes(place.offload_after, sizes), OFFLOAD, (transfer.base, order[k], *layouts[k]))
        host.meta[TRANSFER_META] = k
        release = DEFER if place.deferred else WAIT
        # A release deferred in the runs before the step's last waits in that one (``passes.ops``); one kept
        # keeps its source in the last run, for that run's backward.
        before_last = place.deferred_before_last and not place.deferred
        flags = (before_last, True) if k in kept else (True,) if before_last else ()
        hosts.append(inserter.after(_after_sizes(place.free_after, sizes), release, (host, transfer.base, *flags)))
        _unpadded(transfer.base, host, hosts[-1])
    saved: list[fx.Node] = []
    for decision, node in zip(plan.decisions, interface.fw_saved):
        if decision.recompute is not None:
            continue  # no longer saved: the backward rebuilds it
        if decision.transfer is None:
            saved.append(node)
        elif hosts[decision.transfer] not in saved:
            saved.append(hosts[decision.transfer])
    saved += _inputs_to_save(plan, interface)
    out = fw.output_node()
    old = tuple(out.args[0])
    rest = old[interface.num_user_outputs + len(interface.fw_saved) :]
    out.args = (old[: interface.num_user_outputs] + tuple(saved) + rest,)
    return hosts


def _after_sizes(anchor: fx.Node, sizes: "_Sizes") -> fx.Node:
    """Where an op placed after ``anchor`` goes: a graph input's offload or release (a layer's input) goes
    after the symbolic sizes made at the top of the graph, which its layout may read, not among the inputs."""
    return sizes.last if anchor.op == "placeholder" and sizes.last is not None else anchor


def _layout(sizes: "_Sizes", base: fx.Node) -> tuple[Any, ...]:
    """The offload's last argument: the traced strides its prefetch asks for, which the host buffer's bytes
    follow (``ops``), as forward values; none (the source's own at run time) where a symbol of them is
    not among the forward's inputs."""
    try:
        return (sizes.of(base.meta["val"].stride()),)
    except KeyError:
        return ()


def _unpadded(*nodes: fx.Node) -> None:
    """Keep Inductor from padding an offloaded source's strides (``comprehensive_padding``, on for
    GPUs): the plan priced the copy of the traced layout, and the CUDA engine copies a padded tensor
    through a full-size contiguous buffer the plan would not count. Inductor pads a layout when it
    fixes it, unless the node it is lowering then dislikes padding: the source's own node, or the
    offload or release that reads it (their ``control_deps`` wrappers copy the mark)."""
    for node in nodes:
        node.meta["dislike_padding"] = True


def _replay(bw: fx.Graph, anchor: fx.Node, base: fx.Node, act: SavedActivation) -> fx.Node:
    mapping = {act.base: base}
    current = base
    for node in act.view_chain:
        args = fx.map_arg(node.args, lambda a: mapping[a])
        kwargs = fx.map_arg(node.kwargs, lambda a: mapping[a])
        current = _before(bw, anchor, node.target, args, kwargs, val=node.meta["val"])
        mapping[node] = current
    return current


class _Sizes:
    """Symbolic sizes as backward values (one compiled graph serves every size): each symbol read
    off an input that carries it (``sym_size``, or a symint input), then sums and products, made
    once at the top of the graph. Plain ints stay ints."""

    def __init__(self, graph: fx.Graph, inputs: Sequence[fx.Node]) -> None:
        self.graph = graph
        self.sources = symbol_sources(inputs)
        self.made: dict[Any, tuple[Any, Any]] = {}  # sympy expression -> (int or node, its value)
        self.last: fx.Node | None = None

    def of(self, values: Sequence[Any]) -> list[Any]:
        return [v if isinstance(v, int) else self._make(v.node.expr)[0] for v in values]

    def view(self, anchor: fx.Node, base: fx.Node, val: torch.Tensor) -> fx.Node:
        """``val``'s view of the prefetched base (a symbolic view chain's own arguments are forward values)."""
        args = (base, self.of(val.shape), self.of(val.stride()), self.of([val.storage_offset()])[0])
        return _before(self.graph, anchor, torch.ops.aten.as_strided.default, args, val=val)

    def _make(self, expr: Any) -> tuple[Any, Any]:
        if expr.is_Integer:
            return int(expr), int(expr)
        if expr not in self.made:
            if expr.is_Symbol:
                self.made[expr] = self._read(expr)
            else:
                parts = ([self._make(a) for a in expr.args] if not expr.is_Pow
                         else [self._make(expr.base)] * int(expr.exp))
                combine = operator.add if expr.is_Add else operator.mul
                made = parts[0]
                for part in parts[1:]:
                    made = self._apply(combine, made, part)
                self.made[expr] = made
        return self.made[expr]

    def _read(self, symbol: Any) -> tuple[fx.Node, Any]:
        node, dim = self.sources[symbol]
        if dim is None:
            return node, node.meta["val"]
        return self._insert(torch.ops.aten.sym_size.int, (node, dim), node.meta["val"].shape[dim])

    def _apply(self, op: Callable, x: tuple[Any, Any], y: tuple[Any, Any]) -> tuple[Any, Any]:
        value = op(x[1], y[1])
        if isinstance(x[0], int) and isinstance(y[0], int):
            return value, value
        return self._insert(op, (x[0], y[0]), value)

    def _insert(self, target: Callable, args: tuple, value: Any) -> tuple[fx.Node, Any]:
        if self.last is None:  # the first: before everything the graph computes
            with self.graph.inserting_before(next(n for n in self.graph.nodes if n.op != "placeholder")):
                node = self.graph.call_function(target, args)
        else:  # after the sizes made before it, which it may read
            with self.graph.inserting_after(self.last):
                node = self.graph.call_function(target, args)
        node.meta["val"] = value
        self.last = node
        return node, value


def _rewrite_backward(
    bw: fx.Graph,
    plan: Plan,
    schedule: Schedule,
    interface: SavedInterface,
    activations: Sequence[SavedActivation],
    fw_hosts: Sequence[fx.Node],
) -> None:
    placeholders = list(bw.find_nodes(op="placeholder"))
    received = _receive_recompute_inputs(bw, plan, interface, placeholders[0])
    host_inputs = []
    for transfer, fw_host in zip(plan.transfers, fw_hosts):
        with bw.inserting_before(placeholders[0]):
            host = bw.placeholder(f"{transfer.base.name}_host")
        host.meta["val"] = fw_host.meta["val"]  # the same host buffer crosses from forward to backward
        host_inputs.append(host)
    # Symbolic sizes, for the chains and the prefetches alike, read off the inputs that stay (not the
    # saved tensors this plan moves or rebuilds).
    removed = {activations[i].bw_node for t in (*plan.transfers, *plan.recomputes) for i in t.members}
    sizes = _Sizes(bw, [p for p in bw.find_nodes(op="placeholder") if p not in removed])
    # Recomputations first: an offloaded value they read is then waited for before them.
    replaced = _Replaced(bw, sizes)
    _insert_recomputes(bw, plan, activations, received, replaced)
    order = schedule.prefetch_order or tuple(range(len(plan.transfers)))
    for k in order:  # the scheduler's issue order: prefetches at one node go in consumer order
        transfer, place, host = plan.transfers[k], schedule.placements[k], host_inputs[k]
        val = transfer.base.meta["val"]
        dev = _before(bw, place.prefetch_before, PREFETCH,
                      (host, val.device, sizes.of(val.shape), sizes.of(val.stride())))
        dev.meta[TRANSFER_META] = k
        ready = _before(bw, place.wait_before, WAIT, (dev, host))
        for index in transfer.members:
            act = activations[index]
            rebuilt = (_replay(bw, place.wait_before, ready, act) if replayable(act)
                       else sizes.view(place.wait_before, ready, act.val))
            replaced.by(act, rebuilt)
    replaced.erase()
    if schedule.ahead_bytes:
        _insert_ahead(bw, schedule.ahead_before, schedule.ahead_bytes)
    extra = [received[node] for node in _inputs_to_save(plan, interface)]
    _order_inputs(bw, placeholders, interface, plan, host_inputs, extra)


class _Replaced:
    """Saved activations the rewrite moves or recomputes, replaced by what rebuilds them (:meth:`by`);
    each size read off one (``reads_size_only``: the copy is waited for, or the chain recomputed, at
    its first data use, which may come after it) reads the size off an input that stays instead. The
    replaced nodes and their size reads are erased once every copy and chain is placed
    (:meth:`erase`): until then they may be the places other copies are put before."""

    def __init__(self, graph: fx.Graph, sizes: _Sizes) -> None:
        self.graph, self.sizes = graph, sizes
        self.dead: list[fx.Node] = []

    def by(self, act: SavedActivation, rebuilt: fx.Node) -> None:
        reads = [u for u in act.bw_node.users if reads_size_only(u)]
        for read in reads:
            (size,) = self.sizes.of([act.val.shape[read.args[1]]])
            read.replace_all_uses_with(size)
        act.bw_node.replace_all_uses_with(rebuilt, delete_user_cb=lambda user: user not in reads)
        self.dead += [*reads, act.bw_node]

    def erase(self) -> None:
        for node in self.dead:
            self.graph.erase_node(node)
        self.dead = []


def _insert_ahead(bw: fx.Graph, before: fx.Node, nbytes: int) -> None:
    """``prefetch_ahead(after, nbytes)`` before ``before``, reading the last tensor computed ahead of it."""
    after = before.prev
    while not isinstance(after.meta.get("val"), torch.Tensor):
        after = after.prev
    with bw.inserting_before(before):
        bw.call_function(PREFETCH_AHEAD, (after, nbytes)).meta["val"] = after.meta["val"].new_empty((0,))


def _inputs_to_save(plan: Plan, interface: SavedInterface) -> list[fx.Node]:
    """Forward graph inputs a recomputation reads that the forward did not save (parameters, mostly)."""
    saved = set(interface.fw_saved)
    return list(dict.fromkeys(n for r in plan.recomputes for n in r.cost.reads if n not in saved))


def _receive_recompute_inputs(bw: fx.Graph, plan: Plan, interface: SavedInterface,
                              first_input: fx.Node) -> dict[fx.Node, fx.Node]:
    """The backward input of each forward value a recompute chain reads: a saved value's, or a new
    input for a graph input the forward did not save."""
    received = dict(zip(interface.fw_saved, interface.bw_saved))
    for node in _inputs_to_save(plan, interface):
        with bw.inserting_before(first_input):
            received[node] = bw.placeholder(f"{node.name}_for_recompute")
        received[node].meta["val"] = node.meta["val"]
    return received


def _insert_recomputes(bw: fx.Graph, plan: Plan, activations: Sequence[SavedActivation],
                       received: Mapping[fx.Node, fx.Node], replaced: _Replaced) -> None:
    """Copy each recompute chain before its consumer, reading the ``received`` backward inputs and the
    symbolic sizes it reads as ``replaced.sizes`` builds them; its members are rebuilt from it."""
    sizes = replaced.sizes
    for r in plan.recomputes:
        env = {read: received[read] for read in r.cost.reads}
        env.update({size: sizes.of([size.meta["val"]])[0] for size in r.cost.sizes})
        for node in r.cost.chain:
            with bw.inserting_before(r.cost.consumer):
                env[node] = bw.node_copy(node, env.__getitem__)
        for index in r.members:
            act = activations[index]
            rebuilt = (_replay(bw, r.cost.consumer, env[r.base], act) if replayable(act)
                       else sizes.view(r.cost.consumer, env[r.base], act.val))  # a view with symbolic sizes
            replaced.by(act, rebuilt)


def _order_inputs(bw, old_placeholders, interface, plan, host_inputs, extra) -> None:
    """Put backward inputs back in calling-convention order: symints, saved tensors (then the
    graph inputs recomputations read, as the forward returns them), the rest."""
    first_saved = old_placeholders.index(interface.bw_saved[0])
    saved: list[fx.Node] = []
    for decision, node in zip(plan.decisions, interface.bw_saved):
        if decision.recompute is not None:
            continue  # erased: the backward rebuilds it
        if decision.transfer is None:
            saved.append(node)
        elif host_inputs[decision.transfer] not in saved:
            saved.append(host_inputs[decision.transfer])
    rest = old_placeholders[first_saved + len(interface.bw_saved) :]
    desired = old_placeholders[:first_saved] + saved + list(extra) + rest
    first_other = next(n for n in bw.nodes if n.op != "placeholder")
    for node in desired:
        first_other.prepend(node)


def rewrite_pair(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    interface: SavedInterface,
    activations: Sequence[SavedActivation],
    plan: Plan,
    schedule: Schedule,
) -> None:
    """Apply ``plan`` and ``schedule`` to the partitioned pair, in place.

    The graphs are edited and linted; their Python code is not regenerated
    (``module.recompile()``): whoever runs them does that once (the eager inner
    compiler does, Inductor reads the graph).
    """
    if not plan.transfers and not plan.recomputes:
        return
    hosts = _rewrite_forward(fw_module.graph, plan, schedule, interface)
    _rewrite_backward(bw_module.graph, plan, schedule, interface, activations, hosts)
    for module in (fw_module, bw_module):
        module.graph.eliminate_dead_code()
        module.graph.lint()
