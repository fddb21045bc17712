"""Planning: decide, for every saved activation, whether to keep it or offload it.

Algorithm. Saved tensors are grouped by the storage they live in (their
*base*, see ``passes.analysis``): a view is never copied on its own; its base
is offloaded once and the view is rebuilt on the device after the prefetch.
:func:`why_kept` says why a group must stay (one rule per early return); the
rest are candidates.

* Without a budget, every candidate is offloaded.
* With a budget (bytes, or a fraction of the activation peak without
  offloading), the activation curve of ``passes.memory`` is handed to
  ``passes.solvers`` as plain intervals: each candidate's device interval if
  kept, and its two intervals if offloaded (device copy until release,
  prefetched copy from prefetch to last use, at the positions the scheduler
  would give it). The solver picks the candidates to offload at the least
  predicted cost: copy time that compute cannot hide (from
  ``passes.cost_model``), plus a small weight on all copy time so that no copy
  is made for nothing.
* Selective-checkpoint marks (``passes.policies``): ``MUST_SAVE`` keeps a
  storage; ``MUST_CPU_OFFLOAD`` offloads it whatever the budget and
  ``min_bytes`` (its offloaded intervals are fixed memory for the solver);
  ``PREFER_CPU_OFFLOAD`` costs nothing in the objective and ``PREFER_SAVE``
  more than any unmarked candidate, so the budget takes them first and last.
  Every reason names the mark it honours or overrides.
* If even offloading every candidate misses the budget, ``on_infeasible``
  decides: ``"error"`` raises :class:`BudgetInfeasibleError` with the smallest
  achievable peak; ``"warn"`` offloads every candidate and says so.

The result is an immutable :class:`Plan`; nothing here edits a graph.
Limits: the cost of a copy assumes it has its link to itself (no queueing
behind other copies); symbolic sizes are evaluated at their hints.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from passes.analysis import SavedActivation, SavedInterface, is_rng_state, output_storages, storage_key
from passes.memory import Timeline, curve, intervals, peak
from passes.policies import MUST_CPU_OFFLOAD, MUST_SAVE, PREFER_CPU_OFFLOAD, PREFER_SAVE
from passes.solvers import Candidate, choose_offloads, min_peak

__all__ = [
    "Budget", "BudgetInfeasibleError", "Decision", "Plan", "PlanOptions", "Transfer", "TransferCost",
    "group_by_base", "plan_offloads", "why_kept", "with_scheduled_peaks",
]

OFFLOAD = "offload"
KEEP = "keep"
COPY_WEIGHT = 1e-3  # weight of hidden copy time next to stall time in the objective
PREFER_SAVE_PENALTY = 10.0  # a PREFER_SAVE candidate costs this many times the costliest other one more


class BudgetInfeasibleError(ValueError):
    """The memory budget cannot be met even by offloading every eligible activation."""


@dataclass(frozen=True)
class Budget:
    """A bound on the activation peak: a fraction of the unoffloaded peak, or bytes."""

    fraction: float | None = None
    nbytes: int | None = None

    def resolve(self, unoffloaded_peak: int) -> int:
        return self.nbytes if self.nbytes is not None else int(self.fraction * unoffloaded_peak)

    def __str__(self) -> str:
        return f"{self.fraction:g} of the activation peak" if self.nbytes is None else f"{self.nbytes} B"


@dataclass(frozen=True)
class PlanOptions:
    min_bytes: int = 0
    budget: Budget | None = None
    solver: str = "auto"
    on_infeasible: str = "error"
    time_limit: float = 10.0


@dataclass(frozen=True)
class TransferCost:
    """Predicted seconds for one candidate's copies and the compute that can hide them."""

    d2h: float
    h2d: float
    forward_window: float  # compute after the offload that may hide it (to the forward's end)
    backward_window: float  # compute between the prefetch and its wait

    @property
    def stall(self) -> float:
        return max(0.0, self.d2h - self.forward_window) + max(0.0, self.h2d - self.backward_window)


@dataclass(frozen=True)
class Decision:
    """What happens to one saved activation, and why."""

    index: int
    name: str
    shape: tuple[Any, ...]
    dtype: torch.dtype
    nbytes: Any  # int, or a sympy expression when sizes are symbolic
    action: str  # "offload" or "keep"
    reason: str
    transfer: int | None  # index into Plan.transfers when offloaded


@dataclass(frozen=True)
class Transfer:
    """One storage copied to the host and back; its members are rebuilt from it."""

    base: fx.Node
    nbytes: int
    members: tuple[int, ...]  # indices of the saved activations that live in this storage
    lifetime: int  # its index in Timeline.lifetimes, fixed at plan time (the inner compiler may change the nodes)
    cost: TransferCost | None = None

    @property
    def base_name(self) -> str:
        return self.base.name


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]
    transfers: tuple[Transfer, ...]
    min_bytes: int
    budget: str = "none"  # as the user gave it
    budget_bytes: int | None = None
    activation_peak_before: int = 0  # predicted, bytes
    activation_peak_after: int = 0
    total_peak_before: int = 0
    total_peak_after: int = 0
    solver: str = "none"
    optimal: bool = True
    gap: float = 0.0
    feasible: bool = True
    note: str = ""

    @property
    def offloaded_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.transfers)

    @property
    def estimated_stall(self) -> float:
        """The planner's estimate (each copy alone on its link); ``Schedule.predicted_stall`` is the prediction."""
        return sum(t.cost.stall for t in self.transfers if t.cost is not None)


def group_by_base(activations: Sequence[SavedActivation]) -> dict[fx.Node, list[SavedActivation]]:
    groups: dict[fx.Node, list[SavedActivation]] = {}
    for act in activations:
        groups.setdefault(act.base, []).append(act)
    return groups


def _replayable(act: SavedActivation) -> bool:
    previous = act.base
    for node in act.view_chain:
        if node.all_input_nodes != [previous]:
            return False
        previous = node
    return True


def why_kept(
    group: Sequence[SavedActivation], user_storages: frozenset[int], min_bytes: int,
    marks: frozenset[str] = frozenset(),
) -> str | None:
    """Why this storage group must stay on the device, or None if it may be offloaded.

    ``marks`` are the group's selective-checkpoint marks (``passes.policies``).
    """
    base = group[0].base
    val = base.meta.get("val")
    if base.op == "placeholder":
        return "graph input (parameter or user input), or a view of one"
    if MUST_SAVE in marks:
        return "selective checkpoint policy MUST_SAVE"
    if not isinstance(val, torch.Tensor):
        return "base is not a single tensor"
    if any(is_rng_state(a.fw_node) for a in group):
        return "random-number generator state for a recomputed random op"
    if storage_key(base) in user_storages:
        return "shares storage with a model output"
    if val.device.type not in ("cpu", "cuda"):
        return f"on device {val.device.type!r}; supported: cpu, cuda"
    if not isinstance(group[0].base_nbytes, int):
        return "symbolic size (dynamic shapes are kept on the device for now)"
    if group[0].base_nbytes == 0:
        return "empty tensor"
    if any(a.fw_node.meta.get("saved_tensor_with_no_vc_check", False) for a in group):
        return "stashed on ctx without save_for_backward"
    if not all(_replayable(a) for a in group):
        return "view chain takes other graph values as arguments; cannot rebuild it after prefetch"
    if not any(a.bw_node.users for a in group):
        return "not used by the backward graph"
    if group[0].base_nbytes < min_bytes and MUST_CPU_OFFLOAD not in marks:  # the user asked for this one
        return f"{group[0].base_nbytes} B < min_bytes={min_bytes}"
    return None


def _group_marks(group: Sequence[SavedActivation], policies: Mapping[str, str]) -> frozenset[str]:
    """The selective-checkpoint marks on a storage's base and on the aliases saved from it."""
    names = [group[0].base.name] + [n.name for a in group for n in a.view_chain]
    return frozenset(policies[n] for n in names if n in policies)


_VIEW_WORDING = {"offloaded (>= min_bytes)": "offloaded through its base",
                 "chosen to meet the budget": "base chosen to meet the budget"}


def _offload_reason(act: SavedActivation, why: str) -> str:
    if not act.view_chain:
        return why
    return f"view of {act.base.name}; {_VIEW_WORDING.get(why, f'base offloaded ({why})')}, rebuilt after prefetch"


@dataclass(frozen=True)
class _Choice:
    chosen: tuple[fx.Node, ...]
    solver: str = "none"
    optimal: bool = True
    gap: float = 0.0
    feasible: bool = True
    note: str = ""


def _solver_costs(
    candidates: Sequence[fx.Node], costs: Mapping[fx.Node, TransferCost], marks: Mapping[fx.Node, frozenset[str]],
) -> list[float]:
    """Each candidate's objective weight; PREFER_CPU_OFFLOAD is free, PREFER_SAVE dearer than any other."""
    base_cost = [costs[b].stall + COPY_WEIGHT * (costs[b].d2h + costs[b].h2d) for b in candidates]
    scale = max(base_cost, default=0.0) or 1e-6
    out = []
    for b, cost in zip(candidates, base_cost):
        if PREFER_CPU_OFFLOAD in marks.get(b, ()):
            cost = 0.0
        elif PREFER_SAVE in marks.get(b, ()):
            cost += PREFER_SAVE_PENALTY * scale
        out.append(cost)
    return out


def _choose(
    timeline: Timeline,
    candidates: Sequence[fx.Node],
    moves: Mapping[fx.Node, tuple[int, int]],
    costs: Mapping[fx.Node, TransferCost],
    budget: int,
    options: PlanOptions,
    forced: Sequence[fx.Node] = (),
    marks: Mapping[fx.Node, frozenset[str]] | None = None,
) -> _Choice:
    """Candidates to offload, on top of the ``forced`` ones (always offloaded), so that the budget holds."""
    lives = {base: timeline.forward_lifetime(base) for base in (*candidates, *forced)}
    planned = {lt.index for lt in lives.values()}
    fixed = [(lt.birth, lt.death, lt.nbytes) for lt in timeline.lifetimes if lt.residual and lt.index not in planned]
    for base in forced:  # their offloaded intervals hold memory whatever is chosen
        lt, (release, prefetch) = lives[base], moves[base]
        fixed += [(lt.birth, release, lt.nbytes), (prefetch, lt.death, lt.nbytes)]
    items = []
    for base, cost in zip(candidates, _solver_costs(candidates, costs, marks or {})):
        lt = lives[base]
        release, prefetch = moves[base]
        items.append(Candidate(lt.nbytes, (lt.birth, lt.death), ((lt.birth, release), (prefetch, lt.death)), cost))
    result = choose_offloads(timeline.length, fixed, items, budget, solver=options.solver, time_limit=options.time_limit)
    if result.feasible:
        chosen = tuple(forced) + tuple(candidates[i] for i in result.chosen)
        return _Choice(chosen, result.solver, result.optimal, result.gap)
    smallest = min_peak(timeline.length, fixed, items)
    given = "" if options.budget.nbytes is not None else f", {options.budget}"
    message = (
        f"memory_budget: the smallest achievable activation peak is {smallest} B ({smallest / 2**20:.1f} MiB, "
        f"offloading every eligible activation), above the budget of {budget} B ({budget / 2**20:.1f} MiB{given})"
    )
    if options.on_infeasible == "error":
        raise BudgetInfeasibleError(message + "; raise the budget, lower min_bytes, or pass on_infeasible='warn'")
    warnings.warn(message + "; offloading every eligible activation", stacklevel=2)
    return _Choice(tuple(forced) + tuple(candidates), result.solver, False, math.nan, False, message)


def plan_offloads(
    interface: SavedInterface,
    activations: Sequence[SavedActivation],
    timeline: Timeline,
    moves: Mapping[fx.Node, tuple[int, int]],
    costs: Mapping[fx.Node, TransferCost],
    options: PlanOptions,
    policies: Mapping[str, str] | None = None,
) -> Plan:
    """Keep or offload every saved activation (see the module docstring).

    ``moves`` maps each candidate base to the (release, prefetch) timeline
    positions the scheduler gives it; ``costs`` to its predicted copy costs;
    ``policies`` the user's selective-checkpoint marks by forward node name
    (``passes.policies``).
    """
    user_storages = output_storages(interface.user_outputs)
    groups = group_by_base(activations)
    marks = {base: _group_marks(group, policies or {}) for base, group in groups.items()}
    reasons = {base: why_kept(group, user_storages, options.min_bytes, marks[base]) for base, group in groups.items()}
    candidates = [base for base, reason in reasons.items() if reason is None]
    missing = [b.name for b in candidates if b not in moves or b not in costs]
    if missing:
        raise AssertionError(f"fxoffload: candidates without a placement: {missing}")
    forced = [b for b in candidates if MUST_CPU_OFFLOAD in marks[b]]
    free = [b for b in candidates if MUST_CPU_OFFLOAD not in marks[b]]
    _warn_unhonoured(reasons, marks)

    def evaluate(chosen: Sequence[fx.Node], residual_only: bool) -> int:
        moved = {timeline.forward_lifetime(b).index: moves[b] for b in chosen}
        return peak(curve(timeline.length, intervals(timeline, moved, residual_only)))

    act_before = evaluate((), True)
    budget_bytes = options.budget.resolve(act_before) if options.budget is not None else None
    if budget_bytes is None:  # offload everything eligible, but a PREFER_SAVE hint is honoured
        choice = _Choice(tuple(forced) + tuple(b for b in free if PREFER_SAVE not in marks[b]))
    elif evaluate(forced, True) <= budget_bytes:
        choice = _Choice(tuple(forced))
    else:
        choice = _choose(timeline, free, moves, costs, budget_bytes, options, forced, marks)

    chosen = set(choice.chosen)
    transfers: list[Transfer] = []
    decisions: dict[int, Decision] = {}
    for base, group in groups.items():
        transfer = None
        if base in chosen:
            transfer = len(transfers)
            transfers.append(Transfer(base, group[0].base_nbytes, tuple(a.index for a in group),
                                      timeline.forward_lifetime(base).index, costs.get(base)))
        for act in group:
            decisions[act.index] = Decision(
                index=act.index, name=act.name, shape=tuple(act.val.shape), dtype=act.val.dtype, nbytes=act.nbytes,
                action=OFFLOAD if transfer is not None else KEEP,
                reason=_reason(act, reasons[base], transfer is not None, budget_bytes is not None, marks[base]),
                transfer=transfer,
            )
    return Plan(
        decisions=tuple(decisions[i] for i in sorted(decisions)),
        transfers=tuple(transfers),
        min_bytes=options.min_bytes,
        budget=str(options.budget) if options.budget is not None else "none",
        budget_bytes=budget_bytes,
        activation_peak_before=act_before,
        activation_peak_after=evaluate(choice.chosen, True),
        total_peak_before=evaluate((), False),
        total_peak_after=evaluate(choice.chosen, False),
        solver=choice.solver,
        optimal=choice.optimal,
        gap=choice.gap,
        feasible=choice.feasible,
        note=choice.note,
    )


def _reason(act: SavedActivation, kept_because: str | None, offloaded: bool, budgeted: bool,
            marks: frozenset[str]) -> str:
    """Why ``act`` is kept or offloaded, naming the selective-checkpoint mark it honours or overrides."""
    if kept_because is not None:
        return f"MUST_CPU_OFFLOAD not honoured: {kept_because}" if MUST_CPU_OFFLOAD in marks else kept_because
    if offloaded:
        if MUST_CPU_OFFLOAD in marks:
            return _offload_reason(act, "selective checkpoint policy MUST_CPU_OFFLOAD")
        if PREFER_SAVE in marks:
            return _offload_reason(act, "chosen to meet the budget, overriding PREFER_SAVE")
        if PREFER_CPU_OFFLOAD in marks:
            return _offload_reason(act, "PREFER_CPU_OFFLOAD, " + ("chosen to meet the budget" if budgeted
                                                                 else "offloaded (no budget)"))
        return _offload_reason(act, "chosen to meet the budget" if budgeted else "offloaded (>= min_bytes)")
    if PREFER_SAVE in marks and not budgeted:
        return "kept: selective checkpoint policy PREFER_SAVE"
    if PREFER_CPU_OFFLOAD in marks:
        return "kept: the budget holds without offloading it (overrides PREFER_CPU_OFFLOAD)"
    return "kept: the budget holds without offloading it"


def _warn_unhonoured(reasons: Mapping[fx.Node, str | None], marks: Mapping[fx.Node, frozenset[str]]) -> None:
    # A MUST mark the plan cannot follow is something the user must act on.
    for base, reason in reasons.items():
        if MUST_CPU_OFFLOAD in marks[base] and reason is not None:
            warnings.warn(f"fxoffload: {base.name} is marked MUST_CPU_OFFLOAD but stays on the device: {reason}",
                          stacklevel=3)


def with_scheduled_peaks(plan: Plan, timeline: Timeline, schedule: Any) -> Plan:
    """The plan with its predicted peaks re-evaluated at the schedule's final placements."""
    if not schedule.placements:
        return plan
    pos = timeline.positions
    moved = {
        plan.transfers[p.transfer].lifetime: (pos[p.free_after], pos[p.prefetch_before])
        for p in schedule.placements
    }
    return dataclasses.replace(
        plan,
        activation_peak_after=peak(curve(timeline.length, intervals(timeline, moved, True))),
        total_peak_after=peak(curve(timeline.length, intervals(timeline, moved, False))),
    )
