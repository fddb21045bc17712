"""Graph passes of fxoffload over a partitioned forward/backward pair.

Stages, one module each: ``analysis`` (saved tensors, aliasing), ``memory``
(device bytes over the joint timeline), ``cost_model`` (predicted op and copy
times), ``scheduling`` (where each op goes), ``planning`` with ``solvers``
(keep, offload or recompute under a budget -> Plan), ``policies`` (the user's
selective-checkpoint marks), ``rewrite`` (insert the ops and recompute chains),
``simulator`` (replay a plan), ``step`` (replay a step of several graph
invocations: one graph per layer). :func:`analyse_pair` runs the stages up to
the candidates' costs, :func:`plan_analysed` plans and schedules from them
(:func:`plan_pair` is the two in a row);
:func:`plan_best_partition` also weighs alternatives under strategy ``"auto"``,
reusing one analysis for those on the same pair (see its docstring), and
:func:`rewrite_planned` applies the winner. This package knows FX and PyTorch
graphs (and calls PyTorch's partitioner only through a callback), nothing of
torch.compile or of the copy engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.fx as fx

from fxoffload.passes.analysis import (
    SavedActivation,
    SavedInterface,
    inputs_at,
    is_random,
    saved_activations,
    saved_interface,
)
from fxoffload.passes.candidates import (
    AUTO_HORIZON,
    Placement,
    place_candidates,
    recompute_costs,
    timeline_moves,
    transfer_costs,
)
from fxoffload.passes.cost_model import DeviceProfile, node_work, roofline
from fxoffload.passes.memory import Timeline, build_timeline, concrete, curve, intervals, peak, unbounded_symbols
from fxoffload.passes.planning import (
    ADVICE_WARN,
    Budget,
    BudgetInfeasibleError,
    BudgetInfeasibleWarning,
    Decision,
    Plan,
    PlanOptions,
    Transfer,
    group_by_base,
    plan_offloads,
)
from fxoffload.passes.policies import PREFER_CPU_OFFLOAD, PREFER_SAVE
from fxoffload.passes.rewrite import rewrite_pair
from fxoffload.passes.scheduling import Schedule, schedule_transfers, with_scheduled_peaks

__all__ = [
    "Budget", "BudgetInfeasibleError", "Decision", "DeviceProfile", "Placement", "Plan", "PlanOptions",
    "PassResult", "SavedActivation", "Schedule", "Timeline", "Transfer", "plan_pair",
    "plan_best_partition", "rewrite_planned", "unbounded_size_warning", "unoffloaded_total_peak",
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


class _Stopwatch:
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
class _Analysis:
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


def analyse_pair(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_user_outputs: int, *, horizon: int | str,
                 profile: DeviceProfile, input_activations: frozenset[int], outputs_counted: bool,
                 with_recomputes: bool, watch: _Stopwatch) -> _Analysis:
    """Analyse and estimate the pair, and cost each candidate's copies and recompute chain."""
    fw, bw = fw_module.graph, bw_module.graph
    interface = saved_interface(fw, bw, num_user_outputs)
    activations = saved_activations(interface)
    timeline = build_timeline(fw, bw, interface, inputs_at(fw, input_activations), outputs_counted)
    watch.stamp("analyse")
    # Work is measured before the rewrite changes the graphs' edges; the record keeps it.
    work = tuple(node_work(n) for n in timeline.nodes)
    times = tuple(roofline(w, profile) for w in work)
    watch.stamp("estimate")
    candidates = {
        b: g for b, g in group_by_base(activations).items()
        if b.op != "placeholder" and isinstance(b.meta.get("val"), torch.Tensor) and any(a.bw_node.users for a in g)
    }
    # Symbolic sizes at the size the plan is made for (the largest the guards allow, or the traced one).
    nbytes = {b: concrete(g[0].base_nbytes, b.meta["val"]) for b, g in candidates.items()}
    placements = place_candidates(fw, bw, candidates, horizon=horizon)
    moves = timeline_moves(timeline, placements)
    costs = transfer_costs(timeline, placements, times, nbytes, profile, hide_backward=horizon == AUTO_HORIZON)
    # A chain may read saved values, and graph inputs (saved for it if they were not).
    readable = (*interface.fw_saved, *fw.find_nodes(op="placeholder"))
    # Recompute chains are copied node for node: not yet for symbolic sizes (their size arguments
    # are forward values).
    static = [b for b, g in candidates.items() if isinstance(g[0].base_nbytes, int)]
    recomputes = recompute_costs(timeline, static, placements, readable, times) if with_recomputes else {}
    watch.stamp("cost candidates")
    return _Analysis(interface, tuple(activations), timeline, work, times, placements, moves, costs, recomputes)


def plan_analysed(analysis: _Analysis, *, options: PlanOptions, horizon: int | str, profile: DeviceProfile,
                  policies: Mapping[str, str] | None, watch: _Stopwatch) -> PassResult:
    """Plan and schedule an analysed pair under ``options``; the graphs are not changed."""
    a = analysis
    recomputes = {} if options.strategy == "offload" else a.recomputes
    plan = plan_offloads(a.interface, a.activations, a.timeline, a.moves, a.costs, options, policies, recomputes,
                         queued=horizon == AUTO_HORIZON)
    watch.stamp("plan")
    schedule = schedule_transfers(plan, a.placements, horizon, timeline=a.timeline, times=list(a.times),
                                  profile=profile, cross_graphs=options.cross_graphs)
    plan = with_scheduled_peaks(plan, a.timeline, schedule)
    watch.stamp("schedule")
    return PassResult(a.interface, a.activations, a.timeline, plan, schedule, tuple(watch.times), a.work)


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
    watch = _Stopwatch()
    if outputs_counted is None:
        outputs_counted = counts_outputs(options)
    analysis = analyse_pair(fw_module, bw_module, num_user_outputs, horizon=horizon, profile=profile,
                            input_activations=counted_inputs(options, input_activations),
                            outputs_counted=outputs_counted, with_recomputes=options.strategy != "offload", watch=watch)
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
    return options.budget is not None and options.budget.fraction is not None and options.runs == 1


def unoffloaded_total_peak(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_user_outputs: int,
                           input_activations: frozenset[int] = frozenset()) -> int:
    """Predicted total peak (every tensor of the step, bytes) of a pair run as it is."""
    interface = saved_interface(fw_module.graph, bw_module.graph, num_user_outputs)
    timeline = build_timeline(fw_module.graph, bw_module.graph, interface,
                              inputs_at(fw_module.graph, input_activations))
    return peak(curve(timeline.length, intervals(timeline, {}, residual_only=False)))


Repartition = Callable[[float], "tuple[fx.GraphModule, fx.GraphModule]"]
PREDICTED_OVERHEAD_WORTH_A_SECOND_PARTITION = 1e-3


def _predicted_step(result: PassResult, profile: DeviceProfile, watch: _Stopwatch) -> float:
    from fxoffload.passes.simulator import simulate

    watch.restart()
    step = simulate(result, profile).step_time
    watch.stamp("simulate")
    return step


def plan_best_partition(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_user_outputs: int,
    repartition: Repartition | None,
    *,
    options: PlanOptions,
    horizon: int | str,
    profile: DeviceProfile,
    policies: Mapping[str, str] | None = None,
    input_activations: frozenset[int] = frozenset(),
) -> tuple[fx.GraphModule, fx.GraphModule, PassResult]:
    """Plan the min-cut pair. Under strategy ``"auto"``, when that plan misses the budget or has a
    predicted cost, also plan (1) the same pair offload-only and recompute-only, and (2) the pair
    PyTorch's recompute-only partitioner makes at that budget (``repartition(fraction)``, its
    ``activation_memory_budget``), held to the same bytes. Return the pair (not rewritten) and the
    plan predicted fastest (simulator) among those that meet the budget without a predicted total
    peak above the min-cut pair's unoffloaded one.

    (1) guards the joint program's queue model, which is optimistic about copies under tight
    memory; it reuses the min-cut pair's analysis. (2) recomputes what our chains cannot: it may
    save a value's inputs instead of the value; it is skipped when its backward draws random numbers
    (see :func:`_draws_random_numbers`). Peaks "before" stay the min-cut pair's, which the budget
    fraction refers to. With ``PREFER_*`` selective-checkpoint hints, the joint program's plan
    stands: it weighs the hints, which the simulator's step time does not. ``input_activations``: as
    for :func:`plan_pair` (by input position, so it holds for the re-partitioned pair too). The
    result's ``seconds`` sum each stage over every alternative.
    """
    watch = _Stopwatch()
    # Decided on the user's budget: the alternatives are held to its bytes, not to its fraction.
    input_activations, outputs_counted = counted_inputs(options, input_activations), counts_outputs(options)

    def analysed(fw, bw, opts):
        watch.restart()
        with _gc_paused():
            return analyse_pair(fw, bw, num_user_outputs, horizon=horizon, profile=profile,
                                input_activations=input_activations, outputs_counted=outputs_counted,
                                with_recomputes=opts.strategy != "offload", watch=watch)

    def planned(analysis, opts):
        watch.restart()
        with _gc_paused():
            return plan_analysed(analysis, options=opts, horizon=horizon, profile=profile, policies=policies,
                                 watch=watch)

    def alternative(analysis, opts):
        with warnings.catch_warnings():  # an alternative that misses the budget just ranks last
            warnings.simplefilter("ignore", BudgetInfeasibleWarning)
            return planned(analysis, dataclasses.replace(opts, on_infeasible="warn"))

    hinted = any(mark in (PREFER_SAVE, PREFER_CPU_OFFLOAD) for mark in (policies or {}).values())
    analysis = analysed(fw_module, bw_module, options)
    if options.strategy != "auto" or options.budget is None or hinted:  # the user's hints outrank predictions
        return fw_module, bw_module, planned(analysis, options)
    # An alternative may meet a budget the joint plan misses: judge infeasibility at the end.
    first = alternative(analysis, options)
    plain = sum(analysis.times)
    step = _predicted_step(first, profile, watch)
    if first.plan.feasible and step <= plain * (1 + PREDICTED_OVERHEAD_WORTH_A_SECOND_PARTITION):
        return fw_module, bw_module, dataclasses.replace(first, seconds=watch.times)
    tried = [_Tried(fw_module, bw_module, first, "min-cut", step)]
    tried += _alternatives(fw_module, bw_module, analysis, first.plan, repartition, analysed, alternative, options,
                           profile, watch)
    fw, bw, best = _best_of(tried, watch)
    if not best.plan.feasible:
        message = f"{best.plan.note}; with every alternative of strategy 'auto'"
        if options.on_infeasible == "error":
            raise BudgetInfeasibleError(message, *best.plan.shortfall, ("raise the budget", "lower min_bytes", ADVICE_WARN))
        warnings.warn(BudgetInfeasibleWarning(message + "; planning for that peak instead"), stacklevel=3)
    return fw, bw, best


@dataclass(frozen=True)
class _Tried:
    fw: fx.GraphModule
    bw: fx.GraphModule
    result: PassResult
    label: str
    step: float  # predicted step time (simulator)


def _alternatives(fw_module, bw_module, analysis, plan, repartition, analysed, alternative, options, profile, watch):
    """Strategy auto's alternatives to the joint plan ``plan`` (see :func:`plan_best_partition`)."""
    # Held to the first plan's bytes, at its own size and at every other size it holds the fraction at.
    at_sizes = tuple((size.values, size.budget_bytes) for size in plan.sizes)
    held = dataclasses.replace(options, budget=Budget(nbytes=plan.budget_bytes, at_sizes=at_sizes))
    tried = []
    for single in ("offload", "recompute"):
        result = alternative(analysis, dataclasses.replace(held, strategy=single))
        tried.append(_Tried(fw_module, bw_module, result, f"min-cut, {single} only predicted fastest",
                            _predicted_step(result, profile, watch)))
    if repartition is not None:
        fraction = min(1.0, plan.budget_bytes / max(plan.activation_peak_before, 1))
        watch.restart()
        fw2, bw2 = repartition(fraction)
        watch.stamp("repartition (PyTorch)")
        if not _draws_random_numbers(bw2):
            result = alternative(analysed(fw2, bw2, held), held)
            tried.append(_Tried(fw2, bw2, result,
                                f"recompute-only (activation_memory_budget={fraction:.3g}), predicted fastest",
                                _predicted_step(result, profile, watch)))
    return tried


def _best_of(tried: list[_Tried], watch: _Stopwatch) -> tuple[fx.GraphModule, fx.GraphModule, PassResult]:
    """The fastest predicted of the joint plan (``tried[0]``) and its alternatives, relabelled as
    strategy auto's with the joint plan's peaks "before"."""
    plan = tried[0].result.plan

    def rank(entry: _Tried):
        result = entry.result
        # Recomputing more may pile temporaries up: never above the min-cut pair's total peak.
        over_total = entry is not tried[0] and result.plan.total_peak_after > plan.total_peak_before
        missed = 0 if result.plan.feasible else result.plan.activation_peak_after  # else the lowest peak
        return (not result.plan.feasible, missed, over_total, entry.step)

    best = min(tried, key=rank)
    relabelled = dataclasses.replace(
        best.result.plan, budget=plan.budget, activation_peak_before=plan.activation_peak_before,
        total_peak_before=plan.total_peak_before, step_peak_before=plan.step_peak_before,
        device_peak_before=plan.device_peak_before, strategy="auto", partition=best.label,
        sizes=tuple(dataclasses.replace(size, step_peak_before=reference.step_peak_before)
                    for size, reference in zip(best.result.plan.sizes, plan.sizes)),
    )
    return best.fw, best.bw, dataclasses.replace(best.result, plan=relabelled, seconds=watch.times)


def unbounded_size_warning(result: PassResult) -> str | None:
    """What a budgeted plan cannot promise when its graph serves sizes above the traced ones."""
    symbols = unbounded_symbols(result.timeline)
    if not symbols or result.plan.budget_bytes is None:
        return None
    traced = ", ".join(f"{symbol}={hint}" for symbol, hint in sorted(symbols.items(), key=str))
    return (f"fxoffload: this graph serves sizes above the traced ones ({traced}, no upper bound): its plan "
            f"meets memory_budget={result.plan.budget} ({result.plan.budget_bytes} B) with a predicted activation "
            f"peak of {result.plan.activation_peak_after} B at the traced sizes only, and larger inputs may exceed "
            "it. Bound the dimension with torch._dynamo.mark_dynamic(tensor, dim, max=N): fxoffload then plans "
            "for the largest size the guards allow.")


def _draws_random_numbers(bw_module: fx.GraphModule) -> bool:
    """A backward that runs a random op. At small budgets PyTorch's recompute-only partitioner
    recomputes ``rand`` in the backward (no saved generator state): new numbers, wrong gradients."""
    return any(is_random(n) for n in bw_module.graph.nodes)


def rewrite_planned(fw_module: fx.GraphModule, bw_module: fx.GraphModule, result: PassResult) -> PassResult:
    """Rewrite a planned pair in place; recompile the modules to run them."""
    start = time.perf_counter()
    with _gc_paused():
        rewrite_pair(fw_module, bw_module, result.interface, result.activations, result.plan, result.schedule)
    return dataclasses.replace(result, seconds=result.seconds + (("rewrite", time.perf_counter() - start),))


@contextlib.contextmanager
def _gc_paused():
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
