"""Solvers: for each item, keep it or take one of its options, so that a memory curve fits a budget.

Plain numbers in (one :class:`SolverInput`), indices out; nothing here knows FX. Positions are
points of a timeline; intervals are (start, end inclusive) pairs.

The problem. ``base`` intervals hold memory unless an option changes them.
Each item (a saved storage) is kept, or takes at most one of its
:class:`Option` s (offload it, recompute it). An option changes the curve by
signed amounts over intervals (negative: memory saved; positive: memory a
recomputation needs), costs fixed seconds, and may put work on in-order
engines (:class:`Queue`: the copy engines). Some option pairs conflict (a
recomputation that reads a tensor rules out recomputing that tensor too).
Minimise the total cost plus every queue's *lateness*, subject to the curve
<= budget everywhere and, when a ``host_budget`` is given, the chosen options'
``host`` bytes (the host memory their copies hold) <= it: one knapsack row in
the exact program; greedy skips an option that no longer fits.

A queue's slots are ordered by deadline; ``capacity[k]`` is the engine time
available to the work of slots ``0..k`` together. Work served in deadline
order on one engine finishes ``max_k(sum of work in slots 0..k - capacity[k])``
late at worst, and since a stall delays everything after it, that maximum is
the step time the queue adds (a single-machine lateness bound). The planner
fills the slots with copies ordered by their consumers (prefetches) or, from
the forward's end backwards, by their births (offloads).

* :func:`solve_greedy`: repeatedly take, at the current peak, the option that
  saves there at the lowest cost per byte saved (engine work counted as if it
  all stalled: greedy cannot see queues); then drop chosen options, costliest
  first, while the budget still holds.
* :func:`solve_milp`: the exact program with SciPy's HiGHS
  (``scipy.optimize.milp``): one binary per option, one continuous lateness
  per queue. The timeline is cut at the ends of every option's intervals;
  within a segment the same options change the curve by the same amounts, so
  one point per segment (its highest) states the whole memory constraint;
  points are kept where the base is over budget or some option adds memory.
  The curve at the kept points, and each queue's load, are continuous running
  sums (``s_k = s_{k-1} + what starts or stops at k``), bounded below (memory)
  or above (capacity): O(points + intervals) matrix entries instead of
  O(points x options) (on a 7B graph's joint program: 7,377 entries instead
  of 275,349, and the root node in 1.5 s instead of 4 s); a queue's row for a
  slot is left out where a later slot's row implies it. It stops within a
  relative ``gap`` of its bound (or an absolute one, a hundred-thousandth of
  the queues' span: below what the cost model resolves), or after
  ``node_limit`` branch-and-bound nodes (deterministic: the same answer under
  any load), or at a ``time_limit`` guard (the answer says so).
* :func:`solve`: ``"auto"`` runs greedy, then the LP relaxation (a lower bound
  on any answer's cost). If greedy is within 1% of it, greedy is kept with
  that gap reported (optimal when within HiGHS's 0.01%): branch and bound took
  3 s on a 7B graph to confirm a greedy answer 0.13% above the bound.
  Otherwise the exact program runs to within that 1% of its bound and the
  cheaper feasible answer is kept, so the answer is never worse than greedy. When
  greedy misses the budget, the exact program runs too unless a point stays
  above the budget under every item's largest saving there (proven
  infeasible). ``"milp"`` always runs the exact program. A caller may accept
  another gap than 1% (``accepted_gap``): the probes of max_overhead's bisection
  accept 5% (``fxoffload.passes.planning``).

Limits. Greedy may miss a feasible answer when options add memory or
conflict, or under a host budget (it spends the host bytes on the first
options it takes), or when an item has several options (it takes the cheapest per
byte saved at the current peak, which may free less at the next one); the
exact program does not; the queue model lets every copy start
as early as its slot's capacity says, ignoring the memory that an early
prefetch holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

import numpy as np

__all__ = [
    "Option", "Queue", "Solution", "SolverInput", "solve", "solve_greedy", "solve_milp", "min_peak", "lateness",
    "host_of", "SOLVERS", "SolverName",
]

Interval = tuple[int, int]
Change = tuple[int, int, int]  # (start, end inclusive, bytes added; negative when saved)
OPTIMALITY_GAP = 1e-4  # relative; HiGHS's default for mixed-integer programs
ACCEPTED_GAP = 1e-2  # "auto" keeps greedy without branch and bound when this close to the LP bound
# An answer this close to the bound, as a fraction of the engine time its queues span (about the
# graph's forward or backward), is as good as the bound. A relative gap alone chased programs whose
# whole cost is a few microseconds: one on a Llama-2-7B-shaped graph at 2048 tokens (7.6 us, its queues
# spanning 0.14 s) ran to 1000 nodes (6.3 s) to close 0.1 us. Programs without queues: none.
ABSOLUTE_GAP_OF_SPAN = 1e-5
HIGHS_ABSOLUTE_GAP = 1e-6  # HiGHS's own default (in the program's scaled cost), kept as the least
SolverName = Literal["auto", "milp", "greedy"]
SOLVERS: tuple[str, ...] = get_args(SolverName)
# Branch and bound stops after this many nodes: a deterministic unit of work. The 7B graph's
# programs close the accepted gap at the root node; the limit only bounds the rare hard one. 200, not
# 1000: an 8-layer Llama-2-7B's joint program (batch 1 x 4096, budget 0.5) found its answer early and
# spent 1000 nodes (3.6 s) failing to prove it within 1% (its LP bound is weak); at 200 nodes the same
# answer in 0.9 s, and every other program measured (7B at 0.3/0.5/0.7, 2048 tokens, 16 layers) gave
# the same answer at 50, 200 and 1000 nodes (2026-11-27).
NODE_LIMIT = 200
# Seconds: a guard against a pathological program, not the normal exit (a plan stopped by the
# clock may differ between runs and ranks: the Solution says so).
TIME_GUARD = 120.0
# HiGHS options for branch and bound. Its root reduced-cost heuristic (fix columns by their reduced
# costs, solve the rest as a sub-MIP) took most of the root's time on the 7B graph's joint program
# (355 items, 2 queues, 836 conflicts: 6.5 s and 277 nodes to reach 0.80% of the bound with it; 1.8 s,
# 1 node, to 0.71% without it, a cheaper plan: measured on this 2-core CPU, 2026-11-27). RINS (a
# sub-MIP around the incumbent) is off too: over seven programs the 7B-class graphs hand the solver
# (llama-2-7b at budgets 0.3/0.5/0.7, 2048 tokens, 8 and 16 layers; llama-3-8b at 8192 tokens;
# benchmarks/solver_corpus.py), 6.1 s -> 4.4 s in all, each answer within the 1% it accepts: the same
# cost on six, +0.9% on the 8-layer one (1.16 s -> 0.57 s); llama-2-7b at 0.5 0.72 s -> 0.57 s, same
# cost (measured on this 2-core CPU, 2026-11-28). RENS, its sibling, finds those answers alone.
MIP_OPTIONS = {"mip_heuristic_run_root_reduced_cost": False, "mip_heuristic_run_rins": False}


@dataclass(frozen=True)
class Option:
    """One alternative to keeping an item."""

    changes: tuple[Change, ...]
    cost: float  # seconds, whatever else is chosen
    work: tuple[tuple[int, int, float], ...] = ()  # (queue, slot, seconds) on in-order engines
    host: int = 0  # bytes of a second, flat capacity it takes (host memory); bounded by ``host_budget``


@dataclass(frozen=True)
class Queue:
    capacity: tuple[float, ...]  # engine seconds available to the work of slots 0..k


@dataclass(frozen=True)
class SolverInput:
    """What the solvers are asked (see the module docstring): a timeline of ``length`` positions, the
    ``base`` intervals, each item's options, the ``budget`` the curve stays within, the copy engines'
    queues, the option pairs that conflict ((item, option), (item, option)), and the host bytes the
    chosen options may take together (None: unbounded)."""

    length: int
    base: Sequence[Change]
    items: Sequence[Sequence[Option]]
    budget: int
    queues: Sequence[Queue] = ()
    conflicts: Sequence[tuple[tuple[int, int], tuple[int, int]]] = ()
    host_budget: int | None = None

    def within(self, budget: int) -> "SolverInput":
        """The same choice under another budget."""
        return dataclasses.replace(self, budget=budget)


@dataclass(frozen=True)
class Solution:
    chosen: tuple[tuple[int, int], ...]  # (item, option), sorted
    peak: int  # curve peak with ``chosen``
    cost: float  # option costs plus queue lateness
    feasible: bool  # peak <= budget
    solver: str  # "milp" (", stopped at its node limit" / "time limit"), "greedy", "greedy, LP-bounded", or "none"
    optimal: bool  # proven optimal
    gap: float  # relative optimality gap (0 when optimal; nan when unknown)
    seconds: float
    stopped: str = ""  # "node limit" or "time limit" when the exact search stopped there, else ""
    host: int = 0  # the chosen options' host bytes


# --------------------------------------------------------------------------- evaluation


def _curve(length: int, intervals: Sequence[Change]) -> np.ndarray:
    delta = np.zeros(length + 1, dtype=np.int64)
    for start, end, nbytes in intervals:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    return np.cumsum(delta[:-1])


def _apply(cur: np.ndarray, option: Option, sign: int = 1) -> None:
    for a, b, d in option.changes:
        cur[a : b + 1] += sign * d


def curve_with(length, base, items, chosen) -> np.ndarray:
    """The curve with each chosen (item, option) applied."""
    cur = _curve(length, base)
    for i, o in chosen:
        _apply(cur, items[i][o])
    return cur


def lateness(items, queues, chosen) -> float:
    """Total lateness of the queues' work under ``chosen`` (see the module docstring)."""
    total = 0.0
    for q, queue in enumerate(queues):
        load = np.zeros(len(queue.capacity))
        for i, o in chosen:
            for wq, slot, seconds in items[i][o].work:
                if wq == q:
                    load[slot] += seconds
        if load.size:
            total += max(0.0, float((np.cumsum(load) - np.asarray(queue.capacity)).max()))
    return total


def objective(items, queues, chosen) -> float:
    return float(sum(items[i][o].cost for i, o in chosen)) + lateness(items, queues, chosen)


def host_of(items, chosen) -> int:
    """The host bytes the chosen (item, option) pairs take together."""
    return sum(items[i][o].host for i, o in chosen)


def _solution(problem: SolverInput, chosen, solver: str, optimal: bool, gap: float, started: float) -> Solution:
    chosen = tuple(sorted(chosen))
    top = int(curve_with(problem.length, problem.base, problem.items, chosen).max(initial=0))
    host = host_of(problem.items, chosen)
    feasible = top <= problem.budget and (problem.host_budget is None or host <= problem.host_budget)
    return Solution(chosen, top, objective(problem.items, problem.queues, chosen), feasible, solver, optimal, gap,
                    time.perf_counter() - started, host=host)


def _conflicting(conflicts) -> dict[tuple[int, int], set[tuple[int, int]]]:
    out: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for a, b in conflicts:
        out.setdefault(a, set()).add(b)
        out.setdefault(b, set()).add(a)
    return out


# --------------------------------------------------------------------------- greedy


@dataclass(frozen=True)
class _Flat:
    """Every option of every item as one row, in (item, option) order, and every interval change as
    one row naming its option's: greedy reads the savings of all options at a point in one pass."""

    item: np.ndarray  # per option row
    option: np.ndarray
    cost: np.ndarray  # seconds: its cost plus all its engine work (as if it all stalled)
    host: np.ndarray
    owner: np.ndarray  # per change: the option row it belongs to
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray

    @staticmethod
    def of(items: Sequence[Sequence[Option]]) -> "_Flat":
        rows = [(i, o, option) for i, options in enumerate(items) for o, option in enumerate(options)]
        changes = [(k, a, b, d) for k, (_, _, option) in enumerate(rows) for a, b, d in option.changes]
        owner, start, end, nbytes = (np.array(column, dtype=np.int64) for column in zip(*changes)) if changes \
            else (np.zeros(0, dtype=np.int64),) * 4
        return _Flat(np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1] for r in rows], dtype=np.int64),
                     np.array([o.cost + sum(w[2] for w in o.work) for _, _, o in rows], dtype=np.float64),
                     np.array([o.host for _, _, o in rows], dtype=np.int64), owner, start, end, nbytes)

    def saved_at(self, t: int) -> np.ndarray:
        """Bytes each option row saves at point ``t`` (exact: integer sums)."""
        saved = np.zeros(len(self.item), dtype=np.int64)
        at = (self.start <= t) & (t <= self.end)
        np.add.at(saved, self.owner[at], -self.nbytes[at])
        return saved


def _cheapest_per_byte(flat: _Flat, saved: np.ndarray, open_rows: np.ndarray) -> int | None:
    """The open row with the least cost per byte saved, then the most bytes, then the first in
    (item, option) order; None when no open row saves anything."""
    open_rows = open_rows & (saved > 0)
    if not open_rows.any():
        return None
    ratio = np.full(len(saved), np.inf)
    ratio[open_rows] = flat.cost[open_rows] / saved[open_rows]
    tied = open_rows & (ratio == ratio[open_rows].min())
    most = np.where(tied, saved, -1)
    return int(np.flatnonzero(most == most.max())[0])


def solve_greedy(problem: SolverInput) -> Solution:
    started = time.perf_counter()
    items, budget = problem.items, problem.budget
    cur = _curve(problem.length, problem.base)
    flat = _Flat.of(items)
    row_of = {(int(i), int(o)): k for k, (i, o) in enumerate(zip(flat.item, flat.option))}
    clash = _conflicting(problem.conflicts)
    host_left = math.inf if problem.host_budget is None else problem.host_budget
    open_rows = np.ones(len(flat.item), dtype=bool)  # its item not chosen, and no option it conflicts with taken
    chosen: dict[int, int] = {}
    while cur.size and cur.max() > budget:
        fits = flat.host <= host_left
        best = _cheapest_per_byte(flat, flat.saved_at(int(cur.argmax())), open_rows & fits)
        if best is None:
            break  # nothing can lower this point: the budget is infeasible
        i, o = int(flat.item[best]), int(flat.option[best])
        chosen[i] = o
        open_rows[flat.item == i] = False
        for other in clash.get((i, o), ()):
            open_rows[row_of[other]] = False
        host_left -= items[i][o].host
        _apply(cur, items[i][o])
    if cur.size and cur.max() <= budget:
        by_cost = sorted(chosen.items(), key=lambda p: -flat.cost[row_of[p]])
        for i, o in by_cost:  # undo what is not needed
            _apply(cur, items[i][o], -1)
            if cur.max() <= budget:
                del chosen[i]
            else:
                _apply(cur, items[i][o])
    return _solution(problem, chosen.items(), "greedy", False, math.nan, started)


# --------------------------------------------------------------------------- exact program


def _memory_steps(length, base, options, budget):
    """The memory constraint as running sums, or None when it holds as is: for each kept point (one
    per segment between the ends of the options' intervals, at its highest), what each option's
    saving there adds to the previous kept point's ({column: bytes}), and the bytes to save there."""
    cur = _curve(length, base)
    cuts = sorted({0} | {p for opt in options for a, b, _ in opt.changes for p in (a, b + 1)} - {length})
    highest = np.maximum.reduceat(cur, cuts) if length else np.zeros(0, dtype=np.int64)
    adds = np.zeros(len(cuts), dtype=bool)
    cut_pos = np.array(cuts)
    for opt in options:
        for a, b, d in opt.changes:
            if d > 0:
                adds[np.searchsorted(cut_pos, a) : np.searchsorted(cut_pos, b, "right")] = True
    keep = [k for k in range(len(cuts)) if highest[k] > budget or adds[k]]
    if not any(highest[k] > budget for k in keep):
        return None  # costs are >= 0: taking nothing is optimal
    row_pos = cut_pos[keep]
    steps: list[dict[int, float]] = [{} for _ in keep]
    for col, opt in enumerate(options):
        for a, b, d in opt.changes:
            lo, hi = np.searchsorted(row_pos, a, "left"), np.searchsorted(row_pos, b, "right")
            if lo < hi:  # the option saves -d bytes at kept points lo..hi-1
                steps[lo][col] = steps[lo].get(col, 0.0) - d
                if hi < len(keep):
                    steps[hi][col] = steps[hi].get(col, 0.0) + d
    steps = [{col: v for col, v in step.items() if v} for step in steps]
    return steps, np.array([highest[k] - budget for k in keep], dtype=float)


@dataclass(frozen=True)
class _Program:
    """The program in matrix form, scaled to O(1). Columns: one binary per option, one lateness per
    queue, then the running sums (continuous) that state the curve and the queues' loads."""

    pairs: tuple[tuple[int, int], ...]  # (item, option) of each binary column
    nqueues: int
    cost: np.ndarray
    cost_unit: float
    rows: Any  # sparse constraint matrix
    lower: np.ndarray
    upper: np.ndarray
    column_lower: np.ndarray
    column_upper: np.ndarray


class _Rows:
    """Sparse rows and extra columns, appended as the program is built."""

    def __init__(self, ncols: int) -> None:
        self.ncols, self.nrows = ncols, 0
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.column_lower: list[float] = []
        self.column_upper: list[float] = []

    def columns(self, lower: Sequence[float], upper: Sequence[float]) -> int:
        """Add continuous columns; return the first one's index."""
        first = self.ncols
        self.ncols += len(lower)
        self.column_lower.extend(lower)
        self.column_upper.extend(upper)
        return first

    def row(self, entries, lower: float, upper: float) -> None:
        for col, value in entries:
            self.r.append(self.nrows), self.c.append(col), self.v.append(value)
        self.lower.append(lower), self.upper.append(upper)
        self.nrows += 1

    def running_sums(self, steps: Sequence[dict[int, float]], lower: Sequence[float], upper: Sequence[float]) -> int:
        """Columns ``s_k = s_{k-1} + sum(steps[k][col] * x_col)`` (``s_-1 = 0``) bounded by
        ``lower``/``upper``; return the first one's index. A curve over K rows with N options
        spanning them costs O(K + changes) entries this way, not O(K * N): every row of the dense
        form repeats each option that covers it, and HiGHS's simplex pays for every entry."""
        first = self.columns(lower, upper)
        for k, step in enumerate(steps):
            entries = [(first + k, -1.0)] + ([(first + k - 1, 1.0)] if k else [])
            self.row(entries + sorted(step.items()), 0.0, 0.0)
        return first


def _program(problem: SolverInput) -> _Program | None:
    """Rows of the program, or None when the budget holds with nothing taken."""
    from scipy.sparse import coo_matrix

    length, base, items, budget = problem.length, problem.base, problem.items, problem.budget
    queues, conflicts, host_budget = problem.queues, problem.conflicts, problem.host_budget
    pairs = tuple((i, o) for i, options in enumerate(items) for o in range(len(options)))
    options = [items[i][o] for i, o in pairs]
    if not pairs:
        return None
    memory = _memory_steps(length, base, options, budget)
    if memory is None:
        return None
    rows = _Rows(len(pairs))
    rows.columns([0.0] * len(queues), [np.inf] * len(queues))  # lateness
    unit = float(max((abs(d) for opt in options for _, _, d in opt.changes), default=1)) or 1.0
    steps, excess = memory  # bytes saved at each kept point >= its excess, in units of the largest change
    rows.running_sums([{c: s / unit for c, s in step.items()} for step in steps], excess / unit,
                      [np.inf] * len(excess))
    column = {p: k for k, p in enumerate(pairs)}
    for i, opts in enumerate(items):  # at most one option per item
        if len(opts) > 1:
            rows.row([(column[i, o], 1.0) for o in range(len(opts))], -np.inf, 1.0)
    for a, b in conflicts:  # conflicting options not together
        rows.row([(column[a], 1.0), (column[b], 1.0)], -np.inf, 1.0)
    host_unit = float(max((opt.host for opt in options), default=0))
    if host_budget is not None and host_unit:  # the options' host bytes together within the host budget
        rows.row([(col, opt.host / host_unit) for col, opt in enumerate(options) if opt.host],
                 -np.inf, host_budget / host_unit)
    cost = np.array([opt.cost for opt in options], dtype=float)
    work_max = max((w[2] for opt in options for w in opt.work), default=0.0)
    cost_unit = max(float(cost.max(initial=0.0)), work_max) or 1.0
    for q, queue in enumerate(queues):  # load of slots 0..k - lateness <= capacity[k]
        load: dict[int, dict[int, float]] = {}
        for col, opt in enumerate(options):
            for wq, slot, seconds in opt.work:
                if wq == q:
                    step = load.setdefault(slot, {})
                    step[col] = step.get(col, 0.0) + seconds / cost_unit
        slots, steps = _binding_slots(load, queue.capacity)
        first = rows.running_sums(steps, [-np.inf] * len(slots), [np.inf] * len(slots))
        for k, slot in enumerate(slots):
            rows.row([(first + k, 1.0), (len(pairs) + q, -1.0)], -np.inf, queue.capacity[slot] / cost_unit)
    matrix = coo_matrix((rows.v, (rows.r, rows.c)), shape=(rows.nrows, rows.ncols)).tocsr()
    extra = rows.ncols - len(pairs) - len(queues)
    return _Program(
        pairs, len(queues), np.concatenate([cost / cost_unit, np.ones(len(queues)), np.zeros(extra)]), cost_unit,
        matrix, np.array(rows.lower), np.array(rows.upper),
        np.concatenate([np.zeros(len(pairs)), rows.column_lower]),
        np.concatenate([np.ones(len(pairs)), rows.column_upper]),
    )


def _binding_slots(load: dict[int, dict[int, float]],
                   capacity: Sequence[float]) -> tuple[list[int], list[dict[int, float]]]:
    """The slots whose capacity rows can bind, and the work each adds to the running load.

    Work is never negative, so a slot's row is implied by any later slot's row whose capacity is no
    larger (its load includes the earlier slot's): only a slot whose capacity is below every later
    loaded slot's needs a row, and the work of the slots dropped before it joins its step. The same
    program, in fewer rows: on the 7B graph's joint program, one queue's 355 rows become 289 (copies
    that wait for the same consumer share its deadline), and HiGHS's root node took 0.4-0.6 s instead
    of 1.1-1.3 s (measured, 2026-11-27; branch and bound is sensitive to the form, so others differ)."""
    loaded = sorted(load)
    kept, later = [], math.inf
    for slot in reversed(loaded):
        if capacity[slot] < later:
            kept.append(slot)
            later = capacity[slot]
    kept.reverse()
    steps: list[dict[int, float]] = [{} for _ in kept]
    k = 0
    for slot in loaded:
        while kept[k] < slot:
            k += 1
        for col, seconds in load[slot].items():
            steps[k][col] = steps[k].get(col, 0.0) + seconds
    return kept, steps


def _highs(program: _Program, integral: bool, options: dict):
    from scipy.optimize import Bounds, LinearConstraint, milp

    integrality = np.zeros(len(program.cost))
    if integral:
        integrality[: len(program.pairs)] = 1
    with _stdout_to_stderr(), warnings.catch_warnings():
        # SciPy hands options it does not list (MIP_OPTIONS) to HiGHS verbatim, and says so each time.
        warnings.filterwarnings("ignore", "Unrecognized options detected", RuntimeWarning)
        return milp(program.cost, integrality=integrality, bounds=Bounds(program.column_lower, program.column_upper),
                    constraints=LinearConstraint(program.rows, program.lower, program.upper),
                    options={"disp": False, **options})


@functools.cache
def _mip_options() -> dict:
    """MIP_OPTIONS where this SciPy's HiGHS knows them (an older one would warn at every solve), else none."""
    from scipy.optimize import Bounds, OptimizeWarning, milp

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            milp(np.ones(1), integrality=np.ones(1), bounds=Bounds(0, 1), options={"disp": False, **MIP_OPTIONS})
    except Exception:  # noqa: BLE001 (any refusal: plan without them)
        return {}
    # SciPy's own notice (a RuntimeWarning) comes every time; HiGHS's (an OptimizeWarning) when it lacks one.
    return {} if any(issubclass(w.category, OptimizeWarning) for w in caught) else dict(MIP_OPTIONS)


# What HiGHS 1.12 (SciPy 1.17) prints on descriptor 1 when it repairs an integer solution, whatever its
# output options (ERGO-Code/HiGHS#2783): a developer's trace, four times in one 7B plan, nothing a user
# can act on.
HIGHS_DEBUG_LINES = frozenset({b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();"})
_DESCRIPTOR_1 = threading.Lock()  # one solve at a time moves descriptor 1, so each restores the real one


@contextlib.contextmanager
def _stdout_to_stderr():
    """Hold what C code writes to file descriptor 1 and hand it to descriptor 2 afterwards, less
    HIGHS_DEBUG_LINES: HiGHS prints there despite ``disp=False``, into the JSON that ``fxoffload plan
    --json`` writes on stdout. (Other threads' prints to descriptor 1 during a solve reach stderr too,
    when the solve ends.) Without a writable temporary directory, descriptor 1 points at descriptor 2
    during the solve instead: stdout stays clean, and HiGHS's lines reach stderr unfiltered."""
    with _DESCRIPTOR_1, contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(tempfile.TemporaryFile())
        except OSError:  # no writable temporary directory: stderr itself takes what is printed
            held = None
        sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no descriptor 1 (an embedding without one): nothing to protect
            yield
            return
        try:
            os.dup2(held.fileno() if held is not None else 2, 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            if held is not None:
                held.seek(0)
                _write_to_stderr(_without_highs_debug_lines(held.read()))


def _without_highs_debug_lines(printed: bytes) -> bytes:
    return b"".join(line for line in printed.splitlines(keepends=True)
                    if line.rstrip(b"\r\n") not in HIGHS_DEBUG_LINES)


def _write_to_stderr(data: bytes) -> None:
    sys.stderr.flush()  # after what Python wrote there before
    while data:
        data = data[os.write(2, data):]


def lower_bound(problem: SolverInput) -> float:
    """A lower bound on the least cost: the LP relaxation of the program (HiGHS)."""
    program = _program(problem)
    if program is None:
        return 0.0
    res = _highs(program, integral=False, options={})
    return float(res.fun) * program.cost_unit if res.status == 0 else 0.0  # no bound found: the trivial one


def solve_milp(problem: SolverInput, *, gap: float = OPTIMALITY_GAP, node_limit: int = NODE_LIMIT,
               time_limit: float = TIME_GUARD) -> Solution | None:
    """The exact program, solved to within ``gap`` of its bound (relative) or ABSOLUTE_GAP_OF_SPAN of
    its queues' span (absolute), or until branch and bound
    has explored ``node_limit`` nodes (a count of work, the same on every machine and under any load),
    or until the ``time_limit`` guard (seconds: a plan stopped there may differ between runs; the
    answer's ``stopped`` says so). None if HiGHS found no feasible answer."""
    started = time.perf_counter()
    program = _program(problem)
    if program is None:  # nothing to choose, or nothing needed: the empty answer
        return _solution(problem, (), "milp", True, 0.0, started)
    absolute = max(_absolute_gap(problem.queues) / program.cost_unit, HIGHS_ABSOLUTE_GAP)
    res = _highs(program, integral=True, options={"mip_rel_gap": gap, "mip_abs_gap": absolute, "node_limit": node_limit,
                                                  "time_limit": time_limit, **_mip_options()})
    if res.x is None:
        return None
    chosen = [p for p, v in zip(program.pairs, res.x) if v > 0.5]
    found = float(getattr(res, "mip_gap", math.nan))
    found = 0.0 if res.status == 0 and math.isnan(found) else found
    stopped = "" if res.status == 0 else "time limit" if "Time limit" in res.message else "node limit"
    label = f"milp, stopped at its {stopped}" if stopped else "milp"
    solution = _solution(problem, chosen, label, res.status == 0 and found <= OPTIMALITY_GAP, found, started)
    return dataclasses.replace(solution, stopped=stopped)


def _absolute_gap(queues: Sequence[Queue]) -> float:
    """Seconds within which an answer counts as optimal: ABSOLUTE_GAP_OF_SPAN of the queues' span."""
    return ABSOLUTE_GAP_OF_SPAN * max((max(q.capacity, default=0.0) for q in queues), default=0.0)


def min_peak(length, base, items) -> int:
    """The peak with every item on its first option (callers list the least-memory option first)."""
    return int(curve_with(length, base, items, [(i, 0) for i, opts in enumerate(items) if opts]).max(initial=0))


def solve(problem: SolverInput, *, solver: str = "auto", node_limit: int = NODE_LIMIT,
          time_limit: float = TIME_GUARD, accepted_gap: float = ACCEPTED_GAP) -> Solution:
    """Options so the curve stays within the problem's budget, and the options' host bytes within its
    host budget (None: unbounded), at least cost (see the module docstring). ``accepted_gap``: how close
    to the LP bound "auto" accepts an answer (greedy's, or branch and bound's, which stops there)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver: got {solver!r}; accepted: {', '.join(map(repr, SOLVERS))}")
    greedy = solve_greedy(problem) if solver in ("auto", "greedy") else None
    if solver == "greedy":
        return greedy
    if greedy is not None and not greedy.feasible and _proven_infeasible(problem):
        return greedy  # no exact search can meet the budget either
    if greedy is not None and greedy.feasible and greedy.cost > 0:
        # The LP relaxation bounds every answer from below: when greedy meets it,
        # greedy is optimal and the (slower) branch and bound is not needed.
        bound = lower_bound(problem)
        gap = max((greedy.cost - bound) / greedy.cost, 0.0)
        if gap <= accepted_gap:
            return dataclasses.replace(greedy, solver="greedy, LP-bounded", optimal=gap <= OPTIMALITY_GAP, gap=gap)
    elif greedy is not None and greedy.feasible:
        return dataclasses.replace(greedy, optimal=True, gap=0.0)  # zero cost cannot be beaten
    # "auto" stops the exact search within the gap it accepts of greedy: on the 7B graph, branch
    # and bound had not closed the last 0.5% after 30 s (measured); the answer it had by then cost
    # 0.07% less than the one within 1%.
    exact = solve_milp(problem, gap=accepted_gap if greedy else OPTIMALITY_GAP, node_limit=node_limit,
                       time_limit=time_limit)
    if greedy is None:
        return exact if exact is not None else solve_greedy(problem)
    if exact is not None and exact.feasible and (not greedy.feasible or exact.cost <= greedy.cost + 1e-12):
        return exact
    return greedy


def _proven_infeasible(problem: SolverInput) -> bool:
    """Whether some point stays above ``budget`` whatever is chosen: the base curve there less each
    item's largest saving at that point. A lower bound on every choice's curve, conflicts or not.
    (Greedy failing proves nothing when an item has several options: it may have taken one that
    frees less where the curve is still too high.)"""
    length = problem.length
    lowest = _curve(length, problem.base)
    for options in problem.items:
        if not options:
            continue
        savings = np.zeros((len(options), length), dtype=np.int64)
        for row, option in zip(savings, options):
            _apply(row, option)
        lowest += np.minimum(savings.min(axis=0), 0)
    return bool(lowest.size) and int(lowest.max()) > problem.budget
