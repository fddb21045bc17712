"""Strategy auto: the fastest predicted of several plans of one graph under a budget.

Inputs: the min-cut pair, a callback that re-partitions it with PyTorch's
recompute-only partitioner at a memory fraction, ``PlanOptions``, the horizon,
the ``DeviceProfile``, the user's marks.
Output: the chosen pair (not rewritten) and its :class:`PassResult`.

Algorithm (:func:`plan_best_partition`): plan the min-cut pair jointly (keep,
offload or recompute per storage); when that plan misses the budget or has a
predicted cost, also plan the same pair offload-only and recompute-only (from
the driver's one analysis), and the pair PyTorch's recompute-only partitioner
makes at the budget (and, for a graph that runs several times a step, the joint
plan with room under the budget: :func:`_with_room`; where none of these meets
the budget, PyTorch's pair at lower fractions, which recompute more:
:func:`_lower_fraction`); simulate each (``fxoffload.passes.simulator``; a graph that
runs several times a step, one graph per layer: the step of its runs, per run,
``fxoffload.passes.step``, since its runs differ) and keep
the fastest predicted that meets the budget without a total peak above the
min-cut pair's (the step's, for a graph of several runs; a plan above it is never kept: where only such plans
meet the budget, the budget is refused, naming their peak; under ``max_overhead``, checked against it: the
overhead is the predicted step less the min-cut pair's compute, so PyTorch's recomputation counts; the plan
kept records that pair's compute over the min-cut pair's, ``Plan.partition_seconds``, so that the
simulators' overhead counts it too). The result lists those that qualify
(:class:`CandidatePlan`, fastest predicted first, plans alike counted once), so that measured selection
(``fxoffload.backend.selection``) can time them: ``compare_all`` plans the alternatives
even when the first plan predicts no cost, and ``choose`` returns the one a
measurement chose. Limits: the ranking trusts the simulator's step time, not a
measurement; the user's ``PREFER_*`` marks, which the simulator does not weigh,
keep the joint plan; a re-partitioned backward that draws random numbers is
skipped (PyTorch's partitioner would recompute them without their seed), and so is
one that reads a graph input the step writes in place (it would read the new value);
the lower fractions cost up to eight more partitions, only where no plan qualifies (none meets the budget without
a total peak above the min-cut pair's); a cut PyTorch's partitioner chose before in the same plan is not extracted
again (the repartition's ``known`` set), but is still chosen (its knapsack and solves run).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch.fx as fx

from .analysis import is_random, mutated_inputs_read
from .cost_model import DeviceProfile
from .pipeline import (
    Analysis, AnalysisSettings, PassResult, Stopwatch, analyse_pair, check_overhead, counted_inputs, counts_outputs,
    gc_paused, plan_analysed,
)
from .plan import (
    ADVICE_WARN, Budget, BudgetInfeasibleError, BudgetInfeasibleWarning, PlanOptions, advice_min_bytes, readable_bytes,
    warn_from_user,
)
from .policies import PREFER_CPU_OFFLOAD, PREFER_SAVE
from .digest import plan_digest
from .simulator import simulate
from .step import simulate_runs

__all__ = ["CANDIDATE_KEYS", "CandidatePlan", "PREDICTED_OVERHEAD_WORTH_A_SECOND_PARTITION", "Repartition",
           "of_pytorch_partition", "plan_best_partition"]


# PyTorch's recompute-only pair at a fraction; given a set (the cuts of the pairs asked before), None where the cut
# it chooses is in it (the pair not made again), the cut added to it otherwise.
Repartition = Callable[[float, set], "tuple[fx.GraphModule, fx.GraphModule] | None"]
PREDICTED_OVERHEAD_WORTH_A_SECOND_PARTITION = 1e-3
# Strategy auto's plans of one graph, by the key a measured selection names them with.
MIN_CUT, OFFLOAD_ONLY, RECOMPUTE_ONLY, PYTORCH_RECOMPUTE = "min-cut", "offload-only", "recompute-only", "pytorch"
# The joint plan with its copies chosen for a budget that many of its largest copies lower (see
# :func:`_with_room`), by key.
WITH_ROOM = {"min-cut-room-1": 1, "min-cut-room-2": 2}
# Where no plan meets the budget: the fractions of it at which PyTorch's pair is tried, highest first (see
# :func:`_lower_fraction`); each costs a partition, and a plan where the pair differs from those tried. Eighths:
# the total peak of PyTorch's pairs is not monotonic in the fraction (a Llama block's: over the min-cut pair's
# at 0.25 and 0.1875, under it at 0.15 and 0.2), so quarters missed every pair under it there.
LOWER_FRACTIONS = (0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0)
CANDIDATE_KEYS = (MIN_CUT, OFFLOAD_ONLY, RECOMPUTE_ONLY, PYTORCH_RECOMPUTE, *WITH_ROOM)
# How a plan of PyTorch's recompute-only pair begins its ``partition`` words (then the fraction asked).
PYTORCH_PARTITION_WORDS = "recompute-only (activation_memory_budget="


@dataclass(frozen=True)
class CandidatePlan:
    """One of strategy auto's plans of a graph that meets the budget: what measured selection times."""

    key: str  # one of CANDIDATE_KEYS
    label: str  # the plan's ``partition`` words
    predicted_step: float  # seconds (simulator)


def _predicted_step(result: PassResult, profile: DeviceProfile, watch: Stopwatch) -> float:
    """One run's predicted time: the graph replayed alone, or, where it runs several times a step (one
    graph per layer), the step of its runs replayed (``fxoffload.passes.step``) over their number: the
    runs differ (copies cross from one run to the next; releases deferred before the last run stall
    only in the last), and the graph alone is its last run. Not where forwards run between the
    backwards (``Plan.interleaved``), which the step simulator does not order so."""
    watch.restart()
    runs = simulate_runs(result, profile)
    step = simulate(result, profile).step_time if runs is None else runs.step_time / result.plan.runs
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
    compare_all: bool = False,
    choose: str | None = None,
    analyses: dict | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, PassResult]:
    """Plan the min-cut pair. Under strategy ``"auto"``, when that plan misses the budget or has a
    predicted cost, also plan (1) the same pair offload-only and recompute-only, and (2) the pair
    PyTorch's recompute-only partitioner makes at that budget (``repartition(fraction, known)``, its
    ``activation_memory_budget``: the budget's fraction of the peak it bounds, or a cap's of what the
    graph leaves for its backward; ``known``: a set of the cuts this plan asked for, where the
    repartition may answer None for a cut in it and adds the cut it chose), held to the same bytes.
    Return the pair (not rewritten) and the plan predicted fastest (simulator) among those that meet
    the budget without a predicted total peak (the step's, over several runs) above the min-cut
    pair's unoffloaded one.

    (1) guards the joint program's queue model, which is optimistic about copies under tight
    memory; it reuses the min-cut pair's analysis. (2) recomputes what our chains cannot: it may
    save a value's inputs instead of the value; it is skipped when its backward draws random numbers
    (see :func:`_draws_random_numbers`) or reads an input the step writes; where no plan qualifies, it is
    asked again at lower fractions (:func:`_lower_fraction`). Peaks "before" stay the min-cut pair's, which the budget
    fraction refers to. With ``PREFER_*`` selective-checkpoint hints, the joint program's plan
    stands: it weighs the hints, which the simulator's step time does not. ``input_activations``: as
    for :func:`plan_pair` (by input position, so it holds for the re-partitioned pair too). The
    result's ``seconds`` sum each stage over every alternative, and its ``candidates`` list the plans
    that qualify, fastest predicted first. ``compare_all``: plan the alternatives even when the first
    plan predicts no cost (measured selection times them all). ``choose``: return the candidate of that
    key (``CANDIDATE_KEYS``) instead of the fastest predicted; ValueError when it does not qualify.
    ``analyses``: the pair's analyses made before, by what they were made under (the pair not rewritten
    since), to take one from and to keep this one in.
    """
    # Decided on the user's budget: the alternatives are held to its bytes, not to its fraction.
    settings = AnalysisSettings(horizon, profile, counted_inputs(options, input_activations), counts_outputs(options),
                                options.fused_kernels)
    planner = _Planner(num_user_outputs, settings, policies)
    watch = planner.watch
    hinted = any(mark in (PREFER_SAVE, PREFER_CPU_OFFLOAD) for mark in (policies or {}).values())
    analysis = planner.analysed(fw_module, bw_module, options, analyses)
    if options.strategy != "auto" or options.budget is None or hinted:  # the user's hints outrank predictions
        return fw_module, bw_module, planner.planned(analysis, options)
    # An alternative may meet a budget the joint plan misses: judge infeasibility at the end.
    first = planner.alternative(analysis, options)
    plain = sum(analysis.times)
    step = _predicted_step(first, profile, watch)
    cheap = step <= plain * (1 + PREDICTED_OVERHEAD_WORTH_A_SECOND_PARTITION)
    if first.plan.feasible and cheap and not compare_all and choose in (None, MIN_CUT):
        only = (CandidatePlan(MIN_CUT, first.plan.partition, step),)
        first = check_overhead(first, step, plain, options)
        return fw_module, bw_module, dataclasses.replace(first, seconds=watch.times, candidates=only)
    tried = [_Tried(fw_module, bw_module, first, first.plan.partition, step, MIN_CUT)]
    tried += _alternatives(planner, fw_module, bw_module, analysis, tried[0], repartition, options)
    fw, bw, best = _best_of(tried, watch, choose)
    if not best.plan.feasible:
        message = f"{best.plan.note}; with every alternative of strategy 'auto'{_met_over_total(tried)}"
        if options.on_infeasible == "error":
            raise BudgetInfeasibleError(message, *best.plan.shortfall,
                                        ("raise the budget", *advice_min_bytes(options), ADVICE_WARN),
                                        least_held=best.plan.held_least)
        # (the smallest achievable peak the message opens with: not the one over the total it may name)
        warn_from_user(BudgetInfeasibleWarning(message + "; planning for that smallest achievable peak instead"))
    elif options.max_overhead is not None:  # the fastest predicted is over max_overhead: so is every other
        best = check_overhead(best, _predicted_step(best, profile, watch), plain, options)
    return fw, bw, best


class _Planner:
    """What every plan strategy auto makes of one graph shares (the user's outputs, horizon, profile and
    marks, the inputs and outputs it counts, one stopwatch), and the three steps it takes with them: a
    pair analysed, an analysis planned, and an alternative planned (one that misses the budget warns
    nothing: it ranks last)."""

    def __init__(self, num_user_outputs: int, settings: AnalysisSettings, policies: Mapping[str, str] | None) -> None:
        self.num_user_outputs, self.settings, self.policies = num_user_outputs, settings, policies
        self.watch = Stopwatch()

    def analysed(self, fw: fx.GraphModule, bw: fx.GraphModule, opts: PlanOptions,
                 analyses: dict | None = None) -> Analysis:
        """The pair analysed, or its analysis in ``analyses`` (made before under the same settings; one with
        recompute chains serves strategy offload too, which reads none), kept there if made."""
        with_recomputes = opts.strategy != "offload"
        keys = [(self.settings, self.num_user_outputs, True)] + ([] if with_recomputes else
                                                                  [(self.settings, self.num_user_outputs, False)])
        found = next((analyses[key] for key in keys if analyses is not None and key in analyses), None)
        if found is not None:
            return found
        self.watch.restart()
        with gc_paused():
            analysis = analyse_pair(fw, bw, self.num_user_outputs, self.settings, with_recomputes=with_recomputes,
                                    watch=self.watch)
        if analyses is not None:
            analyses[self.settings, self.num_user_outputs, with_recomputes] = analysis
        return analysis

    def planned(self, analysis: Analysis, opts: PlanOptions, chosen_under: int = 0) -> PassResult:
        self.watch.restart()
        with gc_paused():
            return plan_analysed(analysis, options=opts, horizon=self.settings.horizon, profile=self.settings.profile,
                                 policies=self.policies, watch=self.watch, chosen_under=chosen_under)

    def alternative(self, analysis: Analysis, opts: PlanOptions, chosen_under: int = 0) -> PassResult:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetInfeasibleWarning)
            return self.planned(analysis, dataclasses.replace(opts, on_infeasible="warn"), chosen_under)


@dataclass(frozen=True)
class _Tried:
    fw: fx.GraphModule
    bw: fx.GraphModule
    result: PassResult
    label: str
    step: float  # predicted step time (simulator)
    key: str  # one of CANDIDATE_KEYS
    # the pair's predicted compute per run over the min-cut pair's, without offloading (PyTorch's pair: its
    # own recomputations; 0 for the min-cut pair): Plan.partition_seconds
    partition_seconds: float = 0.0


def _alternatives(planner: _Planner, fw_module, bw_module, analysis, joint: _Tried, repartition,
                  options) -> list[_Tried]:
    """Strategy auto's alternatives to the joint plan ``joint`` (see :func:`plan_best_partition`)."""
    plan = joint.result.plan
    alternative, watch = planner.alternative, planner.watch
    profile = planner.settings.profile
    # Held to the first plan's bytes, at its own size and at every other size it holds the fraction at.
    at_sizes = tuple((size.values, size.budget_bytes) for size in plan.sizes)
    held = dataclasses.replace(options, budget=Budget(nbytes=plan.budget_bytes, at_sizes=at_sizes))
    tried = []
    for single in ("offload", "recompute"):
        result = alternative(analysis, dataclasses.replace(held, strategy=single))
        tried.append(_Tried(fw_module, bw_module, result, f"min-cut, {single} only predicted fastest",
                            _predicted_step(result, profile, watch), {"offload": OFFLOAD_ONLY,
                                                                     "recompute": RECOMPUTE_ONLY}[single]))
    tried += _with_room(planner, fw_module, bw_module, analysis, plan, held)
    if repartition is not None:
        # The budget's fraction of the peak it bounds: the step's over the graph's runs (one run's activation
        # peak where it runs once). Of one run's peak, a graph serving 8 layers at 0.7 asked PyTorch for 1.0:
        # its own min-cut pair, so that no recompute-only partition of PyTorch's was ever a candidate there.
        # A region of a step with later regions is bound by a cap on what it leaves for the backward too
        # (``held_cap``), which binds where its share of the budget does not: then that cap's fraction.
        # PyTorch takes a fraction in [0, 1]; a share of the step's budget can be below nothing (what the
        # regions before hold already exceeds the budget): then recompute all it can.
        fraction = plan.budget_bytes / max(plan.step_peak_before, 1)
        if plan.held_cap is not None and plan.held_before:
            fraction = min(fraction, plan.held_cap / plan.held_before)
        fraction = max(0.0, min(1.0, fraction))
        seen = _Seen()
        theirs = _pytorch_partition(planner, repartition, fraction, held, analysis, seen)
        # A pair refused at the fraction (random numbers, an input the step writes) is refused below it too:
        # a lower fraction recomputes more.
        if theirs is not None:
            tried.append(theirs)
            if fraction > 0 and not any(map(_qualifying(joint), [joint, *tried])):
                tried += _lower_fraction(planner, repartition, fraction, held, analysis, joint, seen)
    return tried


@dataclass(frozen=True)
class _Seen:
    """The pairs of PyTorch's partitioner one graph's plan asked for: by their cut (the partitioner's saved values,
    which the repartition checks before it makes the pair) and by their code (a repartition may not check)."""

    cuts: set = dataclasses.field(default_factory=set)
    codes: set = dataclasses.field(default_factory=set)


def _pytorch_partition(planner: _Planner, repartition: Repartition, fraction: float, held: PlanOptions,
                       analysis: Analysis, seen: _Seen) -> "_Tried | None":
    """The pair PyTorch's recompute-only partitioner makes at ``fraction``, planned held to ``held``'s bytes
    (None where its backward draws random numbers, see :func:`_draws_random_numbers`, or reads a graph input
    the step writes: it would read the new value, ``analysis.mutated_inputs_read``; None too where its cut or
    its code is in ``seen``, a pair asked before at another fraction: the repartition adds the cut it chose, a
    pair refused too, and this the code of a pair it plans)."""
    watch = planner.watch
    watch.restart()
    pair = repartition(fraction, seen.cuts)
    watch.stamp("repartition (PyTorch)")
    if pair is None:  # a cut chosen before: the same pair
        return None
    fw, bw = pair
    code = fw.code + bw.code  # the partitioner names nodes after the joint graph's: one pair, one code
    if _draws_random_numbers(bw) or mutated_inputs_read(bw.graph) or code in seen.codes:
        return None
    seen.codes.add(code)
    theirs = planner.analysed(fw, bw, held)
    result = planner.alternative(theirs, held)
    return _Tried(fw, bw, result, f"{PYTORCH_PARTITION_WORDS}{fraction:.3g}), predicted fastest",
                  _predicted_step(result, planner.settings.profile, watch), PYTORCH_RECOMPUTE,
                  sum(theirs.times) - sum(analysis.times))


def _lower_fraction(planner: _Planner, repartition: Repartition, fraction: float, held: PlanOptions,
                    analysis: Analysis, joint: _Tried, seen: _Seen) -> list[_Tried]:
    """Where no plan qualifies (meets the budget without a total peak above ``joint``'s), PyTorch's partition
    at a lower fraction may: it recomputes more, and what is left may then be offloaded under the budget (a
    tiny Whisper at 0.55: 0.55's pair reached 534596 B at best, 0.3's 397380 B). Tried at ``LOWER_FRACTIONS``
    of the fraction, highest first (it recomputes least), up to the first that qualifies; a pair asked before
    (``seen``: by its cut, not made again, or by its code) is not planned again (a Llama-style block at 0.1: five
    cuts in nine asks). Not a bisection: a pair that recomputes all it can may pile its temporaries above the
    total peak (that Whisper's at fraction 0: 1327104 B against 1175108 B),
    and the total peak is not monotonic in the fraction (see ``LOWER_FRACTIONS``), so a fraction may be too
    high or too low. Returns the plan that qualifies, else the one that missed the budget least (for the
    floor an error names); never one over the total peak."""
    qualifies, missed = _qualifying(joint), []
    for factor in LOWER_FRACTIONS:
        entry = _pytorch_partition(planner, repartition, fraction * factor, held, analysis, seen)
        if entry is None:
            continue
        if qualifies(entry):
            return [entry]
        if not entry.result.plan.feasible and not _over_total(entry, joint):
            missed.append(entry)
    return sorted(missed, key=_missed)[:1]


def _with_room(planner: _Planner, fw_module, bw_module, analysis, plan, held: PlanOptions) -> list[_Tried]:
    """The joint plan's alternatives for a graph that runs several times a step under a budget in bytes:
    its copies chosen for a budget one and two of its largest copies lower, its releases placed at the
    budget itself. The budget binds at the last run (on top of what every other run holds) near its
    forward's end, so a release of that run whose copy lands late waits there, where the runs before
    defer theirs (``scheduling._deferred_before_last``); with room under the bound it may wait at the
    forward's end instead. On frontier run 5's model and calibration (8 layers, one graph) the wait
    at 0.7 (1.1 ms) went (predicted overhead over the step's graphs 1.36 -> 0.27 ms), at 0.5 most of
    it (2.86 -> 1.80 ms); at 0.3 the plan with room predicted slower, and the ranking keeps the first.
    None for one run, under a device budget, at several sizes or when forwards run between backwards."""
    if (plan.runs < 2 or plan.budget_bytes is None or plan.device_bytes is not None or plan.sizes
            or plan.interleaved or not plan.transfers):
        return []
    largest = max(int(t.nbytes) for t in plan.transfers)
    tried = []
    for key, copies in WITH_ROOM.items():
        margin = copies * largest
        if margin >= plan.budget_bytes:
            continue
        result = planner.alternative(analysis, held, chosen_under=margin)
        if not result.plan.feasible:
            continue
        tried.append(_Tried(fw_module, bw_module, result,
                            f"min-cut, copies chosen for {margin / 2**20:g} MiB under the budget, predicted fastest",
                            _predicted_step(result, planner.settings.profile, planner.watch), key))
    return tried


def _best_of(tried: list[_Tried], watch: Stopwatch,
             choose: str | None = None) -> tuple[fx.GraphModule, fx.GraphModule, PassResult]:
    """The fastest predicted of the joint plan (``tried[0]``) and its alternatives (or the one ``choose``
    names), relabelled as strategy auto's with the joint plan's peaks "before", and the candidates."""
    plan = tried[0].result.plan

    qualifies = _qualifying(tried[0])

    def rank(entry: _Tried):
        # Never one over the total peak (the joint plan never is): meeting the budget so would raise the memory
        # a step needs above plain compile's (on Llama-3-8B at 32k tokens under 2 GiB: 197.6 -> 245.1 GiB).
        return (not qualifies(entry), _over_total(entry, tried[0]), _missed(entry), entry.step)

    ranked = sorted(tried, key=rank)  # stable: on a tie, the joint plan, then the order tried
    qualified = _distinct([e for e in ranked if qualifies(e)])
    best = ranked[0]
    if choose is not None:
        best = next((e for e in qualified if e.key == choose), None)
        if best is None:
            raise ValueError(f"strategy auto: no plan {choose!r} qualifies; those that do: "
                             f"{', '.join(e.key for e in qualified) or 'none'}")
    relabelled = dataclasses.replace(
        best.result.plan, budget=plan.budget, activation_peak_before=plan.activation_peak_before,
        total_peak_before=plan.total_peak_before, step_peak_before=plan.step_peak_before, held_before=plan.held_before,
        device_peak_before=plan.device_peak_before, strategy="auto",
        partition=best.label if choose is None else _plain_label(best.label) + ", a candidate of measured selection",
        sizes=tuple(dataclasses.replace(size, step_peak_before=reference.step_peak_before)
                    for size, reference in zip(best.result.plan.sizes, plan.sizes)),
        partition_seconds=best.partition_seconds,
        # max_overhead's seconds per run: of the min-cut pair's compute, as ``check_overhead`` judges it
        overhead_bound=plan.overhead_bound,
    )
    candidates = tuple(CandidatePlan(e.key, _plain_label(e.label), e.step) for e in qualified)
    return best.fw, best.bw, dataclasses.replace(best.result, plan=relabelled, seconds=watch.times,
                                                 candidates=candidates)


def _met_over_total(tried: list[_Tried]) -> str:
    """Words for the plans that met the budget but were not kept: they peak above the total (see :func:`_best_of`)."""
    joint, met = tried[0], [e for e in tried if e.result.plan.feasible and _over_total(e, tried[0])]
    if not met:
        return ""
    lowest = min(met, key=lambda e: _step_total(e.result.plan, True))
    need, plain = _step_total(lowest.result.plan, True), _step_total(joint.result.plan, False)
    return (f" (a plan meets it, {_plain_label(lowest.label)}, but its step needs {need} B in all "
            f"({readable_bytes(need)}), above the {plain} B ({readable_bytes(plain)}) it needs without fxoffload: "
            "not kept, and the smallest achievable peak named is that of the plans that do not raise it)")


def _missed(entry: _Tried) -> int:
    """Bytes over the budget (0 where it is met), in the peak it bounds (the step's over its runs, or the
    device's, at the size furthest over): not one run's activation peak, which offloading a layer's input
    does not lower."""
    plan = entry.result.plan
    reach, limit = plan.shortfall or (plan.activation_peak_after, 0)
    return 0 if plan.feasible else reach - limit


def _plain_label(label: str) -> str:
    """A candidate's words without "predicted fastest" (which only the one the prediction chose earns)."""
    return re.sub(r",? predicted fastest$", "", label)


def _qualifying(joint: _Tried) -> Callable[[_Tried], bool]:
    """Whether a plan may be chosen: it meets the budget without a total peak above the joint plan's pair's."""
    return lambda entry: entry.result.plan.feasible and not _over_total(entry, joint)


def _over_total(entry: _Tried, joint: _Tried) -> bool:
    """Recomputing more may pile temporaries up: an alternative never goes above the min-cut pair's total peak,
    the step's where the graph runs several times a step (:func:`_step_total`)."""
    return entry is not joint and _step_total(entry.result.plan, True) > _step_total(joint.result.plan, False)


def _step_total(plan, after: bool) -> int:
    """The total peak a graph's runs reach in a step, inputs left out, before or after its plan: one run's total
    peak for one run; over several, their device peak (``memory.device_peak_of_runs``: the last run's on top of
    what every other run holds for its backward, with what the schedule holds longer,
    ``scheduling.with_scheduled_peaks``). A plan of PyTorch's recompute-only pair may peak above the min-cut
    pair in a run and hold less for every other: over 8 runs (frontier run 8's model at 0.5) it peaked 127 MiB
    higher per run, and held less."""
    if plan.runs == 1:
        return plan.total_peak_after if after else plan.total_peak_before
    return (plan.device_peak_after if after else plan.device_peak_before) - plan.input_bytes


def _distinct(entries: list[_Tried]) -> list[_Tried]:
    """``entries`` less those whose rewrite repeats an earlier one's (offload-only often plans what the
    joint program plans): timing the same graphs twice would tell nothing."""
    seen, kept = set(), []
    for entry in entries:
        pair = "pytorch" if entry.key == PYTORCH_RECOMPUTE else "min-cut"
        digest = plan_digest(dataclasses.replace(entry.result.plan, partition=pair), entry.result.schedule)
        if digest not in seen:
            seen.add(digest)
            kept.append(entry)
    return kept


def of_pytorch_partition(plan) -> bool:
    """Whether ``plan`` is of the pair PyTorch's recompute-only partitioner made (its "before" is that pair's)."""
    return plan.partition.startswith(PYTORCH_PARTITION_WORDS)


def _draws_random_numbers(bw_module: fx.GraphModule) -> bool:
    """A backward that runs a random op. At small budgets PyTorch's recompute-only partitioner
    recomputes ``rand`` in the backward (no saved generator state): new numbers, wrong gradients."""
    return any(is_random(n) for n in bw_module.graph.nodes)
