"""Planning: decide, for every saved activation, whether to keep, offload or recompute it.

Inputs: the saved activations, the ``Timeline``, each candidate's moves and costs
(``fxoffload.passes.candidates``), ``PlanOptions`` and the user's marks (``fxoffload.passes.policies``).
Outputs: a ``Plan`` (``fxoffload.passes.plan``), an immutable value: one ``Decision`` per saved
activation with its reason, the transfers and recompute chains, the predicted peaks.

Algorithm. Saved tensors are grouped by the storage they live in (their
*base*, see ``fxoffload.passes.analysis``): a view is never moved on its own; its base
is offloaded (or recomputed) once and the view is rebuilt on the device after
it. ``fxoffload.passes.eligibility.why_kept`` says why a group must stay (one rule per early return);
the rest are candidates. Graph inputs stay, but for those an earlier compiled
graph of the step made (``Timeline.input_activations``: the input of a layer
compiled on its own, all a checkpointed layer saves), which are candidates for
offloading like the graph's own activations (never recomputed: no chain makes them).

* Options per candidate (``strategy``): *offload* (device copy until its
  release, prefetched copy from its prefetch to its last use, at the positions
  the scheduler would give it) and *recompute* (freed at its last forward use;
  its chain of forward ops, found by ``fxoffload.passes.analysis.recompute_chain`` from
  saved values and graph inputs, runs again right before its first backward
  consumer, and the storage lives from there to its last use). A recomputed
  storage counts as activation memory from its rebuild on, like a prefetched
  copy; the chain's temporaries count towards the total only, and so do
  a staged offload's buffers (``PlanOptions.staging_devices``: the CUDA engine
  copies a tensor whose layout fills no one block of memory through a contiguous
  device buffer at each end, ``plan.staging_bytes``), which a device budget prices.
* Without a budget, the budget is the smallest activation peak that acting
  on every candidate reaches (offloading it; under ``"recompute"``,
  recomputing every recomputable one), plus ``min_bytes``: the cheapest
  choice within a storage worth a copy of that peak. A tensor whose move
  cannot lower the peak (logits read as the backward starts) stays.
  ``all_eligible`` acts on every candidate instead, as naive offloading does
  (PREFER_SAVE ones stay).
* With a budget (bytes, or a fraction of the activation peak without
  offloading), the activation curve of ``fxoffload.passes.memory`` and each option's
  saving are handed to ``fxoffload.passes.solvers`` as plain intervals. The objective is
  predicted step time: a recomputation costs its chain's compute time (from
  ``fxoffload.passes.cost_model``); copies are work on the copy engines, priced by the
  solvers' queue lateness under horizon ``"auto"`` (where prefetches may start
  anywhere in the backward), else by the stall each copy alone would cause;
  plus a small weight on all copy time so that no copy is made for nothing.
  A transfer's op calls are work on one more queue, the host thread (half at
  its offload, half at its consumer, each due when the device gets there):
  they cost only where the host would fall behind the device, and the queue
  is left out where it cannot, even with every candidate offloaded.
  A recomputation reads saved values: those may not be recomputed too, nor
  offloaded unless they are waited for before it (conflicts for the solver).
* Selective-checkpoint marks (``fxoffload.passes.policies``): ``MUST_SAVE`` keeps a
  storage; ``MUST_CPU_OFFLOAD`` offloads it whatever the budget and
  ``min_bytes`` (its offloaded intervals are fixed memory for the solver);
  ``PREFER_CPU_OFFLOAD`` makes its offload cost nothing and its
  recomputation, like any option of a ``PREFER_SAVE`` one, dearer than any
  unmarked option, so the budget takes them first and last.
  Every reason names the mark it honours or overrides.
* Under symbolic sizes, a fractional budget is held at the plan's size and at
  the other sizes of ``fxoffload.passes.sizes.held_sizes`` (the other end of the range
  the graph serves), each against the fraction of its own unoffloaded peak:
  the solver gets one timeline per size laid end to end, each size's fixed
  memory raised by the plan's budget less its own, so that one budget bounds
  them all (``formulation.stacked``). The plan records each size's budget and peaks
  (``Plan.sizes``); the scheduler keeps them too.
* A host budget (``PlanOptions.host_bytes``) bounds the pinned host bytes of
  the copies over the step's runs (each copy in its power-of-two block,
  ``plan.pinned_block``): a knapsack row for the solvers, first fit in birth
  order under ``all_eligible``; without a memory budget, the smallest peak
  within it is greedy's lowest, found by bisection on the budget
  (:func:`_reachable`). MUST_CPU_OFFLOAD copies count first; a kept
  candidate that did not fit says so.
* Under ``max_overhead`` without a budget, the driver (``fxoffload.passes.pipeline``) finds the
  lowest peak whose plan's simulated overhead is within it and hands it in (``peak_within``: a
  :class:`PeakWithin`): the budget is that peak, and a candidate the smallest peak moves but this plan
  keeps says so (``Why.OVERHEAD``). The smallest peak and the cheapest choice that reaches it are the
  same for every peak the driver tries on one pair: found once, by the first plan that needs them.
  Under solver "auto" each such plan's solve accepts an answer within ``PROBE_GAP`` (5%) of its LP
  bound, not 1%: the driver judges a probe by its simulated step, not by the solver's price, and on
  the 7B graph's `+1%` plan branch and bound spent 1.6-3.4 s per probe near the answer up to its node
  limit; of five such probes solved again, it left three at the cost their root node found and
  lowered the others' by 0.1% and 0.4%.
* A held cap (``PlanOptions.held_cap``, a region's share of a step's budget) bounds what the
  runs leave for the backward: the budget at the forward's end, a fixed interval there that
  fills the difference (:func:`_held_cap_at`).
* If no choice meets the budget, ``on_infeasible`` decides: ``"error"``
  raises ``plan.BudgetInfeasibleError`` with the smallest achievable peak;
  ``"warn"`` plans the cheapest choice at that smallest peak and says so. Both
  give the least the runs can leave for the backward (every candidate moved,
  which reaches that peak too: ``Plan.held_least``, the error's ``least_held``),
  and under a held cap the choice leaves no more than the cap, or that least
  where it is more. Where the budget holds but the cap cannot, the error names
  the cap (``"held_cap: ..."``) and ``"warn"`` plans within the budget at that least.

The result is an immutable ``Plan``; nothing here edits a graph.
Limits: queue lateness lets a prefetch start wherever compute allows,
ignoring the memory it then holds (the schedule's stall is the prediction);
chains with random ops are not recomputed (their generator state is not
saved); symbolic sizes are evaluated at the largest size the guards allow, or
the traced one (``fxoffload.passes.sizes.concrete``), and offloaded when the backward can
compute them (``eligibility.backward_symbols``), never recomputed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.fx as fx

from .analysis import SavedActivation, SavedInterface, input_position, is_compute, output_storages
from .candidates import RecomputeCost, TransferCost
from .eligibility import INPUT_ACTIVATION, backward_symbols, group_by_base, group_marks, why_kept
from .formulation import (
    Problem, first_options, first_run_backward, fixed_intervals, graph_input_bytes, solver_items, split_choice,
    stacked, staging_spans,
)
from .memory import Resident, Timeline, residents_at
from .plan import (
    ADVICE_WARN, AUTO_STRATEGY, KEEP, OFFLOAD, RECOMPUTE, BudgetInfeasibleError, BudgetInfeasibleWarning, Decision,
    Goal, Ineligible, Plan, PlanOptions, Recompute, SizeBudget, Transfer, Why, advice_min_bytes, readable_bytes,
    staging_bytes, warn_from_user,
)
from .policies import MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD, PREFER_SAVE
from .sizes import concrete, held_sizes, plan_sizes, size_ranges, timeline_at
from .solvers import ACCEPTED_GAP, SolverInput, curve_with, host_of, solve

__all__ = ["Choosable", "PeakWithin", "SmallestPeak", "plan_offloads"]


_EVERY_ELIGIBLE = "offloaded (all_eligible, >= min_bytes)"
PROBE_GAP = 0.05  # how close to its LP bound a solve under max_overhead's peak_within stops (see above)
_VIEW_WORDING = {_EVERY_ELIGIBLE: "offloaded through its base",
                 **{f"chosen to {goal.value}": f"base chosen to {goal.value}" for goal in Goal}}


def _offload_reason(act: SavedActivation, why: str) -> str:
    if not act.view_chain:
        return why
    return f"view of {act.base.name}; {_VIEW_WORDING.get(why, f'base offloaded ({why})')}, rebuilt after prefetch"


class SizeTarget(NamedTuple):
    """Another size a budget binds a plan at: the sizes (symbol -> value), the problem there, and the
    budget there in bytes."""

    values: dict
    problem: Problem
    budget: int


@dataclass(frozen=True)
class _Choice:
    offloaded: tuple[fx.Node, ...]
    recomputed: tuple[fx.Node, ...] = ()
    solver: str = "none"
    optimal: bool = True
    gap: float = 0.0
    feasible: bool = True
    note: str = ""
    shortfall: tuple[int, int] | None = None
    held_back: frozenset[fx.Node] = frozenset()  # candidates the smallest peak moves that max_overhead keeps
    least_held: int | None = None  # infeasible: what the runs leave for the backward with every candidate moved


_ALL = {OFFLOAD: "offloading every eligible activation", RECOMPUTE: "recomputing every recomputable activation",
        AUTO_STRATEGY: "offloading or recomputing every eligible activation"}


def _choose(problem: Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], budget: int,
            held: Sequence[SizeTarget] = (), accepted_gap: float = ACCEPTED_GAP) -> _Choice:
    """What to offload or recompute, on top of the ``forced`` offloads, so that the budget holds
    (at the plan's size, and at each of ``held``'s: sizes, the problem there, the budget there), at the
    least cost the solver finds within ``accepted_gap`` of its bound."""
    options = problem.options
    items, owners, queues, conflicts = solver_items(problem, free, forced)
    parts = [fixed_intervals(problem, free, forced, items)]
    for target in held:
        at, limit = target.problem, target.budget
        part = fixed_intervals(at, free, forced, solver_items(at, free, forced).items)
        parts.append(part._replace(lift=budget - limit))
    if (first_run := first_run_backward(problem, free, forced, items)) is not None:
        parts.append(first_run)  # (a device budget: no other sizes are held)
    length = problem.timeline.length
    base, items, _ = stacked(length, parts)
    bare = list(base)  # without the held cap
    cap_at = _held_cap_at(problem, forced)
    if cap_at is not None and cap_at[1] < budget:  # (else the budget implies it)
        base.append((cap_at[0], cap_at[0], budget - cap_at[1]))
    total = length * len(parts)
    host_left = problem.host_left(forced)
    asked = SolverInput(total, base, items, budget, queues, conflicts, host_left)
    result = solve(asked, solver=options.solver, node_limit=options.node_limit, time_limit=options.time_limit,
                   accepted_gap=accepted_gap)
    if result.stopped == "time limit":
        warn_from_user(UserWarning(
            f"fxoffload: the exact solver stopped at solver_time_limit={options.time_limit:g} s before its node limit "
            f"({options.node_limit}): this plan depends on the machine's speed and load, and may differ between runs "
            "and ranks; raise solver_time_limit or lower solver_node_limit"))
    if result.feasible:
        offloaded, recomputed = split_choice(owners, result.chosen)
        return _Choice(tuple(forced) + offloaded, recomputed, result.solver, result.optimal, result.gap)
    everything = _reachable(asked)
    if options.budget is None and not problem.device:
        # No budget (the smallest peak is the limit): a solver that misses it (greedy, under conflicts)
        # falls back on acting on every candidate, which reaches it by construction.
        offloaded, recomputed = split_choice(owners, everything)
        return _Choice(tuple(forced) + offloaded, recomputed, result.solver, False, math.nan)
    reached = curve_with(total, bare, items, everything)
    smallest = int(reached.max(initial=0))
    every_offloaded, every_recomputed = split_choice(owners, everything)
    least = problem.held(tuple(forced) + every_offloaded, every_recomputed)
    if cap_at is not None and smallest <= budget and least > options.held_cap:  # only the held cap cannot hold
        return _over_cap(problem, _raised_cap(asked, bare, cap_at, reached, budget), forced, owners, everything,
                         least)
    worst = int(reached.argmax()) // length if total else 0  # the part (size) furthest over its budget
    runs = f" of the step ({options.runs} runs of this graph)" if options.runs > 1 else ""
    acting, smallest_words = _ALL[options.strategy], "smallest achievable"
    host_bound = host_left is not None and host_of(items, first_options(items, conflicts)) > host_left
    if host_bound:
        acting = f"as far as host_budget's {options.host_bytes} B of pinned host memory allows"
        smallest_words = "lowest"  # greedy's, by bisection: the host bound makes it a knapsack
    if problem.device:
        inputs = options.device_bytes - budget
        message = (
            f"device_budget: the {smallest_words} device peak{runs} is {smallest + inputs} B "
            f"({readable_bytes(smallest + inputs)}: graph inputs {inputs} B + the step's tensors {smallest} B, "
            f"{acting}), {smallest - budget} B above the {options.device_bytes} B the budget "
            f"leaves after reserved"
        )
    else:
        given = "" if options.budget.nbytes is not None else f", {options.budget}"
        where, lift = "", parts[worst][2]
        if worst:
            where = (f"at {', '.join(f'{s}={v}' for s, v in held[worst - 1].values.items())} "
                     "(a size this graph serves), ")
            given += " at that size"
        reach, limit = smallest - lift, budget - lift
        message = (
            f"memory_budget: {where}the {smallest_words} activation peak{runs} is {reach} B "
            f"({readable_bytes(reach)}, {acting}), above {_budget_words(limit, given)}"
        )
    shortfall = (smallest + inputs, options.device_bytes) if problem.device else (reach, limit)
    # The bytes at the size where the peak lies (under a device budget every part is at the plan's size).
    at = problem if not worst or problem.device else held[worst - 1].problem
    message += _floor(at, owners, forced, everything, int(reached.argmax()) % length if total else 0, host_bound)
    if options.on_infeasible == "error":
        other = () if options.strategy == AUTO_STRATEGY else ("try strategy='auto'",)
        advice = ("raise the budget", *advice_min_bytes(options), *other, ADVICE_WARN)
        raise BudgetInfeasibleError(message, *shortfall, advice, least_held=least)
    # The cheapest plan that reaches the smallest peak (not just "everything"), within the held cap where
    # moving every candidate does (a region of a step: the regions after it run on top of what it holds).
    lowest = solve(_raised_cap(asked, bare, cap_at, reached, smallest), solver=options.solver,
                   node_limit=options.node_limit, time_limit=options.time_limit)
    chosen = lowest.chosen if lowest.feasible else everything
    warn_from_user(BudgetInfeasibleWarning(message + "; planning for that peak instead"))
    offloaded, recomputed = split_choice(owners, chosen)
    return _Choice(tuple(forced) + offloaded, recomputed, lowest.solver, False, math.nan, False, message, shortfall,
                   least_held=least)


def _raised_cap(asked: SolverInput, bare: list, cap_at: tuple[int, int] | None, reached, bound: int) -> SolverInput:
    """``asked`` on the curve ``bare`` (without the held cap) under ``bound``, with the held cap (``cap_at``:
    the forward's end and the cap there, see ``_held_cap_at``) raised to what moving every candidate leaves
    there (``reached`` at that position), where that is more: the least a plan can leave. A cap the budget
    implied is not implied by a bound above it."""
    if cap_at is None:
        return dataclasses.replace(asked, base=bare, budget=bound)
    end, cap = cap_at
    hold = max(cap, int(reached[end]))
    return dataclasses.replace(asked, base=[*bare, (end, end, max(bound - hold, 0))], budget=bound)


def _over_cap(problem: Problem, raised: SolverInput, forced: Sequence[fx.Node], owners, everything,
              least: int) -> _Choice:
    """The choice where the budget holds but ``PlanOptions.held_cap`` cannot: moving every candidate
    (``everything``) leaves ``least`` for the backward. The cheapest plan within the budget that leaves no
    more (``raised``), else ``everything``."""
    options = problem.options
    message = (f"held_cap: the least the runs can leave for the backward is {least} B (moving every candidate), "
               f"above the cap of {options.held_cap} B")
    shortfall = (least, options.held_cap)
    if options.on_infeasible == "error":
        raise BudgetInfeasibleError(message, *shortfall, (ADVICE_WARN,), least_held=least)
    found = solve(raised, solver=options.solver, node_limit=options.node_limit, time_limit=options.time_limit)
    warn_from_user(BudgetInfeasibleWarning(message + "; planning for that instead"))
    offloaded, recomputed = split_choice(owners, found.chosen if found.feasible else everything)
    return _Choice(tuple(forced) + offloaded, recomputed, found.solver, False, math.nan, False, message, shortfall,
                   least_held=least)


def _held_cap_at(problem: Problem, forced: Sequence[fx.Node]) -> tuple[int, int] | None:
    """``PlanOptions.held_cap`` on the solver's curve: the forward's end and the cap there, so that what the
    runs leave for the backward stays within it (None: no cap). The solver holds it as the budget at that
    position: a fixed interval there that fills the difference. Under a device budget the curve there also
    holds the tensors that are not activations (a forward output, a gradient already made): fixed
    whatever is chosen, they are added to the cap."""
    cap = problem.options.held_cap
    if cap is None:
        return None
    end = len(problem.timeline.fw_nodes) - 1
    if problem.device:
        cap += sum(lt.nbytes for lt in problem.timeline.lifetimes if not lt.activation and lt.birth <= end <= lt.death)
        cap += sum(n for b in forced for start, stop, n in staging_spans(problem, b) if start <= end <= stop)
    return end, cap


FLOOR_NAMED = 4  # the largest tensors an infeasible budget's message names


def _kept_lifetimes(timeline: Timeline, reasons: Mapping[fx.Node, Ineligible | None]) -> dict[int, Ineligible]:
    """Why each saved storage that is not a candidate stays, by lifetime index (graph inputs have none)."""
    kept = {}
    for base, reason in reasons.items():
        if reason is None or not isinstance(base.meta.get("val"), torch.Tensor):  # (not a single tensor)
            continue
        try:
            kept[timeline.forward_lifetime(base).index] = reason
        except KeyError:  # a graph input: not on the activation curve
            continue
    return kept


def _floor(problem: Problem, owners, forced: Sequence[fx.Node], chosen, position: int, host_bound: bool = False) -> str:
    """"; at <node>, that peak holds: ..." -- the largest activations on the device where the smallest
    achievable peak lies, each with why it is there: what sets the budget's floor. ``host_bound``: host_budget
    kept ``chosen`` from moving every candidate."""
    offloaded, recomputed = split_choice(owners, chosen)
    moved = problem.moved((*forced, *offloaded), recomputed)
    residents = residents_at(problem.timeline, moved, position)
    if not residents:
        return ""
    timeline = problem.timeline
    phase = "forward" if position < len(timeline.fw_nodes) else "backward"
    kept = _kept_lifetimes(timeline, problem.reasons)
    named = ", ".join(f"{r.name} {r.nbytes} B ({_stays_why(problem, kept, moved, r, position, host_bound)})"
                      for r in residents[:FLOOR_NAMED])
    rest = residents[FLOOR_NAMED:]
    more = f", and {len(rest)} more ({sum(r.nbytes for r in rest)} B)" if rest else ""
    runs = problem.options.runs
    earlier = (f"; the {runs - 1} earlier runs each hold what they leave for their backward" if runs > 1 else "")
    # (A device peak also holds tensors that are not activations: only those are listed.)
    holds = "that peak's activations are" if problem.device else "that peak holds"
    return f"; at {phase} node {timeline.nodes[position].name}, {holds} {named}{more}{earlier}"


def _stays_why(problem: Problem, kept: Mapping[int, Ineligible], moved: Mapping[int, tuple[int, int]],
               resident: Resident, position: int, host_bound: bool = False) -> str:
    """Why an activation is on the device at ``position`` when everything eligible is moved (or, ``host_bound``,
    as much as host_budget's pinned memory holds)."""
    if (reason := kept.get(resident.lifetime)) is not None:
        return reason.words
    lifetime = problem.timeline.lifetimes[resident.lifetime]
    if lifetime.handed_on and not lifetime.residual:
        return "an output the graph hands to the rest of the step"
    if resident.lifetime not in moved:
        if host_bound:  # (what a bound on pinned memory left: the strategy could have moved it, once blamed)
            return f"eligible, but host_budget's {problem.options.host_bytes} B of pinned memory holds what is moved"
        return f"eligible, but strategy={problem.options.strategy!r} cannot move it"
    if position >= moved[resident.lifetime][1]:
        return "moved, and back on the device for its backward"
    if lifetime.name in {n.name for n in problem.timeline.input_activations}:
        return "an input an earlier graph made: on the device from the graph's start until its copy frees it"
    return "moved, but on the device until its copy frees it"


def _budget_words(limit: int, given: str) -> str:
    """The budget a graph is held to, in words: one below nothing (a region's share of a step whose
    earlier regions already hold more than the step's budget) is said so, not as negative bytes."""
    if limit < 0:
        return f"a budget below nothing: {-limit} B more than all of it is taken before this graph runs{given}"
    words = [readable_bytes(limit)] if limit >= 1024 else []  # below a KiB, the bytes say it
    words += [given.removeprefix(", ")] if given else []
    return f"the budget of {limit} B" + (f" ({', '.join(words)})" if words else "")


def _reachable(asked: SolverInput):
    """A choice that reaches the smallest peak: each item's least-memory option (that does not conflict), or,
    where those copies would not fit the host budget, the lowest peak greedy meets within it, found by
    bisection on the budget to within 0.1% (not proven the lowest: the host bound makes it a knapsack)."""
    length, base, items = asked.length, asked.base, asked.items
    everything = first_options(items, asked.conflicts)
    left = asked.host_budget
    if left is None or host_of(items, everything) <= left:
        return everything
    best: list = []
    low = int(curve_with(length, base, items, everything).max(initial=0))
    high = int(curve_with(length, base, items, ()).max(initial=0))
    while high - low > max(1, high // 1000):
        middle = (low + high) // 2
        found = solve(asked.within(middle), solver="greedy")
        if found.feasible:
            high, best = found.peak, list(found.chosen)
        else:
            low = middle + 1
    return best


def _all_eligible(problem: Problem, wanted: Sequence[fx.Node], forced: Sequence[fx.Node]) -> _Choice:
    """Offload (or, under strategy "recompute", recompute) every candidate in ``wanted``; under a host
    budget, those that fit it, in the order they are born."""
    if problem.options.strategy != RECOMPUTE:
        left = problem.host_left(forced)
        taken = []
        for b in sorted(wanted, key=lambda b: problem.lifetime(b).birth):
            if left is None or problem.host(b) <= left:
                taken.append(b)
                left = None if left is None else left - problem.host(b)
        return _Choice(tuple(forced) + tuple(taken))
    items, owners, _, conflicts = solver_items(problem, wanted, forced)
    return _Choice(tuple(forced), split_choice(owners, first_options(items, conflicts))[1])


def _smallest_peak(problem: Problem, wanted: Sequence[fx.Node], forced: Sequence[fx.Node]) -> int:
    """The bounded activation peak with every candidate in ``wanted`` acted on (each item's first option)."""
    items, _, queues, conflicts = solver_items(problem, wanted, forced)
    base, spans, _ = fixed_intervals(problem, wanted, forced, items)
    length = problem.timeline.length
    # (No budget of its own: _reachable bisects on it where the host budget binds.)
    chosen = _reachable(SolverInput(length, base, spans, 0, queues, conflicts, problem.host_left(forced)))
    return int(curve_with(length, base, spans, chosen).max(initial=0))


def _recomputable(
    timeline: Timeline, groups, recomputes: Mapping[fx.Node, RecomputeCost], candidates, forced, first_use,
) -> dict[fx.Node, RecomputeCost]:
    """The candidates whose chain reads only values alive where it runs (and not forced off the device then)."""
    base_of = {a.fw_node: a.base for g in groups.values() for a in g}
    pos = timeline.positions
    out = {}
    for b in candidates:
        cost = recomputes.get(b)
        if cost is None:
            continue
        at = pos[cost.consumer]
        # Graph inputs (and views of them) live through the step; anything else must outlive the chain.
        alive = all(base_of.get(r, r).op == "placeholder" or timeline.forward_lifetime(r).death >= at
                    for r in cost.reads)
        read_bases = tuple(dict.fromkeys(base_of[r] for r in cost.reads if r in base_of))  # saved ones
        forced_late = any(g in forced and first_use[g] >= at for g in read_bases)
        if alive and not forced_late:
            out[b] = dataclasses.replace(cost, read_bases=read_bases)
    return out


@dataclass
class SmallestPeak:
    """The smallest peak's budget (bytes, ``min_bytes`` over the peak) and the cheapest choice reaching it,
    found by the first plan of a pair that needs them (:class:`PeakWithin`)."""

    limit: int | None = None
    choice: _Choice | None = None


@dataclass(frozen=True)
class PeakWithin:
    """Without a budget: a peak (bytes, of what a budget bounds) max_overhead's driver found within its
    bound, to plan under (``fxoffload.passes.pipeline``). Its plans of one analysed pair, each under
    another peak, share ``found``: the smallest peak's budget and the cheapest choice that reaches it
    (which each plan names as what it held back), the same for each: found by the first, not a dozen
    times (each was one of a plan's two solves)."""

    peak: int
    found: SmallestPeak = field(default_factory=SmallestPeak, compare=False)


@dataclass(frozen=True)
class Choosable:
    """A pair's saved storages as the planner chooses among them: the forward/backward interface and its
    saved activations, the timeline, and per candidate base its (release, prefetch) timeline positions
    as the scheduler gives them (``moves``), its predicted copy costs, and its recompute chain where it
    has one (``recomputes``)."""

    interface: SavedInterface
    activations: Sequence[SavedActivation]
    timeline: Timeline
    moves: Mapping[fx.Node, tuple[int, int]]
    costs: Mapping[fx.Node, TransferCost]
    recomputes: Mapping[fx.Node, RecomputeCost] = field(default_factory=dict)


def plan_offloads(
    choosable: Choosable,
    options: PlanOptions,
    policies: Mapping[str, str] | None = None,
    *,
    queued: bool = False,
    peak_within: PeakWithin | None = None,
) -> Plan:
    """Keep, offload or recompute every saved activation (see the module docstring).

    ``choosable``: what there is to choose among; ``policies`` the
    user's selective-checkpoint marks by forward node name (``fxoffload.passes.policies``);
    ``queued``: price copies as queues on the copy engines (prefetches placed
    freely, horizon ``"auto"``) rather than each alone on its link; ``peak_within``: without a
    budget, the lowest peak (bytes, of what a budget bounds) the driver found within
    ``options.max_overhead`` (``fxoffload.passes.pipeline``): the plan is the cheapest choice under it
    (at least the smallest peak), and its reasons name max_overhead.
    """
    interface, activations, timeline = choosable.interface, choosable.activations, choosable.timeline
    moves, costs, recomputes = choosable.moves, choosable.costs, choosable.recomputes
    user_storages = output_storages(interface.user_outputs)
    groups = group_by_base(activations)
    marks = {base: group_marks(group, policies or {}) for base, group in groups.items()}
    handed_in = frozenset(timeline.input_activations)
    symbols = backward_symbols(interface, groups, handed_in)
    kept = frozenset(n for n in handed_in if input_position(n) in options.kept_inputs)
    reasons = {base: why_kept(group, user_storages, options.min_bytes, marks[base], symbols, handed_in, kept)
               for base, group in groups.items()}
    candidates = [base for base, reason in reasons.items() if reason is None]
    missing = [b.name for b in candidates if b not in moves or b not in costs]
    if missing:
        raise AssertionError(f"fxoffload: candidates without a placement: {missing}")
    forced = [b for b in candidates if MUST_CPU_OFFLOAD in marks[b]]
    free = [b for b in candidates if MUST_CPU_OFFLOAD not in marks[b]]
    _warn_unhonoured(reasons, marks)
    pos = timeline.positions
    first_use = {b: min(pos[u] for a in groups[b] for u in a.bw_node.users) for b in candidates}
    recomputable = _recomputable(timeline, groups, recomputes or {}, free, forced, first_use)
    problem = Problem(timeline, moves, costs, recomputable, first_use, marks, options, queued,
                       reasons)
    _check_forced_host(problem, forced)

    act_before = problem.peak((), (), True)
    step_before = problem.step_peak((), ())
    inputs = graph_input_bytes(timeline)
    if problem.device:  # the bytes the step's own tensors may take
        limit = options.device_bytes - inputs
    else:
        limit = options.budget.resolve(step_before) if options.budget is not None else None
    held = _held(problem) if limit is not None else []
    choice, goal = _select(problem, free, forced, limit, held, peak_within)
    transfers, rebuilt, decisions = _decide(problem, groups, reasons, choice, goal)
    if not _budget_met(problem, choice, goal, limit, held):
        decisions = _host_reasons(problem, decisions, groups, choice)
    budget_bytes = None if problem.device or options.budget is None else limit
    return Plan(
        decisions=decisions,
        transfers=transfers,
        min_bytes=options.min_bytes,
        recomputes=rebuilt,
        strategy=options.strategy,
        budget=str(options.budget) if options.budget is not None else "none",
        budget_bytes=budget_bytes,
        activation_peak_before=act_before,
        activation_peak_after=problem.peak(choice.offloaded, choice.recomputed, True),
        total_peak_before=problem.peak((), (), False),
        total_peak_after=problem.peak(choice.offloaded, choice.recomputed, False),
        total_cap=options.total_cap,
        runs=options.runs,
        interleaved=options.interleaved,
        step_peak_before=step_before,
        step_peak_after=problem.step_peak(choice.offloaded, choice.recomputed),
        input_bytes=inputs,
        device_bytes=options.device_bytes,
        device_peak_before=inputs + problem.device_peak((), ()),
        device_peak_after=inputs + problem.device_peak(choice.offloaded, choice.recomputed),
        solver=choice.solver,
        optimal=choice.optimal,
        gap=choice.gap,
        feasible=choice.feasible,
        note=choice.note,
        shortfall=choice.shortfall,
        sizes=tuple(SizeBudget(tuple(values.items()), n, at.step_peak((), ()),
                               at.step_peak(choice.offloaded, choice.recomputed)) for values, at, n in held),
        planned_at=tuple((symbol, value, bounded) for symbol, (value, bounded) in plan_sizes(problem.timeline).items()),
        size_ranges=tuple((symbol, lo, hi) for symbol, (lo, hi) in size_ranges(problem.timeline).items()),
        host_budget_bytes=options.host_bytes,
        held_cap=options.held_cap,
        backward_gradients=options.backward_gradients,
        run_gradients=options.run_gradients,
        held_before=problem.held((), ()),
        held_after=problem.held(choice.offloaded, choice.recomputed),
        held_least=choice.least_held,
        max_overhead=options.max_overhead,
    )


def _check_forced_host(problem: Problem, forced: Sequence[fx.Node]) -> None:
    """MUST_CPU_OFFLOAD copies are made whatever the host budget: say so when they alone exceed it."""
    cap = problem.options.host_bytes
    need = sum(problem.host(b) for b in forced)
    if cap is None or need <= cap:
        return
    message = (f"host_budget: the saved tensors marked MUST_CPU_OFFLOAD alone take {need} B of pinned host memory "
               f"({readable_bytes(need)} over {problem.options.runs} run(s)), above host_budget's {cap} B")
    if problem.options.on_infeasible == "error":
        raise BudgetInfeasibleError(message, need, cap, ("raise host_budget", "drop some MUST_CPU_OFFLOAD marks",
                                                         ADVICE_WARN))
    warn_from_user(BudgetInfeasibleWarning(message + "; offloading them anyway, and nothing else"))


def _budget_met(problem: Problem, choice: _Choice, goal: Goal | None, limit: int | None,
                held: Sequence[SizeTarget]) -> bool:
    """Whether ``choice`` meets the budget it was made for: then a candidate it keeps was not needed, whatever
    the host budget (plain's ``memory_budget=1.0`` keeps every one; none is the host budget's)."""
    if goal is not Goal.MEET_BUDGET or limit is None:
        return False
    return _within(problem, choice.offloaded, choice.recomputed, limit, held)


def _within(problem: Problem, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node], limit: int,
            held: Sequence[SizeTarget]) -> bool:
    """Whether moving ``offloaded`` and ``recomputed`` keeps the bounded peak within ``limit`` at the plan's
    size and within each of ``held``'s budgets at its sizes."""
    return problem.bounded_peak(offloaded, recomputed) <= limit and all(
        at.bounded_peak(offloaded, recomputed) <= n for _, at, n in held)


def _host_reasons(problem: Problem, decisions: tuple[Decision, ...], groups, choice: _Choice) -> tuple[Decision, ...]:
    """Under a host budget, a kept candidate whose copy would not fit what the plan's copies leave of it
    says so, where the plan misses its goal or aims at the smallest peak: the host budget, not the device
    budget, kept it."""
    cap = problem.options.host_bytes
    if cap is None:
        return decisions
    left = cap - sum(problem.host(b) for b in choice.offloaded)
    moved = set(choice.offloaded) | set(choice.recomputed)
    blocked = {a.index: problem.host(b) for b, group in groups.items() if b not in moved and b in problem.moves
               and problem.host(b) > left for a in group}
    return tuple(
        dataclasses.replace(d, why=Why.HOST_BUDGET,
                            reason=f"kept: its copy would take {blocked[d.index]} B of pinned host memory over the "
                                   f"step's runs; host_budget leaves {max(left, 0)} B")
        if d.index in blocked and d.why is Why.NOT_NEEDED else d
        for d in decisions)


def _select(problem: Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], limit: int | None,
            held: Sequence[SizeTarget], peak_within: PeakWithin | None = None) -> tuple[_Choice, Goal | None]:
    """The choice for a budget of ``limit`` bytes (None: no budget) at the plan's size and ``held``'s,
    and the goal its reasons name (None: every eligible candidate, ``all_eligible``). Without a budget,
    ``peak_within`` (max_overhead's) raises the smallest peak to its peak."""
    unbounded: _Choice | None = None
    accepted_gap = ACCEPTED_GAP
    if limit is None:
        wanted = [b for b in free if PREFER_SAVE not in problem.marks[b]]  # without a budget, PREFER_SAVE holds
        if problem.options.all_eligible:
            return _all_eligible(problem, wanted, forced), None
        # The smallest peak is the budget: a move that cannot lower it is not made, nor one that lowers
        # it by less than min_bytes (a saving that small is not worth a copy, as a storage that small is not).
        found = peak_within.found if peak_within is not None else SmallestPeak()
        if found.limit is None:
            found.limit = _smallest_peak(problem, wanted, forced) + problem.options.min_bytes
        limit = found.limit
        free, goal = wanted, Goal.SMALLEST_PEAK
        if peak_within is not None and peak_within.peak > limit:
            if found.choice is None:
                found.choice = _choose(problem, free, forced, limit)
            unbounded = found.choice
            limit, goal, accepted_gap = peak_within.peak, Goal.SMALLEST_PEAK_WITHIN, PROBE_GAP
    else:
        goal = Goal.MEET_BUDGET
    cap = problem.options.held_cap
    under_cap = cap is None or problem.held(forced, ()) <= cap
    if _within(problem, forced, (), limit, held) and under_cap:
        choice = _Choice(tuple(forced))
    else:
        choice = _choose(problem, free, forced, limit, held, accepted_gap)
    if unbounded is not None:
        moved = {*choice.offloaded, *choice.recomputed}
        held_back = frozenset(b for b in (*unbounded.offloaded, *unbounded.recomputed) if b not in moved)
        choice = dataclasses.replace(choice, held_back=held_back)
    return choice, goal


def _held(problem: Problem) -> list[SizeTarget]:
    """The other sizes the budget binds, each with the problem there and its budget in bytes.

    A fraction is the same fraction at every size of :func:`fxoffload.passes.sizes.held_sizes`; a budget held
    to another plan's sizes (``Budget.at_sizes``) gives its bytes. A budget in bytes binds the plan's
    own size only: that is the largest the guards allow where they bound it, and every activation's
    bytes grow with every symbol (under an unbounded size the backend warns instead)."""
    budget = problem.options.budget
    if problem.device or budget is None:
        return []
    if budget.at_sizes:
        targets = [(dict(values), nbytes) for values, nbytes in budget.at_sizes]
    elif budget.fraction is not None:
        targets = [(values, None) for values in held_sizes(problem.timeline)]
    else:
        return []
    out = []
    for values, nbytes in targets:
        at = dataclasses.replace(problem, timeline=timeline_at(problem.timeline, values))
        out.append(SizeTarget(values, at, nbytes if nbytes is not None else budget.resolve(at.step_peak((), ()))))
    return out


def _decide(problem: Problem, groups, reasons, choice: _Choice, goal: Goal | None):
    """Transfers, recomputations and per-activation decisions of a choice made to reach ``goal``."""
    offloaded, recomputed = set(choice.offloaded), set(choice.recomputed)
    transfers: list[Transfer] = []
    rebuilt: list[Recompute] = []
    decisions: dict[int, Decision] = {}
    for base, group in groups.items():
        transfer = recompute = None
        members = tuple(a.index for a in group)
        lt = problem.lifetime(base) if base in offloaded or base in recomputed else None
        if base in offloaded:
            transfer = len(transfers)
            transfers.append(Transfer(base, lt.nbytes, members, lt.index, problem.costs.get(base),
                                      staging=staging_bytes(base, problem.options)))
        elif base in recomputed:
            recompute = len(rebuilt)
            rebuilt.append(Recompute(base, concrete(group[0].base_nbytes, base.meta["val"]), members, lt.index,
                                     problem.moves[base][0], problem.rebuilt_at(base), problem.recomputes[base]))
        action = RECOMPUTE if recompute is not None else OFFLOAD if transfer is not None else KEEP
        why = _why(action, reasons[base], problem.marks[base], goal)
        if why is Why.NOT_NEEDED and base in choice.held_back:
            why = Why.OVERHEAD
        kept = reasons[base] if why is Why.INELIGIBLE else None
        for act in group:
            if recompute is not None:
                reason = _recompute_reason(act, problem.recomputes[base], goal, problem.marks[base])
            else:
                reason = _reason(act, reasons[base], why, goal, problem.marks[base])
            decisions[act.index] = Decision(
                index=act.index, name=act.name, shape=tuple(act.val.shape), dtype=act.val.dtype, nbytes=act.nbytes,
                action=action, reason=reason, transfer=transfer, recompute=recompute, why=why, kept=kept,
            )
    return tuple(transfers), tuple(rebuilt), tuple(decisions[i] for i in sorted(decisions))


def _why(action: str, kept_because: Ineligible | None, marks: frozenset[str], goal: Goal | None) -> Why:
    """The decision's ``Why``; :func:`_reason` words it."""
    if action == RECOMPUTE:
        return Why.RECOMPUTED
    if action == OFFLOAD:
        return Why.OFFLOADED
    if kept_because is not None:
        return Why.INELIGIBLE
    return Why.PREFER_SAVE if PREFER_SAVE in marks and goal is not Goal.MEET_BUDGET else Why.NOT_NEEDED


def _recompute_reason(act: SavedActivation, cost: RecomputeCost, goal: Goal | None, marks: frozenset[str]) -> str:
    ops = sum(1 for n in cost.chain if is_compute(n))
    source = ", ".join(r.name for r in cost.reads) or "nothing saved"
    why = (f"recomputed before {cost.consumer.name} from {source} ({ops} ops, {cost.seconds * 1e6:.1f} us predicted)"
           + (f"; chosen to {goal.value}" if goal else "; all_eligible, strategy 'recompute'")
           + (", overriding PREFER_SAVE" if PREFER_SAVE in marks else ""))
    return why if not act.view_chain else f"view of {act.base.name}; base {why}; view rebuilt after it"


def _reason(act: SavedActivation, kept_because: Ineligible | None, why: Why, goal: Goal | None,
            marks: frozenset[str]) -> str:
    """``why`` in words for ``act`` (kept or offloaded), naming the selective-checkpoint mark it
    honours or overrides."""
    if why is Why.INELIGIBLE:
        words = kept_because.words
        return f"MUST_CPU_OFFLOAD not honoured: {words}" if MUST_CPU_OFFLOAD in marks else words
    if why is Why.OFFLOADED:
        if MUST_CPU_OFFLOAD in marks:
            return _offload_reason(act, "selective checkpoint policy MUST_CPU_OFFLOAD")
        if PREFER_SAVE in marks:
            return _offload_reason(act, f"chosen to {goal.value}, overriding PREFER_SAVE")
        chosen = f"chosen to {goal.value}" if goal else _EVERY_ELIGIBLE
        reason = _offload_reason(act, "PREFER_CPU_OFFLOAD, " + chosen if PREFER_CPU_OFFLOAD in marks else chosen)
        return f"{INPUT_ACTIVATION}: {reason}" if act.base.op == "placeholder" else reason
    if why is Why.PREFER_SAVE:
        return "kept: selective checkpoint policy PREFER_SAVE"
    if why is Why.OVERHEAD:
        return "kept: max_overhead (the smallest peak moves it, at a predicted cost above the bound)"
    holds = {Goal.MEET_BUDGET: "the budget holds", Goal.SMALLEST_PEAK_WITHIN: "the smallest peak within max_overhead "
             "is reached"}.get(goal, "the smallest peak is reached")
    if PREFER_CPU_OFFLOAD in marks:
        return f"kept: {holds} without offloading it (overrides PREFER_CPU_OFFLOAD)"
    return f"kept: {holds} without offloading it"


def _warn_unhonoured(reasons: Mapping[fx.Node, Ineligible | None], marks: Mapping[fx.Node, frozenset[str]]) -> None:
    # A MUST mark the plan cannot follow is something the user must act on.
    for base, reason in reasons.items():
        if MUST_CPU_OFFLOAD in marks[base] and reason is not None:
            warn_from_user(UserWarning(
                f"fxoffload: {base.name} is marked MUST_CPU_OFFLOAD but stays on the device: {reason.words}"))
