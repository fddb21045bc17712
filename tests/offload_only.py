"""The solvers' offload-only special case, for their tests: each candidate occupies ``keep`` when kept
and only its ``offload`` intervals when offloaded (saving ``keep`` minus them), one option each. A
simpler form to write hand-computed cases and properties in; it builds the general problem of
``fxoffload.passes.solvers`` (which the planner uses) and reads its answer back by candidate index."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxoffload.passes import solvers
from fxoffload.passes.solvers import TIME_GUARD, Option, Solution, SolverInput, curve_with, min_peak

Interval = tuple[int, int]


# The general solvers with the problem's fields as arguments, as the tests write their cases.

def solve(length, base, items, budget, queues=(), conflicts=(), *, host_budget=None, **limits) -> Solution:
    return solvers.solve(SolverInput(length, base, items, budget, queues, conflicts, host_budget), **limits)


def solve_greedy(length, base, items, budget, queues=(), conflicts=(), host_budget=None) -> Solution:
    return solvers.solve_greedy(SolverInput(length, base, items, budget, queues, conflicts, host_budget))


def solve_milp(length, base, items, budget, queues=(), conflicts=(), *, host_budget=None, **limits) -> Solution | None:
    return solvers.solve_milp(SolverInput(length, base, items, budget, queues, conflicts, host_budget), **limits)


@dataclass(frozen=True)
class Candidate:
    """Occupies ``keep`` when kept, only its ``offload`` intervals (inside ``keep``) when offloaded."""

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


def _general(fixed, candidates):
    base = list(fixed) + [(c.keep[0], c.keep[1], c.nbytes) for c in candidates]
    items = [(Option(tuple((a, b, -c.nbytes) for a, b in _savings(c)), c.cost),) for c in candidates]
    return base, items


def _offload_result(solution: Solution) -> SolverResult:
    return SolverResult(tuple(i for i, _ in solution.chosen), solution.peak, solution.cost, solution.feasible,
                        solution.solver, solution.optimal, solution.gap, solution.seconds)


def evaluate(length, fixed, candidates, chosen) -> np.ndarray:
    """The curve with ``chosen`` candidates offloaded."""
    base, items = _general(fixed, candidates)
    return curve_with(length, base, items, [(i, 0) for i in chosen])


def choose_offloads(length, fixed, candidates, budget, *, solver: str = "auto",
                    time_limit: float = TIME_GUARD) -> SolverResult:
    """Candidates to offload so the curve stays within ``budget`` at least cost."""
    base, items = _general(fixed, candidates)
    return _offload_result(solve(length, base, items, budget, solver=solver, time_limit=time_limit))


def offload_greedy(length, fixed, candidates, budget) -> SolverResult:
    base, items = _general(fixed, candidates)
    return _offload_result(solve_greedy(length, base, items, budget))


def offload_milp(length, fixed, candidates, budget, time_limit: float = TIME_GUARD) -> SolverResult | None:
    base, items = _general(fixed, candidates)
    solution = solve_milp(length, base, items, budget, time_limit=time_limit)
    return None if solution is None else _offload_result(solution)


def offload_min_peak(length, fixed, candidates) -> int:
    base, items = _general(fixed, candidates)
    return min_peak(length, base, items)
