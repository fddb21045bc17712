"""The driver: runs the stages over one partitioned forward/backward pair.

Inputs: the pair (``fx.GraphModule`` each), ``PlanOptions``, the horizon, the
``DeviceProfile``, the user's selective-checkpoint marks.
Outputs: a :class:`PassResult` (the analysis, the ``Plan``, the ``Schedule``,
each stage's measured wall seconds); :func:`rewrite_planned` then edits the pair.

:func:`analyse_pair` runs analysis, the memory timeline, the op estimates and
the candidates' costs (``analysis``, ``memory``, ``cost_model``,
``candidates``) once; :func:`plan_analysed` plans and schedules from that
:class:`Analysis` (``planning``, ``scheduling``), so strategy auto
(``fxoffload.passes.strategy``) plans its alternatives on one pair from one
analysis; :func:`plan_pair` is the two in a row. The graphs are changed only by
:func:`rewrite_planned`. Limits: the garbage collector is paused while the
stages run (:func:`gc_paused`); wall seconds are measured, never read by a stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx as fx

from .analysis import MUTATED_INPUT, SavedActivation, SavedInterface, inputs_at, saved_activations, saved_interface
from .candidates import (
    AUTO_HORIZON, Placement, TransferCost, place_candidates, recompute_costs, timeline_moves, transfer_costs,
)
from .cost_model import DeviceProfile, fused_work, node_work, roofline, staging_seconds
from .memory import Timeline, build_timeline, curve, intervals, peak
from .eligibility import backward_symbols, group_by_base
from .plan import (
    ADVICE_WARN, BudgetInfeasibleWarning, OverheadExceededError, Plan, PlanOptions, staging_bytes, warn_from_user,
)
from .planning import Choosable, PeakWithin, SmallestPeak, plan_offloads
from .rewrite import rewrite_pair
from .scheduling import Schedule, schedule_transfers, with_scheduled_peaks
from .simulator import simulate
from .sizes import UNBOUNDED_REACH, concrete, data_dependent_sizes, unbounded_symbols

__all__ = [
    "Analysis", "AnalysisSettings", "PassResult", "Stopwatch", "analyse_pair", "check_overhead", "counted_inputs",
    "counts_outputs", "gc_paused", "plan_analysed", "plan_pair", "rewrite_planned", "unbounded_size_warning",
    "unoffloaded_total_peak",
]


@dataclass(frozen=True)
class PassResult:
    interface: SavedInterface
    activations: tuple[SavedActivation, ...]
    timeline: Timeline
    plan: Plan
    schedule: Schedule
    seconds: tuple[tuple[str, float], ...]  # (stage name, wall time) in run order
    work: tuple = ()  # per timeline node: (FLOPs, bytes, dtype) or None, for the cost model
    candidates: tuple = ()  # strategy auto's plans that qualify (``strategy.Candidate``), fastest predicted first


class Stopwatch:
    """Wall seconds by stage, summed over every time a stage runs (strategy auto plans several
    alternatives), in the order the stages first ran."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        self._start = time.perf_counter()

    def stamp(self, name: str) -> None:
        now = time.perf_counter()
        self._totals[name] = self._totals.get(name, 0.0) + now - self._start
        self._start = now

    def restart(self) -> None:
        """Leave the time since the last stamp out (another stage's, or the caller's)."""
        self._start = time.perf_counter()

    @property
    def times(self) -> tuple[tuple[str, float], ...]:
        return tuple(self._totals.items())


@dataclass(frozen=True)
class Analysis:
    """What planning reads from a pair, for one set of counted inputs and outputs: the same for
    every strategy, so strategy auto's alternatives on the min-cut pair reuse it."""

    interface: SavedInterface
    activations: tuple[SavedActivation, ...]
    timeline: Timeline
    work: tuple
    times: tuple[float, ...]
    placements: Mapping[fx.Node, Placement]
    moves: Mapping[fx.Node, tuple[int, int]]
    costs: Mapping
    recomputes: Mapping  # candidates' recompute chains and costs; empty under strategy "offload"


@dataclass(frozen=True)
class AnalysisSettings:
    """How a pair is read, the same for every plan of it: the prefetch horizon, the device's profile, the
    positions of the inputs it counts as activations (an earlier graph made them) and whether it counts
    its forward's outputs (:func:`counted_inputs`, :func:`counts_outputs`)."""

    horizon: int | str
    profile: DeviceProfile
    input_activations: frozenset[int]
    outputs_counted: bool
    fused_kernels: bool = False  # priced as Inductor fuses them (``PlanOptions.fused_kernels``)


def analyse_pair(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_user_outputs: int,
                 settings: AnalysisSettings, *, with_recomputes: bool, watch: Stopwatch) -> Analysis:
    """Analyse and estimate the pair, and cost each candidate's copies and recompute chain."""
    horizon, profile = settings.horizon, settings.profile
    input_activations, outputs_counted = settings.input_activations, settings.outputs_counted
    fw, bw = fw_module.graph, bw_module.graph
    interface = saved_interface(fw, bw, num_user_outputs)
    activations = saved_activations(interface)
    timeline = build_timeline(fw, bw, interface, inputs_at(fw, input_activations), outputs_counted)
    watch.stamp("analyse")
    # Work is measured before the rewrite changes the graphs' edges; the record keeps it.
    work = fused_work(timeline.nodes) if settings.fused_kernels else tuple(node_work(n) for n in timeline.nodes)
    times = tuple(roofline(w, profile) for w in work)
    watch.stamp("estimate")
    # Graph inputs are candidates only where they are an earlier graph's activations (a layer's input).
    movable_inputs = set(timeline.input_activations)
    candidates = {
        b: g for b, g in group_by_base(activations).items()
        if (b.op != "placeholder" or b in movable_inputs) and isinstance(b.meta.get("val"), torch.Tensor)
        and any(a.bw_node.users for a in g)
    }
    # Symbolic sizes at the size the plan is made for (the largest the guards allow, or the traced one).
    nbytes = {b: concrete(g[0].base_nbytes, b.meta["val"]) for b, g in candidates.items()}
    placements = place_candidates(fw, bw, candidates, horizon=horizon)
    moves = timeline_moves(timeline, placements)
    costs = transfer_costs(timeline, placements, times, nbytes, profile, hide_backward=horizon == AUTO_HORIZON)
    # A chain may read saved values, and graph inputs (saved for it if they were not) but those the step
    # writes (the backward would read the new value).
    readable = (*interface.fw_saved, *(p for p in fw.find_nodes(op="placeholder") if not p.meta.get(MUTATED_INPUT)))
    # Recompute chains are copied node for node; their symbolic size arguments (forward values) are
    # built in the backward from the size symbols its kept inputs carry.
    computed = [b for b in candidates if b.op != "placeholder"]
    symbols = backward_symbols(interface, group_by_base(activations), frozenset(timeline.input_activations))
    recomputes = (recompute_costs(timeline, computed, placements, readable, times, symbols) if with_recomputes
                  else {})
    watch.stamp("cost candidates")
    return Analysis(interface, tuple(activations), timeline, work, times, placements, moves, costs, recomputes)


def priced_staging(costs: Mapping[fx.Node, TransferCost], options: PlanOptions,
                   profile: DeviceProfile) -> dict[fx.Node, TransferCost]:
    """Each candidate's copy costs with its staging copies' compute time (``options.staging_devices``:
    the engines that stage a tensor filling no one block of memory; none, nothing changes)."""
    priced = dict(costs)
    for b, c in costs.items():
        if staged := staging_bytes(b, options):
            priced[b] = dataclasses.replace(c, staging=2 * staging_seconds(staged, profile))
    return priced


def plan_analysed(analysis: Analysis, *, options: PlanOptions, horizon: int | str, profile: DeviceProfile,
                  policies: Mapping[str, str] | None, watch: Stopwatch, chosen_under: int = 0) -> PassResult:
    """Plan and schedule an analysed pair under ``options``; the graphs are not changed. Under
    ``max_overhead``: without a budget, the smallest peak whose simulated overhead is within it
    (:func:`_within_overhead`); with one, the plan that meets the budget, checked against it
    (:func:`check_overhead`). ``chosen_under``: under a budget in bytes, the copies are chosen for that
    many bytes less, and the releases placed at the budget itself (strategy auto's alternative that
    leaves the schedule room: ``fxoffload.passes.strategy``)."""
    found = SmallestPeak()  # shared by this pair's plans under raised peaks

    def planned(peak_within: int | None) -> PassResult:
        within = None if peak_within is None else PeakWithin(peak_within, found)
        return _plan_and_schedule(analysis, options, horizon, profile, policies, watch, _Choice(within, chosen_under))

    if options.max_overhead is None:
        return planned(None)
    plain = sum(analysis.times)
    if options.budget is not None or options.device_bytes is not None:
        result = planned(None)
        watch.restart()
        step = simulate(result, profile).step_time
        watch.stamp("simulate")
        return check_overhead(result, step, plain, options)
    return _within_overhead(planned, plain, options.max_overhead * plain, profile, watch)


@dataclass(frozen=True)
class _Choice:
    """How a plan's copies are chosen: under ``peak_within`` (see :class:`PeakWithin`), and for a budget
    ``under`` bytes below the one in bytes that its releases are then placed at (``plan_analysed``)."""

    peak_within: PeakWithin | None = None
    under: int = 0


def _plan_and_schedule(a: Analysis, options: PlanOptions, horizon: int | str, profile: DeviceProfile,
                       policies: Mapping[str, str] | None, watch: Stopwatch, choice: _Choice) -> PassResult:
    recomputes = {} if options.strategy == "offload" else a.recomputes
    choosable = Choosable(a.interface, a.activations, a.timeline, a.moves, priced_staging(a.costs, options, profile),
                          recomputes)
    queued = horizon == AUTO_HORIZON
    if choice.under and options.budget is not None and options.budget.nbytes is not None:
        tighter = dataclasses.replace(options.budget, nbytes=options.budget.nbytes - choice.under)
        plan = plan_offloads(choosable, dataclasses.replace(options, budget=tighter), policies, queued=queued,
                             peak_within=choice.peak_within)
        plan = dataclasses.replace(plan, budget=str(options.budget), budget_bytes=options.budget.nbytes)
    else:
        plan = plan_offloads(choosable, options, policies, queued=queued, peak_within=choice.peak_within)
    watch.stamp("plan")
    schedule = schedule_transfers(plan, a.placements, horizon, timeline=a.timeline, times=list(a.times),
                                  profile=profile, cross_graphs=options.cross_graphs)
    plan = with_scheduled_peaks(plan, a.timeline, schedule)
    if options.max_overhead is not None:
        plan = dataclasses.replace(plan, overhead_bound=options.max_overhead * sum(a.times))
    watch.stamp("schedule")
    return PassResult(a.interface, a.activations, a.timeline, plan, schedule, tuple(watch.times), a.work)


def _within_overhead(planned, plain: float, target: float, profile: DeviceProfile, watch: Stopwatch) -> PassResult:
    """The plan of the lowest peak whose simulated overhead is at most ``target`` seconds per run. The
    smallest peak's plan, when it is within; else a bisection on the peak (``planned(bytes)``: the
    cheapest plan under it) between the smallest peak and the peak with nothing moved, to within 0.1%
    of the latter, each probe planned, scheduled and simulated. The simulator, not the solvers'
    pricing, is the judge: the solvers see a copy's whole forward as its cover, where the schedule must
    release it before the peak, so they find copies cheaper than the schedule makes them."""
    def over(result: PassResult) -> float:
        watch.restart()
        step = simulate(result, profile).step_time
        watch.stamp("simulate")
        return step - plain

    smallest = planned(None)
    if over(smallest) <= target * (1 + 1e-9):
        return smallest
    low, high = smallest.plan.step_peak_after + 1, smallest.plan.step_peak_before
    best = None
    while high - low > max(high // 1000, 1):
        middle = (low + high) // 2
        probe = planned(middle)
        if over(probe) <= target * (1 + 1e-9):
            high, best = middle, probe
        else:
            low = middle + 1
    return best if best is not None else planned(high)


def check_overhead(result: PassResult, step: float, plain: float, options: PlanOptions) -> PassResult:
    """A plan that meets its budget, checked against ``options.max_overhead``: ``step`` is its simulated
    step time (seconds per run), ``plain`` the pair's compute time without offloading. Above the bound,
    ``on_infeasible`` decides: ``OverheadExceededError`` naming both bounds, or a warning and the plan
    (the budget is the limit, max_overhead the preference)."""
    plan = result.plan
    if options.max_overhead is None or not plan.feasible or step - plain <= options.max_overhead * plain * (1 + 1e-9):
        return result
    over, bound = step - plain, options.max_overhead * plain
    which = "device_budget" if options.device_bytes is not None else f"memory_budget ({plan.budget})"
    message = (f"max_overhead: the plan that meets {which} adds a predicted {over * 1e3:.3g} ms per run "
               f"({over / max(plain, 1e-12):.2%} of the {plain * 1e3:.3g} ms the graph computes without offloading; "
               f"simulated), above max_overhead={options.max_overhead:g} ({bound * 1e3:.3g} ms)")
    if options.on_infeasible == "error":
        reached = plan.device_peak_after if options.device_bytes is not None else plan.step_peak_after
        limit = options.device_bytes if options.device_bytes is not None else plan.budget_bytes
        raise OverheadExceededError(message, reached, limit, ("raise max_overhead", "raise the budget", ADVICE_WARN),
                                    seconds=over, bound=bound)
    warn_from_user(BudgetInfeasibleWarning(message + "; meeting the budget anyway"))
    return dataclasses.replace(result, plan=dataclasses.replace(plan, note=message))


def plan_pair(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_user_outputs: int,
    *,
    options: PlanOptions,
    horizon: int | str,
    profile: DeviceProfile,
    policies: Mapping[str, str] | None = None,
    input_activations: frozenset[int] = frozenset(),
    outputs_counted: bool | None = None,
) -> PassResult:
    """Analyse, estimate, plan and schedule the pair; the graphs are not changed.

    ``policies``: the user's selective-checkpoint marks by forward node name (``fxoffload.passes.policies``).
    ``input_activations``: positions, among the compiled function's inputs, of those an earlier
    compiled graph of the step made (hidden states between layers): the step holds the ones this
    pair saves, once per run, and the budget counts them (not under a fraction for one run).
    ``outputs_counted``: whether the budget counts the forward's outputs (:func:`counts_outputs`);
    by default decided on ``options``.
    """
    watch = Stopwatch()
    if outputs_counted is None:
        outputs_counted = counts_outputs(options)
    settings = AnalysisSettings(horizon, profile, counted_inputs(options, input_activations), outputs_counted,
                                options.fused_kernels)
    analysis = analyse_pair(fw_module, bw_module, num_user_outputs, settings,
                            with_recomputes=options.strategy != "offload", watch=watch)
    return plan_analysed(analysis, options=options, horizon=horizon, profile=profile, policies=policies, watch=watch)


def counted_inputs(options: PlanOptions, input_activations: frozenset[int]) -> frozenset[int]:
    """The input activations a plan counts: none under a fraction for one run, which is per graph,
    of its own activations (an input it saves but cannot move, such as the logits a loss graph
    saves, would put every fraction out of reach); the graph that makes them counts them instead
    (:func:`counts_outputs`)."""
    return frozenset() if counts_outputs(options) else input_activations


def counts_outputs(options: PlanOptions) -> bool:
    """Whether a plan counts its graph's user outputs as activations until its forward returns:
    under a fraction for one run, where the graph that saves them does not (:func:`counted_inputs`).
    A loss compiled as a graph of its own (a graph break before it) saves the logits it is handed:
    they stay on the device, on top of what the model's graph keeps, until the loss's backward, so
    the model's graph holds its fraction with them counted, and the step holds it too."""
    if options.count_outputs is not None:
        return options.count_outputs
    return options.budget is not None and options.budget.fraction is not None and options.runs == 1


def unoffloaded_total_peak(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_user_outputs: int,
                           input_activations: frozenset[int] = frozenset()) -> int:
    """Predicted total peak (every tensor of the step, bytes) of a pair run as it is."""
    interface = saved_interface(fw_module.graph, bw_module.graph, num_user_outputs)
    timeline = build_timeline(fw_module.graph, bw_module.graph, interface,
                              inputs_at(fw_module.graph, input_activations))
    return peak(curve(timeline.length, intervals(timeline, {}, residual_only=False)))


def unbounded_size_warning(result: PassResult) -> str | None:
    """What a budgeted plan cannot promise when its graph serves sizes above the traced ones, or sizes
    that depend on the data."""
    if result.plan.budget_bytes is None:
        return None
    symbols, dependent = unbounded_symbols(result.timeline), data_dependent_sizes(result.timeline)
    plan = result.plan
    meets = (f"meets memory_budget={plan.budget} ({plan.budget_bytes} B) with a predicted activation "
             f"peak of {plan.activation_peak_after} B")
    if not plan.feasible:  # warned of as out of reach: not said to meet it here (it said so, 11904 B over 4811 B)
        meets = (f"does not meet memory_budget={plan.budget} (see the budget's warning): it predicts an activation "
                 f"peak of {plan.activation_peak_after} B against {plan.budget_bytes} B")
    said = []
    if symbols:
        traced = ", ".join(f"{symbol}={hint}" for symbol, hint in sorted(symbols.items(), key=str))
        # A fraction is held at the other sizes of its range (Plan.sizes), up to UNBOUNDED_REACH times the traced.
        reach = (f"at the traced sizes, and holds the fraction up to {UNBOUNDED_REACH} times them"
                 if plan.sizes and plan.feasible else "at the traced sizes only")
        said.append(f"fxoffload: this graph serves sizes above the traced ones ({traced}, no upper bound): its plan "
                    f"{meets} {reach}; larger inputs may exceed it{' further' if not plan.feasible else ''}. Bound "
                    "the dimension with "
                    "torch._dynamo.mark_dynamic(tensor, dim, max=N): fxoffload then plans for the largest size the "
                    "guards allow.")
    if dependent:
        counted = ", ".join(f"{symbol}={value}" for symbol, value in sorted(dependent.items(), key=str))
        said.append(f"fxoffload: this graph has sizes that depend on the data ({counted}: no traced value; each "
                    "counted at fxoffload.passes.sizes.UNBACKED_SIZE within its guards' range): its plan "
                    f"{meets} at those sizes only, and a step whose data makes them larger may exceed it.")
    return " ".join(said) or None


def rewrite_planned(fw_module: fx.GraphModule, bw_module: fx.GraphModule, result: PassResult) -> PassResult:
    """Rewrite a planned pair in place; recompile the modules to run them."""
    start = time.perf_counter()
    with gc_paused():
        rewrite_pair(fw_module, bw_module, result.interface, result.activations, result.plan, result.schedule)
    return dataclasses.replace(result, seconds=result.seconds + (("rewrite", time.perf_counter() - start),))


@contextlib.contextmanager
def gc_paused():
    # A full collection walks every object of the compile (graphs, fake
    # tensors): on a 7B graph one took 0.8 s in the middle of a pass. The
    # passes make no reference cycles worth collecting, so pause the collector.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
