"""The solver's formulation: a plan's choice as intervals over the timeline, for ``fxoffload.passes.solvers``.

Inputs: a :class:`Problem` (the timeline, each candidate's moves, costs, recompute chain and marks, the
plan options), the free candidates and the forced ones (MUST_CPU_OFFLOAD).
Outputs: solver items (one per candidate: its options, each an ``Option`` of memory changes, a cost,
copy-engine work and host bytes; :func:`solver_items`), the fixed intervals every choice holds
(:func:`fixed_intervals`), and the parts at several sizes stacked into one problem (:func:`stacked`).

Algorithm. Every activation is an interval (birth, death, bytes) on the forward+backward timeline
(``fxoffload.passes.memory``). A candidate's interval is fixed; each of its options subtracts bytes over
the positions where it is off the device (an offload: after its release until its prefetch; a
recompute: after its last forward use until its rebuild), and adds what it makes there (a recompute
chain's temporaries, a staging engine's buffers, under a device budget). Over ``runs`` runs of the
graph, what a run leaves at the forward's end counts ``runs - 1`` more times everywhere
(:func:`over_runs`). Copies are priced by their stall alone (or, under ``queued``, as work on the
copy-engine queues, :func:`_queues`), plus a small weight on copy time; the host thread's op calls
are one more queue when they can be late (:func:`_host_queue`). A recomputation reading a saved
value conflicts with recomputing it, or with waiting for it after the rebuild (:func:`conflicts_of`).

Limits: positions are the timeline's, not time: a prefetch placed by the scheduler later than its
candidate placement is not re-priced here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.fx as fx

from .analysis import tensor_nbytes
from .candidates import RecomputeCost, TransferCost
from .memory import Timeline, curve, device_peak_of_runs, intervals, peak, staging_intervals, step_peak
from .sizes import concrete
from .plan import (
    AUTO_STRATEGY, OFFLOAD, RECOMPUTE, Ineligible, PlanOptions, pinned_block, staging_bytes,
)
from .policies import PREFER_CPU_OFFLOAD, PREFER_SAVE
from .solvers import Option, Queue

__all__ = ["Formulation", "Owner", "Part", "Problem", "conflicts_of", "first_options", "first_run_backward",
           "fixed_intervals",
           "graph_input_bytes", "over_runs", "solver_items", "split_choice", "stacked", "staging_spans"]

COPY_WEIGHT = 1e-3  # weight of hidden copy time next to stall time in the objective
PREFER_SAVE_PENALTY = 10.0  # a PREFER_SAVE candidate costs this many times the costliest other one more


class Owner(NamedTuple):
    """The candidate a solver item decides, and the kind of each of its options (offload, recompute)."""

    base: fx.Node
    kinds: tuple[str, ...]


class Formulation(NamedTuple):
    """One solver problem's items, their owners (same order), the copy-engine queues and the conflicts
    (pairs of (item, option) that may not both be chosen)."""

    items: list[tuple[Option, ...]]
    owners: list[Owner]
    queues: list[Queue]
    conflicts: list[tuple[tuple[int, int], tuple[int, int]]]


class Part(NamedTuple):
    """The fixed intervals (start, end inclusive, bytes) every choice holds, and the items over them; at
    another size than the plan's, ``lift``: the plan's budget less the budget at that size."""

    base: list[tuple[int, int, int]]
    items: list[tuple[Option, ...]]
    lift: int = 0


@dataclass(frozen=True)
class Problem:
    """What the planner knows about the candidates, in timeline positions."""

    timeline: Timeline
    moves: Mapping[fx.Node, tuple[int, int]]  # offloaded: (release, prefetch)
    costs: Mapping[fx.Node, TransferCost]
    recomputes: Mapping[fx.Node, RecomputeCost]  # the recomputable candidates
    first_use: Mapping[fx.Node, int]  # first backward consumer of each group
    marks: Mapping[fx.Node, frozenset[str]]
    options: PlanOptions
    queued: bool  # model the copy engines as queues (prefetches placed freely, horizon "auto")
    reasons: Mapping[fx.Node, Ineligible | None] = dataclasses.field(default_factory=dict)  # why_kept's, by base

    def lifetime(self, base: fx.Node):
        return self.timeline.forward_lifetime(base)

    def host(self, base: fx.Node) -> int:
        """Pinned host bytes offloading ``base`` takes over the step's runs."""
        return pinned_block(self.lifetime(base).nbytes) * self.options.runs

    def host_left(self, forced: Sequence[fx.Node]) -> int | None:
        """Pinned host bytes the free candidates may take: the host budget less the forced copies'."""
        cap = self.options.host_bytes
        return None if cap is None else max(cap - sum(self.host(b) for b in forced), 0)

    def rebuilt_at(self, base: fx.Node) -> int:
        return self.timeline.positions[self.recomputes[base].consumer]

    def moved(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> dict[int, tuple[int, int]]:
        out = {self.lifetime(b).index: self.moves[b] for b in offloaded}
        out.update({self.lifetime(b).index: (self.moves[b][0], self.rebuilt_at(b)) for b in recomputed})
        return out

    def peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node], residual_only: bool) -> int:
        return peak(self.curve(offloaded, recomputed, residual_only))

    def curve(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node], residual_only: bool) -> list[int]:
        temporaries = [(self.rebuilt_at(b), self.rebuilt_at(b), self.recomputes[b].transient) for b in recomputed]
        spans = intervals(self.timeline, self.moved(offloaded, recomputed), residual_only, temporaries)
        return curve(self.timeline.length, spans)

    @property
    def device(self) -> bool:
        """Whether the budget bounds the device peak (every tensor) rather than saved activations."""
        return self.options.device_bytes is not None

    def device_peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node], backward_extra: int = 0) -> int:
        """The step's total peak over its runs (each run on top of what earlier runs hold, the first run's
        backward on top of the others' gradients: ``memory.device_peak_of_runs``), inputs excluded."""
        forward = len(self.timeline.fw_nodes)
        held = self.curve(offloaded, recomputed, True)[forward - 1]
        return device_peak_of_runs(self.curve(offloaded, recomputed, False), forward, held, self.options.runs,
                                   self.options.run_gradients, backward_extra)

    def held(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """What the step's ``runs`` runs leave on the device for their backward."""
        activations = self.curve(offloaded, recomputed, True)
        return self.options.runs * activations[len(self.timeline.fw_nodes) - 1] if activations else 0

    def bounded_peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """The peak the budget bounds: the device peak's step tensors, or the step's activation peak."""
        if self.device:  # with the gradients other graphs left, which its backward runs on top of
            return self.device_peak(offloaded, recomputed, self.options.backward_gradients)
        return self.step_peak(offloaded, recomputed)

    def step_peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """Activation peak of the step's ``runs`` runs: the last run's curve on top of what the
        earlier runs hold for their backward (the curve at the forward's end, each)."""
        activations = self.curve(offloaded, recomputed, True)
        return step_peak(activations, len(self.timeline.fw_nodes), self.options.runs)


def graph_input_bytes(timeline: Timeline) -> int:
    """Bytes of the forward graph's tensor inputs (parameters, buffers, batch): resident all step.
    Inputs that are an earlier graph's activations, saved here, have lifetimes instead."""
    held = set(timeline.input_activations)
    vals = [n.meta.get("val") for n in timeline.fw_nodes if n.op == "placeholder" and n not in held]
    return sum(concrete(tensor_nbytes(v), v) for v in vals if isinstance(v, torch.Tensor))


def over_runs(spans: Sequence[tuple[int, int, int]], forward: int, length: int,
              runs: int) -> list[tuple[int, int, int]]:
    """Intervals whose curve is the step's for ``runs`` runs: each interval alive at the forward's
    end (what a run leaves for its backward) also counts ``runs - 1`` times at every position."""
    if runs == 1:
        return list(spans)
    held = [(0, length - 1, (runs - 1) * b) for start, end, b in spans if start <= forward - 1 <= end]
    return list(spans) + held


def _saving(release: int, until: int, nbytes: int) -> tuple[tuple[int, int, int], ...]:
    return ((release + 1, until - 1, -nbytes),) if release + 1 <= until - 1 else ()


def _queues(problem: Problem, offloadable: Sequence[fx.Node], forced: Sequence[fx.Node]):
    """Copy-engine slots of every offloadable base, and the engines' capacities net of forced copies.

    Offloads: slots from the forward's end backwards (latest born first), each with the compute
    after its birth. Prefetches: slots by consumer, each with the backward's compute before it.
    """
    costs, pos = problem.costs, problem.timeline.positions
    everything = list(offloadable) + list(forced)
    down = sorted(everything, key=lambda b: -pos[b])
    up = sorted(everything, key=lambda b: problem.first_use[b])
    down_at, up_at = _first_places(down), _first_places(up)
    slots = {b: (down_at[b], up_at[b]) for b in everything}
    capacity = []
    for order, window, seconds in ((down, "forward_window", "d2h"), (up, "backward_window", "h2d")):
        taken, caps = 0.0, []
        for b in order:
            taken += getattr(costs[b], seconds) if b in forced else 0.0
            caps.append(getattr(costs[b], window) - taken)
        capacity.append(Queue(tuple(caps)))
    return slots, capacity


def _first_places(order: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """Each node's first place in ``order`` (what ``order.index`` gives, without its search)."""
    places: dict[fx.Node, int] = {}
    for place, node in enumerate(order):
        places.setdefault(node, place)
    return places


def _host_queue(problem: Problem, offloadable: Sequence[fx.Node], forced: Sequence[fx.Node]):
    """The host thread as one more queue: each transfer's op calls, half in the forward (at its offload)
    and half in the backward (at its consumer), must be issued before the device gets there, or the
    device waits. Slots by the device time they are needed at; capacity, that time less the forced
    transfers' calls up to it. None when op calls cost nothing, or are hidden whatever is chosen."""
    costs, everything, made = problem.costs, list(offloadable) + list(forced), set(forced)
    if not any(costs[b].host for b in everything):
        return {}, None
    calls = sorted((t, phase, k) for k, b in enumerate(everything)
                   for phase, t in enumerate((costs[b].issued_at, costs[b].needed_at)))
    slots: dict[tuple[fx.Node, int], int] = {}
    taken = every = late = 0.0
    caps = []
    for slot, (t, phase, k) in enumerate(calls):
        slots[everything[k], phase] = slot
        taken += costs[everything[k]].host / 2 if everything[k] in made else 0.0
        every += costs[everything[k]].host / 2
        caps.append(t - taken)
        late = max(late, every - t)
    # Hidden even with every candidate offloaded (a large model): no choice can make the host late,
    # and the queue would only slow the solver.
    return (slots, Queue(tuple(caps))) if late > 0 else ({}, None)


def solver_items(problem: Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node]) -> Formulation:
    """Solver items (offload listed first: it needs the least memory), their owners and conflicts."""
    strategy, costs, marks = problem.options.strategy, problem.costs, problem.marks
    offloadable = list(free) if strategy in (OFFLOAD, AUTO_STRATEGY) else []
    recomputable = [b for b in free if b in problem.recomputes] if strategy in (RECOMPUTE, AUTO_STRATEGY) else []
    slots, queues = _queues(problem, offloadable, forced) if problem.queued else ({}, [])
    host_slots, host_queue = _host_queue(problem, offloadable, forced)
    raw: dict[tuple[fx.Node, str], tuple[float, tuple]] = {}
    for b in offloadable:
        c = costs[b]
        stall = 0.0 if problem.queued else c.stall
        work = ((0, slots[b][0], c.d2h), (1, slots[b][1], c.h2d)) if problem.queued else ()
        if host_queue is not None:
            work += tuple((len(queues), host_slots[b, phase], c.host / 2) for phase in (0, 1))
        raw[b, OFFLOAD] = (stall + c.staging + COPY_WEIGHT * (c.d2h + c.h2d), work)
    if host_queue is not None:
        queues = [*queues, host_queue]
    for b in recomputable:
        raw[b, RECOMPUTE] = (problem.recomputes[b].seconds, ())
    scale = max((cost + sum(w[2] for w in work) for cost, work in raw.values()), default=0.0) or 1e-6
    items, owners = [], []
    for b in free:
        kinds = [k for k in (OFFLOAD, RECOMPUTE) if (b, k) in raw]
        if not kinds:
            continue
        options = []
        for kind in kinds:
            cost, work = raw[b, kind]
            if kind == OFFLOAD and PREFER_CPU_OFFLOAD in marks[b]:
                cost = 0.0
            elif PREFER_SAVE in marks[b] or PREFER_CPU_OFFLOAD in marks[b]:  # recomputing overrides the hint
                cost += PREFER_SAVE_PENALTY * scale
            release, prefetch = problem.moves[b]
            until = prefetch if kind == OFFLOAD else problem.rebuilt_at(b)
            changes = _saving(release, until, problem.lifetime(b).nbytes)
            if kind == RECOMPUTE and problem.device and problem.recomputes[b].transient:
                at = problem.rebuilt_at(b)  # the chain's temporaries beyond its base and consumer's outputs
                changes += ((at, at, problem.recomputes[b].transient),)
            if kind == OFFLOAD and problem.device:  # a staging engine's contiguous buffers
                changes += tuple(staging_spans(problem, b))
            options.append(Option(changes, cost, work, problem.host(b) if kind == OFFLOAD else 0))
        items.append(tuple(options))
        owners.append(Owner(b, tuple(kinds)))
    return Formulation(items, owners, queues, conflicts_of(problem, owners))


def staging_spans(problem: Problem, b: fx.Node) -> list[tuple[int, int, int]]:
    """The staging buffers of offloading ``b`` (``plan.staging_bytes``), at its candidate placement."""
    release, prefetch = problem.moves[b]
    return staging_intervals(problem.lifetime(b).birth, release, prefetch, problem.first_use[b],
                             staging_bytes(b, problem.options))


def conflicts_of(problem: Problem, owners: Sequence[Owner]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A recomputation reads saved values: those may not be recomputed too, nor waited for after it."""
    where = {(b, kind): (i, o) for i, (b, kinds) in enumerate(owners) for o, kind in enumerate(kinds)}
    out = []
    for b, kinds in owners:
        if RECOMPUTE not in kinds:
            continue
        for g in problem.recomputes[b].read_bases:
            if (g, RECOMPUTE) in where and g is not b:
                out.append((where[b, RECOMPUTE], where[g, RECOMPUTE]))
            if (g, OFFLOAD) in where and problem.first_use[g] >= problem.rebuilt_at(b):
                out.append((where[b, RECOMPUTE], where[g, OFFLOAD]))
    return out


def first_options(items: Sequence[tuple[Option, ...]], conflicts) -> list[tuple[int, int]]:
    """Each item's first option that does not conflict with one already taken."""
    clash = {frozenset(c) for c in conflicts}
    taken: list[tuple[int, int]] = []
    for i, options in enumerate(items):
        for o in range(len(options)):
            if not any(frozenset(((i, o), t)) in clash for t in taken):
                taken.append((i, o))
                break
    return taken


def split_choice(owners: Sequence[Owner], chosen) -> tuple[tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    """The bases a choice (item, option) pairs offloads, and those it recomputes."""
    picked = [(owners[i].base, owners[i].kinds[o]) for i, o in chosen]
    return tuple(b for b, k in picked if k == OFFLOAD), tuple(b for b, k in picked if k == RECOMPUTE)


def fixed_intervals(problem: Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], items) -> Part:
    """The solver's fixed intervals (``base``) and per-option changes, over the step's runs."""
    timeline, options = problem.timeline, problem.options
    planned = {problem.lifetime(b).index for b in (*free, *forced)}
    base = [(lt.birth, lt.death, lt.nbytes) for lt in timeline.lifetimes if lt.activation and lt.index not in planned]
    for b in forced:  # their offloaded intervals hold memory whatever is chosen
        lt, (release, prefetch) = problem.lifetime(b), problem.moves[b]
        base += [(lt.birth, release, lt.nbytes), (prefetch, lt.death, lt.nbytes)]
    base += [(problem.lifetime(b).birth, problem.lifetime(b).death, problem.lifetime(b).nbytes) for b in free]
    if options.runs > 1:  # bound the step: what the earlier runs hold is added at every position
        forward, length = len(timeline.fw_nodes), timeline.length
        base = over_runs(base, forward, length, options.runs)
        items = [tuple(dataclasses.replace(o, changes=tuple(over_runs(o.changes, forward, length, options.runs)))
                       for o in item) for item in items]
    # A device budget bounds every tensor the step creates, not only saved ones: also staged copies'
    # buffers (``PlanOptions.staging_devices``), at the candidates' placements.
    if problem.device:
        base += [(lt.birth, lt.death, lt.nbytes) for lt in timeline.lifetimes if not lt.activation]
        base += [interval for b in forced for interval in staging_spans(problem, b)]
        if options.backward_gradients:  # what the later regions' backwards left, under this one's backward
            base.append((len(timeline.fw_nodes), timeline.length - 1, options.backward_gradients))
    return Part(base, items)


def first_run_backward(problem: Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], items) -> Part | None:
    """Under a device budget over several runs whose backwards leave gradients (``run_gradients``): one
    run's curve with the other runs' gradients under its backward, the first run's backward as it runs
    (``memory.device_peak_of_runs``); ``items`` with one run's changes. None where there is no such term."""
    options = problem.options
    if not problem.device or options.runs < 2 or not options.run_gradients:
        return None
    one_run = dataclasses.replace(problem, options=dataclasses.replace(options, runs=1))
    part = fixed_intervals(one_run, free, forced, items)
    forward, length = len(problem.timeline.fw_nodes), problem.timeline.length
    return part._replace(base=part.base + [(forward, length - 1, (options.runs - 1) * options.run_gradients)])


def stacked(length: int, parts: Sequence[Part]) -> Part:
    """One solver problem for the same choice at several sizes (``parts``, one per size): part ``m``'s
    positions shift by ``m * length``, and its fixed intervals rise by its lift (the plan's budget less the
    part's own), so that one budget bounds every part."""
    base: list = []
    items: list | None = None
    for m, (part_base, part_items, lift) in enumerate(parts):
        offset = m * length

        def shift(spans):
            return tuple((a + offset, b + offset, n) for a, b, n in spans)

        base += shift(part_base)
        if lift:
            base.append((offset, offset + length - 1, lift))
        if items is None:
            items = [list(item) for item in part_items]
            continue
        for item, part_item in zip(items, part_items):
            item[:] = [dataclasses.replace(o, changes=o.changes + shift(p.changes)) for o, p in zip(item, part_item)]
    return Part(base, [tuple(item) for item in items or ()])
