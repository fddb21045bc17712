"""Memory model: device bytes over the joint forward/backward timeline.

Inputs: the pair, its ``SavedInterface``, and which graph inputs are earlier graphs' activations.
Outputs: the ``Timeline`` (every storage's ``Lifetime`` on one forward+backward timeline), and the
device-bytes curve and peak under given moves (``intervals``, ``curve``, ``peak``).

Algorithm. The forward's nodes, then the backward's, form one timeline
(position ``i`` is the ``i``-th node of the forward, ``F + j`` the ``j``-th of
the backward). Every storage the graphs create (not graph inputs: parameters,
user inputs, tangents) gets a :class:`Lifetime`: born at the node that
creates it (views and getitems create none, they share their base's storage,
found through fake-tensor storage identity), dead after its last use by any
alias. User outputs live to the end of the forward (and count as activations
there when the caller says so: what the graph hands to the rest of the step,
see ``fxoffload.passes.pipeline.counts_outputs``), gradients to the end of
the step, tangents (made by autograd, including the zeros AOTAutograd
materialises for unused outputs) from the start of the backward to their last
use; a saved tensor (*residual*) lives from its forward birth to its last
backward use. A graph input that is an activation of an earlier compiled graph
of the step (a hidden state passed from one compiled layer to the next, told
by the caller) and that the forward saves is a residual from position 0: the
step holds one per run of the graph. A plan
replaces an offloaded storage's interval with two: the device copy until its
release, and the prefetched copy from its prefetch to its last use; host
buffers are not device memory. Curves are prefix sums of a difference array,
so evaluating a plan costs O(nodes + storages).

Symbolic sizes are kept as sympy expressions in ``Lifetime.expr`` and
evaluated into ``Lifetime.nbytes`` at the largest size the guards allow
(``torch._dynamo.mark_dynamic(t, dim, max=N)``), so that a plan made once
holds for every size its graph serves; unbounded symbols are evaluated at the
traced size, and the planner warns with the numbers.

A fractional budget is the same fraction at every size a graph serves, and
activation bytes are polynomials in the symbols (attention is quadratic), so
the share a plan keeps changes with the size. :func:`size_ranges` gives the
range each symbol is held over: the guards' bounds (``mark_dynamic(...,
min=, max=)``), or, where there is no upper bound, the guards' lower bound up
to ``UNBOUNDED_REACH`` times the traced size. :func:`held_sizes` names the
corners of that range (besides the plan's own size) where the planner holds
the fraction, and :func:`sizes_between` a grid across it to check.

Limits. Device memory as the graphs' own tensors see it: allocator rounding
and fragmentation, workspace buffers and Inductor's buffer reuse and fusion
(which removes intermediates) are not modelled; the eager execution of the
FX graphs is what this predicts.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from .analysis import (
    SavedInterface, aliased_input, is_anchored_compute, symbol_sources, tensor_nbytes, tensor_storage_key,
)

__all__ = ["Lifetime", "Timeline", "build_timeline", "curve", "peak", "concrete", "unbounded_symbols", "plan_sizes",
           "smallest_sizes", "timeline_at", "size_ranges", "input_symbols", "held_sizes", "sizes_between",
           "UNBOUNDED_REACH", "staging_intervals", "step_peak", "Resident", "residents_at", "on_device"]

# Without an upper bound, a fraction is held up to this many times the traced size (automatic
# dynamic shapes trace the second length a run meets: lengths of one dataset stay near it).
UNBOUNDED_REACH = 2
# Sizes :func:`sizes_between` checks along a range wider than this are spaced geometrically.
GRID_POINTS = 64


@dataclass(frozen=True)
class Lifetime:
    index: int  # position in Timeline.lifetimes
    key: int  # fake storage identity (unique within one graph, not across the pair)
    name: str  # node that created it
    nbytes: int  # bytes (symbolic sizes evaluated at their hints)
    expr: Any  # bytes as traced: int, or sympy expression
    birth: int  # first timeline position where it occupies memory
    death: int  # last timeline position where it occupies memory
    residual: bool  # saved by the forward for the backward
    # A user output counted as an activation until the forward returns (``build_timeline``'s
    # ``outputs_counted``): what the graph hands to the rest of the step.
    handed_on: bool = False

    @property
    def activation(self) -> bool:
        """Counted on the activation curve, the one a budget bounds."""
        return self.residual or self.handed_on


@dataclass(frozen=True)
class Timeline:
    fw_nodes: tuple[fx.Node, ...]
    bw_nodes: tuple[fx.Node, ...]
    lifetimes: tuple[Lifetime, ...]
    # Forward inputs that are activations of an earlier graph of the step, saved here: they have
    # lifetimes (from position 0) and are not among the resident graph inputs.
    input_activations: tuple[fx.Node, ...] = ()

    @property
    def length(self) -> int:
        return len(self.fw_nodes) + len(self.bw_nodes)

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return self.fw_nodes + self.bw_nodes

    # Derived once per timeline (cached_property writes the instance dict, which a frozen dataclass allows).
    @functools.cached_property
    def positions(self) -> dict[fx.Node, int]:
        """Timeline position of every node of the pair."""
        return {n: i for i, n in enumerate(self.nodes)}

    @functools.cached_property
    def anchored(self) -> tuple[bool, ...]:
        """Whether each timeline position is an anchored compute op."""
        return tuple(is_anchored_compute(n) for n in self.nodes)

    @functools.cached_property
    def _forward_by_key(self) -> dict[int, Lifetime]:
        forward_end, by_key = len(self.fw_nodes), {}
        for lifetime in self.lifetimes:  # the first forward lifetime of each storage
            if lifetime.birth < forward_end:
                by_key.setdefault(lifetime.key, lifetime)
        return by_key

    def forward_lifetime(self, node: fx.Node) -> Lifetime:
        """The lifetime of the storage a forward node's value lives in."""
        return self._forward_by_key[tensor_storage_key(node.meta["val"])]


def concrete(expr: Any, val: Any = None) -> int:
    """An int for ``expr``: each symbol at the largest value its guards allow when that is finite
    (the compiled graph serves every size up to it), else at the shape environment's hint (the
    traced size; :func:`unbounded_symbols` tells which)."""
    if isinstance(expr, int):
        return expr
    shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
    if shape_env is None:
        return int(expr)
    hints = _hints(shape_env)
    values = {}
    for symbol in expr.free_symbols:
        upper = _largest(shape_env, symbol)
        values[symbol] = upper if upper is not None else hints[symbol]
    return int(expr.xreplace(values))


def _largest(shape_env: Any, symbol: Any) -> int | None:
    """The largest value the guards allow ``symbol``, or None when unbounded."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    upper = getattr(shape_env.var_to_range.get(symbol), "upper", None)
    if upper is None or upper in (int_oo, sympy.oo) or not getattr(upper, "is_Integer", False):
        return None
    return int(upper)


def unbounded_symbols(timeline: "Timeline") -> dict[Any, int]:
    """Symbols of the inputs' sizes whose guards allow any size above the traced one (symbol -> hint)."""
    varying = input_symbols(timeline)
    return {symbol: value for symbol, (value, bounded) in plan_sizes(timeline).items()
            if not bounded and symbol in varying}


def _symbols(timeline: "Timeline") -> set:
    return {symbol for lt in timeline.lifetimes for symbol in getattr(lt.expr, "free_symbols", ())}


def _shape_env(timeline: "Timeline") -> Any:
    val = next((n.meta["val"] for n in timeline.fw_nodes if isinstance(n.meta.get("val"), torch.Tensor)), None)
    return getattr(getattr(val, "fake_mode", None), "shape_env", None)


def plan_sizes(timeline: "Timeline") -> dict[Any, tuple[int, bool]]:
    """Each symbol of the timeline's sizes at the size the plan is made for: (value, bounded), the
    largest the guards allow when bounded, else the traced one (see :func:`concrete`)."""
    shape_env = _shape_env(timeline)
    if shape_env is None:
        return {}
    hints = _hints(shape_env)
    out = {}
    for symbol in sorted(_symbols(timeline), key=str):
        upper = _largest(shape_env, symbol)
        out[symbol] = (upper, True) if upper is not None else (int(hints[symbol]), False)
    return out


def smallest_sizes(timeline: "Timeline") -> dict[Any, int]:
    """Each symbol at the smallest value the guards allow (dynamo's lower bound, 2 unless marked)."""
    shape_env = _shape_env(timeline)
    if shape_env is None:
        return {}
    out = {}
    for symbol in sorted(_symbols(timeline), key=str):
        lower = getattr(shape_env.var_to_range.get(symbol), "lower", None)
        out[symbol] = max(int(lower), 1) if getattr(lower, "is_Integer", False) or isinstance(lower, int) else 1
    return out


def size_ranges(timeline: "Timeline") -> dict[Any, tuple[int, int]]:
    """Each symbol's range of sizes the plan holds a fraction over: (smallest, largest) the guards
    allow, the largest being ``UNBOUNDED_REACH`` times the traced size where unbounded. A symbol
    no graph input carries (the size of a saved generator state) does not vary between calls: its
    range is its traced value."""
    smallest, varying = smallest_sizes(timeline), input_symbols(timeline)
    return {symbol: (smallest[symbol], value if bounded else max(UNBOUNDED_REACH * value, smallest[symbol]))
            if symbol in varying else (value, value)
            for symbol, (value, bounded) in plan_sizes(timeline).items()}


def input_symbols(timeline: "Timeline") -> set:
    """The symbols the forward's inputs carry: a dimension that is the symbol, or a symbolic int."""
    return set(symbol_sources(n for n in timeline.fw_nodes if n.op == "placeholder"))


def held_sizes(timeline: "Timeline") -> list[dict[Any, int]]:
    """Sizes besides the plan's own where a fractional budget is held too: the corners of
    :func:`size_ranges` (every symbol at either end; for more than three symbols, all at their
    smallest and all at their largest), in a stable order."""
    import itertools

    ranges = size_ranges(timeline)
    planned = {symbol: value for symbol, (value, _) in plan_sizes(timeline).items()}
    if len(ranges) > 3:
        corners = [{s: lo for s, (lo, _) in ranges.items()}, {s: hi for s, (_, hi) in ranges.items()}]
    else:
        corners = [dict(zip(ranges, ends)) for ends in itertools.product(*ranges.values())]
    out = []
    for corner in corners:
        if corner != planned and corner not in out:
            out.append(corner)
    return out


def sizes_between(ranges: dict[Any, tuple[int, int]], points: int = GRID_POINTS) -> list[dict[Any, int]]:
    """Sizes across the ranges to check a plan at: every symbol at the same relative place in its
    own range, every integer of the widest range when it has at most ``points``, else ``points``
    spaced geometrically (bytes are polynomials: relative steps matter)."""
    if not ranges:
        return []
    widest = max(hi - lo for lo, hi in ranges.values())
    linear = widest < points
    count = widest + 1 if linear else points
    out = []
    for i in range(count):
        t = i / max(count - 1, 1)
        size = {s: round(lo + (hi - lo) * t) if linear else round(lo * (hi / lo) ** t)
                for s, (lo, hi) in ranges.items()}
        if size not in out:
            out.append(size)
    return out


def timeline_at(timeline: "Timeline", values: dict[Any, int]) -> "Timeline":
    """The timeline with every symbolic size evaluated at ``values`` (symbol -> int)."""
    import dataclasses

    lifetimes = tuple(lt if isinstance(lt.expr, int) else dataclasses.replace(lt, nbytes=int(lt.expr.xreplace(values)))
                      for lt in timeline.lifetimes)
    return dataclasses.replace(timeline, lifetimes=lifetimes)


def _hints(shape_env: Any) -> dict:
    """The traced value of each symbol (``var_to_val`` was renamed ``backed_var_to_val``)."""
    return shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val


def _vals(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in values if isinstance(v, torch.Tensor)]


class _Walker:
    """Collects births and last uses of storages over the joint timeline.

    Storages are told apart by fake-storage identity *within a graph*: the
    partitioner's recomputed copy of a forward node in the backward carries the
    same fake value as the original, but is a new storage. So each graph maps
    fake storages to lifetimes afresh, and only saved tensors carry their
    forward lifetime into the backward.
    """

    def __init__(self) -> None:
        self.keys: dict[fx.Node, list[int]] = {}
        self.birth: list[tuple[int, fx.Node, torch.Tensor, int]] = []  # (position, node, value, storage key)
        self.death: list[int] = []
        self.current: dict[int, int] = {}  # fake storage -> lifetime, in the graph being walked

    def node_keys(self, node: fx.Node) -> list[int]:
        keys = self.keys.get(node)
        if keys is None:
            keys = [tensor_storage_key(v) for v in _vals(node)]
            self.keys[node] = keys
        return keys

    def lifetimes_of(self, node: fx.Node) -> list[int]:
        return [self.current[k] for k in self.node_keys(node) if k in self.current]

    def walk(self, nodes: Iterable[fx.Node], offset: int, carried: dict[int, int]) -> None:
        """Walk one graph; ``carried`` maps fake storages of its inputs to lifetimes born earlier."""
        self.current = dict(carried)
        for i, node in enumerate(nodes, start=offset):
            if node.op in ("placeholder", "output"):
                continue
            for arg in node.all_input_nodes:
                for lifetime in self.lifetimes_of(arg):
                    self.death[lifetime] = i
            if aliased_input(node) is not None:
                continue  # a view: no new storage
            for key, val in zip(self.node_keys(node), _vals(node)):
                if node.target is operator.getitem and key in self.current:
                    continue  # an output of a multi-output op, born there
                # (a getitem of an op without a value, such as the partitioner's
                # run_and_save_rng_state, is where its outputs' storages appear)
                self.current[key] = len(self.birth)
                self.birth.append((i, node, val, key))
                self.death.append(i)


def build_timeline(fw: fx.Graph, bw: fx.Graph, interface: SavedInterface,
                   input_activations: Sequence[fx.Node] = (), outputs_counted: bool = False) -> Timeline:
    """Lifetimes of every storage the pair creates; see the module docstring.

    ``input_activations``: forward placeholders that are activations of an earlier graph of the
    step (a hidden state handed from one compiled layer to the next). Those this pair saves get a
    lifetime from position 0 to their last backward use: the step holds one per run of the graph.
    ``outputs_counted``: the user outputs' storages (but 0-dim ones: a loss) are activations too,
    until the forward returns (the logits a loss graph of its own saves: counted by the graph that
    makes them, not by the one that saves them; see ``fxoffload.passes.pipeline.counts_outputs``).
    """
    fw_nodes, bw_nodes = tuple(fw.nodes), tuple(bw.nodes)
    forward_end, end = len(fw_nodes) - 1, len(fw_nodes) + len(bw_nodes) - 1
    walker = _Walker()
    seeded = _saved_inputs(walker, interface, input_activations)
    held = tuple(dict.fromkeys(walker.birth[lifetime][1] for lifetime in seeded.values()))
    walker.walk(fw_nodes, 0, seeded)
    saved = {lt for n in interface.fw_saved for lt in walker.lifetimes_of(n)}
    # User outputs are held until the forward returns. Past it, what a later graph saves (logits
    # handed to a loss graph) is that graph's input activation, or, under a fraction, counted
    # here until the forward returns (``outputs_counted``).
    handed_on = set()
    for value in interface.user_outputs:
        if isinstance(value, fx.Node):
            for lifetime in walker.lifetimes_of(value):
                walker.death[lifetime] = max(walker.death[lifetime], forward_end)
                # (a 0-dim output is a loss the step returns, not an activation it hands on)
                if outputs_counted and any(v.dim() > 0 for v in _vals(value)):
                    handed_on.add(lifetime)
    # Saved tensors carry their lifetimes by the interface's pairing: a backward
    # placeholder usually shares its forward node's fake value, but not always
    # (the partitioner makes a new one for a saved generator state).
    carried = {
        kb: walker.current[kf]
        for f, b in zip(interface.fw_saved, interface.bw_saved)
        for kf, kb in zip(walker.node_keys(f), walker.node_keys(b))
        if kf in walker.current
    }
    saved_inputs = set(interface.bw_saved)
    for node in bw_nodes:  # tangents: made by autograd as the backward starts
        if node.op == "placeholder" and node not in saved_inputs:
            for key, val in zip(walker.node_keys(node), _vals(node)):
                carried[key] = len(walker.birth)
                walker.birth.append((len(fw_nodes), node, val, key))
                walker.death.append(len(fw_nodes))
    walker.walk(bw_nodes, len(fw_nodes), carried)
    for value in bw.output_node().all_input_nodes:  # gradients outlive the step
        for lifetime in walker.lifetimes_of(value):
            walker.death[lifetime] = end
    lifetimes = []
    for index, ((birth, node, val, key), death) in enumerate(zip(walker.birth, walker.death)):
        expr = tensor_nbytes(val)
        lifetimes.append(Lifetime(index, key, node.name, concrete(expr, val), expr, birth, death, index in saved,
                                  index in handed_on and index not in saved))
    return Timeline(fw_nodes, bw_nodes, tuple(lifetimes), held)


def _saved_inputs(walker: _Walker, interface: SavedInterface, inputs: Sequence[fx.Node]) -> dict[int, int]:
    """Lifetimes, born at position 0, of the storages of ``inputs`` that the forward saves."""
    saved = {k for n in interface.fw_saved for k in walker.node_keys(n)}
    seeded: dict[int, int] = {}
    for node in inputs:
        for key, val in zip(walker.node_keys(node), _vals(node)):
            if key in saved and key not in seeded:
                seeded[key] = len(walker.birth)
                walker.birth.append((0, node, val, key))
                walker.death.append(0)
    return seeded


def curve(
    length: int,
    intervals: Iterable[tuple[int, int, int]],
) -> list[int]:
    """Bytes live at each position, from (start, end inclusive, bytes) intervals."""
    delta = [0] * (length + 1)
    for start, end, nbytes in intervals:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    out, running = [], 0
    for d in delta[:-1]:
        running += d
        out.append(running)
    return out


def peak(values: Sequence[int]) -> int:
    return max(values, default=0)


def step_peak(activations: Sequence[int], forward: int, runs: int) -> int:
    """The step's activation peak when a graph with this activation curve runs ``runs`` times."""
    if not activations:
        return 0
    return max(activations) + (runs - 1) * activations[forward - 1]


def staging_intervals(offload: int, release: int, prefetch: int, wait: int,
                      nbytes: int) -> list[tuple[int, int, int]]:
    """Device intervals of a staged transfer's contiguous buffers (an engine that stages copies
    makes one for a non-contiguous tensor at each end): from the node its offload follows to its
    release, and from its prefetch to the node before its wait. Both are upper bounds: the first
    buffer does not exist yet at the node its offload follows, and a wait right after its prefetch
    frees the second before the consumer, where it is counted."""
    if not nbytes:
        return []
    return [(offload, release, nbytes), (prefetch, max(prefetch, wait - 1), nbytes)]


def intervals(
    timeline: Timeline,
    moved: dict[int, tuple[int, int]],
    residual_only: bool,
    temporaries: Sequence[tuple[int, int, int]] = (),
) -> list[tuple[int, int, int]]:
    """Device intervals of the timeline's storages under a plan.

    ``moved`` maps an offloaded (or recomputed) storage's lifetime index to
    (release position, prefetch or rebuild position): its device copy lives
    until the release, its returned copy from then to its last use.
    ``residual_only``: the activation curve (:attr:`Lifetime.activation`), else every storage.
    ``temporaries`` (recompute chains' other outputs) count in the total only:
    they are not activations.
    """
    out = [] if residual_only else list(temporaries)
    for lt in timeline.lifetimes:
        if lt.activation or not residual_only:
            out += on_device(lt, moved)
    return out


def on_device(lt: Lifetime, moved: dict[int, tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The intervals (start, end inclusive, bytes) in which one storage is on the device under ``moved``
    (see :func:`intervals`): its whole life, or until its release and again from its return."""
    if lt.index not in moved:
        return [(lt.birth, lt.death, lt.nbytes)]
    release, back = moved[lt.index]
    return [(lt.birth, release, lt.nbytes), (back, lt.death, lt.nbytes)]


@dataclass(frozen=True)
class Resident:
    """An activation on the device at one position of the timeline under a plan."""

    lifetime: int  # index in Timeline.lifetimes
    name: str
    nbytes: int


def residents_at(timeline: Timeline, moved: dict[int, tuple[int, int]], position: int) -> tuple[Resident, ...]:
    """The activations on the device at ``position`` under ``moved`` (as :func:`intervals` reads it),
    largest first: what makes up the activation curve there."""
    found = [Resident(lt.index, lt.name, lt.nbytes) for lt in timeline.lifetimes
             if lt.activation and any(start <= position <= end for start, end, _ in on_device(lt, moved))]
    return tuple(sorted(found, key=lambda r: (-r.nbytes, r.lifetime)))
