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
use (to the backward's end on torch releases whose runtime holds them there:
``TANGENTS_HELD_TO_BACKWARD_END``); a saved tensor (*residual*) lives from its forward birth to its last
backward use. A graph input that is an activation of an earlier compiled graph
of the step (a hidden state passed from one compiled layer to the next, told
by the caller) and that the forward saves is a residual from position 0: the
step holds one per run of the graph. A plan
replaces an offloaded storage's interval with two: the device copy until its
release, and the prefetched copy from its prefetch to its last use; host
buffers are not device memory. Curves are prefix sums of a difference array,
so evaluating a plan costs O(nodes + storages).

Symbolic sizes are kept as sympy expressions in ``Lifetime.expr`` and
evaluated into ``Lifetime.nbytes`` by ``fxoffload.passes.sizes.concrete``
(the sizes the guards allow, and where a plan holds a fraction, are there).

Limits. Device memory as the graphs' own tensors see it: allocator rounding
and fragmentation, workspace buffers and Inductor's buffer reuse and fusion
(which removes intermediates) are not modelled; the eager execution of the
FX graphs is what this predicts.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from .analysis import SavedInterface, aliased_input, is_anchored_compute, tensor_nbytes, tensor_storage_key
from .sizes import concrete

__all__ = ["Lifetime", "Timeline", "build_timeline", "curve", "device_peak_of_runs", "peak", "staging_intervals",
           "step_peak", "Resident",
           "residents_at", "on_device"]

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

    @functools.cached_property
    def _spans(self) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]]:
        every = tuple((lt.birth, lt.death, lt.nbytes) for lt in self.lifetimes)
        return tuple(span for span, lt in zip(every, self.lifetimes) if lt.activation), every

    def spans(self, residual_only: bool) -> tuple[tuple[int, int, int], ...]:
        """(birth, death, bytes) of every storage, or of the activations only, as if nothing moved."""
        return self._spans[0 if residual_only else 1]

    @functools.cached_property
    def _forward_by_node(self) -> dict[fx.Node, Lifetime]:
        return {}

    def forward_lifetime(self, node: fx.Node) -> Lifetime:
        """The lifetime of the storage a forward node's value lives in (found once per node: the planner
        asks for each candidate's at every choice it weighs)."""
        found = self._forward_by_node.get(node)
        if found is None:
            found = self._forward_by_node[node] = self._forward_by_key[tensor_storage_key(node.meta["val"])]
        return found


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


# Whether AOTAutograd's backward holds the tangents autograd hands it until it returns. On torch 2.11
# its ``backward(ctx, *flat_args)`` keeps them to the end; on 2.13 and 2.14 each is freed at its last
# use (measured on 2026-12-02: a tiny Llama's layer graph, its incoming gradient held through the
# attention's backward on 2.11 only; ``tests/test_layer_step.py``). 2.12 is not measured and is taken
# as 2.11: the longer lifetime can only over-predict.
TANGENTS_HELD_TO_BACKWARD_END = torch.__version__ < (2, 13)


def build_timeline(fw: fx.Graph, bw: fx.Graph, interface: SavedInterface,
                   input_activations: Sequence[fx.Node] = (), outputs_counted: bool = False,
                   tangents_held: bool = TANGENTS_HELD_TO_BACKWARD_END) -> Timeline:
    """Lifetimes of every storage the pair creates; see the module docstring.

    ``input_activations``: forward placeholders that are activations of an earlier graph of the
    step (a hidden state handed from one compiled layer to the next). Those this pair saves get a
    lifetime from position 0 to their last backward use: the step holds one per run of the graph.
    ``outputs_counted``: the user outputs' storages (but 0-dim ones: a loss) are activations too,
    until the forward returns (the logits a loss graph of its own saves: counted by the graph that
    makes them, not by the one that saves them; see ``fxoffload.passes.pipeline.counts_outputs``).
    ``tangents_held``: the tangents live to the backward's end, not to their last use (the torch
    release's runtime decides; see TANGENTS_HELD_TO_BACKWARD_END).
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
    tangents = []
    for node in bw_nodes:  # tangents: made by autograd as the backward starts
        if node.op == "placeholder" and node not in saved_inputs:
            for key, val in zip(walker.node_keys(node), _vals(node)):
                carried[key] = len(walker.birth)
                tangents.append(len(walker.birth))
                walker.birth.append((len(fw_nodes), node, val, key))
                walker.death.append(len(fw_nodes))
    walker.walk(bw_nodes, len(fw_nodes), carried)
    if tangents_held:
        for lifetime in tangents:
            walker.death[lifetime] = end
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
    """Bytes live at each position, from (start, end inclusive, bytes) intervals. The running sum is
    ``itertools.accumulate``'s (exact for any numbers, at C speed): the planner draws a curve per
    choice it weighs, each as long as the pair's graphs."""
    delta = [0] * (length + 1)
    for start, end, nbytes in intervals:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    delta.pop()
    return list(itertools.accumulate(delta))


def peak(values: Sequence[int]) -> int:
    return max(values, default=0)


def step_peak(activations: Sequence[int], forward: int, runs: int) -> int:
    """The step's activation peak when a graph with this activation curve runs ``runs`` times."""
    if not activations:
        return 0
    return max(activations) + (runs - 1) * activations[forward - 1]


def device_peak_of_runs(total: Sequence[int], forward: int, held: int, runs: int, run_gradients: int = 0,
                        backward_extra: int = 0) -> int:
    """The device peak of ``runs`` runs of a graph whose one-run curve of every tensor it creates is ``total``
    and which leaves ``held`` for its backward each run: the last run's forward and backward run on top of
    what the others hold, the first run's backward on top of the gradients the others' backwards left
    (``run_gradients`` each), and every backward on top of ``backward_extra`` (gradients other graphs left)."""
    if not total:
        return 0
    others = (runs - 1) * held
    forward_peak = max(total[:forward], default=0) + others
    backward_peak = max(total[forward:], default=0) + max(others, (runs - 1) * run_gradients) + backward_extra
    return max(forward_peak, backward_peak)


def staging_intervals(offload: int, release: int, prefetch: int, wait: int,
                      nbytes: int) -> list[tuple[int, int, int]]:
    """Device intervals of a staged transfer's contiguous buffers (an engine that stages copies
    makes one for a tensor whose layout fills no one block of memory at each end): from the node its
    offload follows to its release, and from its prefetch to the node before its wait. Both are upper bounds: the first
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
    ``temporaries`` (recompute chains' temporaries beyond their base and consumer's outputs) count in the total only:
    they are not activations.
    """
    out = [] if residual_only else list(temporaries)
    out += timeline.spans(residual_only)
    lifetimes = timeline.lifetimes
    for index in moved:  # a moved storage: its whole life out, its time on the device in
        lt = lifetimes[index] if 0 <= index < len(lifetimes) else None
        if lt is not None and (lt.activation or not residual_only):
            out.append((lt.birth, lt.death, -lt.nbytes))
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
