"""Solvers: which storages to offload so that the activation peak fits a budget.

Plain numbers in, indices out; nothing here knows FX. Positions are points of
a timeline; intervals are (start, end inclusive) pairs.

A candidate occupies device memory over ``keep`` when kept, and only over its
``offload`` intervals (a sub-set of ``keep``) when offloaded; its saving is
``keep`` minus ``offload``. ``fixed`` intervals hold memory whatever we choose.
The curve is monotone: offloading more never raises it anywhere, so if
offloading every candidate does not fit, nothing does.

* :func:`solve_greedy`: repeatedly take, at the current peak, the candidate
  that saves there at the lowest cost per byte; then drop chosen candidates,
  costliest first, while the budget still holds.
* :func:`solve_milp`: the exact 0/1 program (minimise total cost subject to
  the curve <= budget everywhere), with SciPy's HiGHS (``scipy.optimize.milp``)
  under a time limit. The timeline is cut at the ends of the saving
  intervals; within a segment the same candidates can save, so one row per
  segment (at its highest point) states the whole constraint.
* :func:`choose_offloads`: ``"auto"`` runs greedy, then the LP relaxation
  (a lower bound on any answer's cost). If greedy is within 1% of it, greedy
  is kept with that gap reported (optimal when within HiGHS's 0.01%): branch
  and bound took 3 s on a 7B graph to confirm a greedy answer 0.13% above the
  bound. Otherwise the exact program runs under its time limit and the
  cheaper feasible answer is kept, so the answer is never worse than greedy.
  ``"milp"`` always runs the exact program.

Limits: costs are additive (no queueing between copies).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Candidate", "SolverResult", "choose_offloads", "solve_greedy", "solve_milp", "evaluate"]

Interval = tuple[int, int]
OPTIMALITY_GAP = 1e-4  # relative; HiGHS's default for mixed-integer programs
ACCEPTED_GAP = 1e-2  # "auto" keeps greedy without branch and bound when this close to the LP bound


@dataclass(frozen=True)
class Candidate:
    nbytes: int
    keep: Interval
    offload: tuple[Interval, ...]
    cost: float


@dataclass(frozen=True)
class SolverResult:
    chosen: tuple[int, ...]
    peak: int  # activation peak with ``chosen`` offloaded
    cost: float
    feasible: bool  # peak <= budget
    solver: str  # "milp", "greedy", or "none" (nothing needed)
    optimal: bool  # proven optimal
    gap: float  # relative optimality gap (0 when optimal; nan when unknown)
    seconds: float


def _savings(c: Candidate) -> list[Interval]:
    """Parts of ``keep`` not covered by ``offload`` intervals."""
    start, end = c.keep
    out, cursor = [], start
    for a, b in sorted(c.offload):
        if a > cursor:
            out.append((cursor, min(a - 1, end)))
        cursor = max(cursor, b + 1)
    if cursor <= end:
        out.append((cursor, end))
    return [(a, b) for a, b in out if a <= b]


def _base_curve(length: int, fixed: Sequence[tuple[int, int, int]], candidates: Sequence[Candidate]) -> np.ndarray:
    delta = np.zeros(length + 1, dtype=np.int64)
    for start, end, nbytes in fixed:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    for c in candidates:
        delta[c.keep[0]] += c.nbytes
        delta[c.keep[1] + 1] -= c.nbytes
    return np.cumsum(delta[:-1])


def evaluate(length, fixed, candidates, chosen) -> np.ndarray:
    """The curve with ``chosen`` candidates offloaded."""
    cur = _base_curve(length, fixed, candidates)
    for i in chosen:
        for a, b in _savings(candidates[i]):
            cur[a : b + 1] -= candidates[i].nbytes
    return cur


def _result(length, fixed, candidates, chosen, budget, solver, optimal, gap, started) -> SolverResult:
    chosen = tuple(sorted(chosen))
    top = int(evaluate(length, fixed, candidates, chosen).max(initial=0))
    cost = float(sum(candidates[i].cost for i in chosen))
    return SolverResult(chosen, top, cost, top <= budget, solver, optimal, gap, time.perf_counter() - started)


def solve_greedy(length, fixed, candidates, budget) -> SolverResult:
    started = time.perf_counter()
    cur = _base_curve(length, fixed, candidates)
    savings = [_savings(c) for c in candidates]
    chosen: list[int] = []
    free = set(range(len(candidates)))
    while cur.size and cur.max() > budget:
        t = int(cur.argmax())
        options = [i for i in free if any(a <= t <= b for a, b in savings[i])]
        if not options:
            break  # nothing can lower this point: the budget is infeasible
        best = min(options, key=lambda i: (candidates[i].cost / max(candidates[i].nbytes, 1), -candidates[i].nbytes, i))
        free.discard(best)
        chosen.append(best)
        for a, b in savings[best]:
            cur[a : b + 1] -= candidates[best].nbytes
    if cur.size and cur.max() <= budget:
        for i in sorted(chosen, key=lambda i: -candidates[i].cost):  # undo what is not needed
            spans = savings[i]
            if all(cur[a : b + 1].max() + candidates[i].nbytes <= budget for a, b in spans):
                for a, b in spans:
                    cur[a : b + 1] += candidates[i].nbytes
                chosen.remove(i)
    return _result(length, fixed, candidates, chosen, budget, "greedy", False, math.nan, started)


@dataclass(frozen=True)
class _Program:
    """The 0/1 program in matrix form, scaled to O(1) (see :func:`_program`)."""

    cost: np.ndarray  # per candidate, divided by ``cost_unit``
    cost_unit: float
    matrix: Any  # sparse rows x candidates: bytes saved per segment, divided by the largest candidate
    excess: np.ndarray  # bytes over budget per segment, same unit


def _program(length, fixed, candidates, budget) -> _Program | None:
    """Rows of the program, or None when the budget holds with nothing offloaded."""
    from scipy.sparse import coo_matrix

    base = _base_curve(length, fixed, candidates)
    # Between consecutive ends of saving intervals, the same candidates can
    # save: one row per such segment, at the segment's highest point.
    cuts = sorted({0} | {p for c in candidates for a, b in _savings(c) for p in (a, b + 1)} - {length})
    highest = np.maximum.reduceat(base, cuts) if length else np.zeros(0)
    rows = [t for t, top in zip(cuts, highest) if top > budget]
    if not rows:
        return None
    row_pos = np.array(rows)
    entries_r, entries_c, entries_v = [], [], []
    for i, c in enumerate(candidates):
        for a, b in _savings(c):
            lo, hi = np.searchsorted(row_pos, a, "left"), np.searchsorted(row_pos, b, "right")
            entries_r.extend(range(lo, hi))
            entries_c.extend([i] * (hi - lo))
            entries_v.extend([c.nbytes] * (hi - lo))
    # Scale to O(1): costs are seconds (often microseconds) and HiGHS's absolute
    # gap tolerance is 1e-6, which would call any answer optimal; bytes likewise.
    unit = float(max(c.nbytes for c in candidates)) or 1.0
    matrix = coo_matrix((np.array(entries_v, dtype=float) / unit, (entries_r, entries_c)),
                        shape=(len(rows), len(candidates))).tocsr()
    cost = np.array([c.cost for c in candidates], dtype=float)
    cost_unit = float(cost.max()) if cost.max() > 0 else 1.0
    excess = np.array([top - budget for top in highest if top > budget], dtype=float) / unit
    return _Program(cost / cost_unit, cost_unit, matrix, excess)


def lower_bound(length, fixed, candidates, budget) -> float:
    """A lower bound on the least cost: the LP relaxation of the program (HiGHS)."""
    from scipy.optimize import linprog

    program = _program(length, fixed, candidates, budget) if candidates else None
    if program is None:
        return 0.0
    res = linprog(program.cost, A_ub=-program.matrix, b_ub=-program.excess, bounds=(0, 1), method="highs")
    return float(res.fun) * program.cost_unit if res.status == 0 else 0.0  # no bound found: the trivial one


def solve_milp(length, fixed, candidates, budget, time_limit: float) -> SolverResult | None:
    """The exact program; None if HiGHS found no feasible answer in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    started = time.perf_counter()
    program = _program(length, fixed, candidates, budget) if candidates else None
    if program is None:  # nothing to choose, or nothing needed: the empty answer
        return _result(length, fixed, candidates, (), budget, "milp", True, 0.0, started)
    res = milp(
        program.cost,
        integrality=np.ones(len(candidates)),
        bounds=Bounds(0, 1),
        constraints=LinearConstraint(program.matrix, lb=program.excess, ub=np.inf),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        return None
    chosen = [i for i, v in enumerate(res.x) if v > 0.5]
    gap = float(getattr(res, "mip_gap", math.nan) or 0.0) if res.status == 0 else float(getattr(res, "mip_gap", math.nan))
    return _result(length, fixed, candidates, chosen, budget, "milp", res.status == 0, gap, started)


def min_peak(length, fixed, candidates) -> int:
    """The lowest peak any choice reaches: everything offloaded."""
    return int(evaluate(length, fixed, candidates, range(len(candidates))).max(initial=0))


def choose_offloads(length, fixed, candidates, budget, *, solver: str = "auto", time_limit: float = 10.0) -> SolverResult:
    """Pick candidates so the curve stays within ``budget`` at least cost (see module docstring)."""
    if solver not in ("auto", "milp", "greedy"):
        raise ValueError(f"solver: got {solver!r}; accepted: 'auto', 'milp', 'greedy'")
    greedy = solve_greedy(length, fixed, candidates, budget) if solver in ("auto", "greedy") else None
    if solver == "greedy" or (greedy is not None and not greedy.feasible):
        return greedy  # infeasible: no exact search can do better than "everything"
    if greedy is not None and greedy.cost > 0:
        # The LP relaxation bounds every answer from below: when greedy meets it,
        # greedy is optimal and the (slower) branch and bound is not needed.
        bound = lower_bound(length, fixed, candidates, budget)
        gap = max((greedy.cost - bound) / greedy.cost, 0.0)
        if gap <= ACCEPTED_GAP:
            return dataclasses.replace(greedy, solver="greedy, LP-bounded", optimal=gap <= OPTIMALITY_GAP, gap=gap)
    elif greedy is not None:
        return dataclasses.replace(greedy, optimal=True, gap=0.0)  # zero cost cannot be beaten
    exact = solve_milp(length, fixed, candidates, budget, time_limit)
    if greedy is None:
        return exact if exact is not None else solve_greedy(length, fixed, candidates, budget)
    if exact is not None and exact.feasible and exact.cost <= greedy.cost + 1e-12:
        return exact
    return greedy
