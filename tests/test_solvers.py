"""Solvers on plain numbers: hand-computed cases and properties (hypothesis)."""


import dataclasses
import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.offload_only import Candidate, choose_offloads, evaluate
from tests.offload_only import offload_greedy as solve_greedy
from tests.offload_only import offload_milp as solve_milp
from tests.offload_only import offload_min_peak as min_peak
from tests.offload_only import solve
from tests.offload_only import solve_greedy as greedy_options
from tests.offload_only import solve_milp as milp_options
from fxoffload.passes.solvers import (
    ABSOLUTE_GAP_OF_SPAN, OPTIMALITY_GAP, Option, Queue, SolverInput, _apply, _binding_slots, _conflicting, _curve,
    curve_with, lateness,
)
from fxoffload.passes.solvers import solve_greedy as solve_greedy_input


def three_layer():
    # Timeline of 10 positions; 10 bytes are fixed. Three residuals born at 0, 1, 2 and
    # last used (in reverse, as a backward does) at 9, 8, 7. Offloaded, each is released
    # right after its birth and prefetched at its last use.
    cands = [
        Candidate(100, (0, 9), ((0, 0), (9, 9)), cost=1.0),  # saves over 1..8
        Candidate(50, (1, 8), ((1, 1), (8, 8)), cost=0.5),  # saves over 2..7
        Candidate(50, (2, 7), ((2, 2), (7, 7)), cost=0.1),  # saves over 3..6
    ]
    return 10, [(0, 9, 10)], cands


def test_hand_computed_curves():
    length, fixed, cands = three_layer()
    assert list(evaluate(length, fixed, cands, ())) == [110, 160, 210, 210, 210, 210, 210, 210, 160, 110]
    assert list(evaluate(length, fixed, cands, (0,))) == [110, 60, 110, 110, 110, 110, 110, 110, 60, 110]
    assert list(evaluate(length, fixed, cands, (0, 1, 2))) == [110, 60, 60, 10, 10, 10, 10, 60, 60, 110]
    assert min_peak(length, fixed, cands) == 110


def test_exact_beats_greedy_where_cost_per_byte_misleads():
    length, fixed, cands = three_layer()
    # Budget 170 needs 40 bytes saved over 2..7: the third saves only 3..6, so it is
    # the first (cost 1.0) or the second (cost 0.5). Greedy ranks by cost per byte,
    # a tie (0.01 each) broken towards more bytes: the first. The exact answer: the second.
    greedy = solve_greedy(length, fixed, cands, 170)
    assert greedy.chosen == (0,) and greedy.cost == 1.0 and greedy.feasible
    exact = solve_milp(length, fixed, cands, 170, time_limit=5)
    assert exact.chosen == (1,) and exact.cost == 0.5 and exact.optimal and exact.peak == 160
    assert choose_offloads(length, fixed, cands, 170).chosen == (1,)


def test_auto_keeps_greedy_within_the_gap_its_caller_accepts():
    """``accepted_gap``: "auto" keeps greedy's answer when it is that close to the LP bound (max_overhead's
    probes accept 5%); within the usual 1% only, the exact answer replaces it."""
    from tests.offload_only import _general, solve

    length, fixed, cands = three_layer()
    base, items = _general(fixed, cands)
    usual = solve(length, base, items, 170)
    assert usual.cost == 0.5 and usual.solver.startswith("milp")  # greedy's 1.0 is 50% above the bound
    loose = solve(length, base, items, 170, accepted_gap=0.6)
    assert loose.cost == 1.0 and loose.solver == "greedy, LP-bounded" and 0.5 <= loose.gap <= 0.6


def test_only_one_choice_meets_a_tight_budget():
    length, fixed, cands = three_layer()
    # At position 1 only the first can save, and 160 - 100 = 60 <= 110; with it, 2..7 are at 110.
    result = choose_offloads(length, fixed, cands, 110)
    assert result.chosen == (0,) and result.peak == 110


def test_infeasible_budget_is_reported():
    length, fixed, cands = three_layer()
    result = choose_offloads(length, fixed, cands, 100)
    assert not result.feasible
    assert min_peak(length, fixed, cands) > 100


def test_nothing_needed_when_budget_is_large():
    length, fixed, cands = three_layer()
    result = choose_offloads(length, fixed, cands, 10**9)
    assert result.chosen == () and result.feasible and result.cost == 0


def test_unknown_solver_is_refused():
    with pytest.raises(ValueError, match="solver: got 'cplex'"):
        choose_offloads(1, [], [], 0, solver="cplex")


@st.composite
def problems(draw):
    length = draw(st.integers(4, 30))
    n = draw(st.integers(1, 8))
    cands = []
    for _ in range(n):
        birth = draw(st.integers(0, length - 2))
        death = draw(st.integers(birth + 1, length - 1))
        release = draw(st.integers(birth, death))
        prefetch = draw(st.integers(release, death))
        cands.append(Candidate(draw(st.integers(1, 100)), (birth, death), ((birth, release), (prefetch, death)),
                               draw(st.floats(0, 10, allow_nan=False))))
    fixed = [(0, length - 1, draw(st.integers(0, 50)))]
    budget = draw(st.integers(0, 600))
    return length, fixed, cands, budget


@settings(max_examples=60, deadline=None)
@given(problems())
def test_never_over_budget_when_feasible_and_exact_never_worse(problem):
    length, fixed, cands, budget = problem
    feasible = min_peak(length, fixed, cands) <= budget
    greedy = solve_greedy(length, fixed, cands, budget)
    assert greedy.feasible == feasible
    if feasible:
        assert evaluate(length, fixed, cands, greedy.chosen).max() <= budget
        exact = choose_offloads(length, fixed, cands, budget, solver="auto")
        assert exact.feasible and exact.peak <= budget
        assert exact.cost <= greedy.cost + 1e-9
        milp = solve_milp(length, fixed, cands, budget, time_limit=5)
        assert milp is not None and milp.feasible and milp.cost <= greedy.cost + 1e-6


def test_no_candidates_with_the_exact_solver():
    # Nothing can be offloaded and the fixed memory is over budget: an infeasible empty answer.
    result = choose_offloads(4, [(0, 3, 10)], [], 5, solver="milp")
    assert result.chosen == () and not result.feasible and result.peak == 10


# --------------------------------------------------------------------------- keep / offload / recompute form


def brute_force(length, base, items, budget, queues, conflicts, host_budget=None):
    """The least cost over every combination (keep = -1), or None when none fits."""
    best = None
    clash = {frozenset(c) for c in conflicts}
    for combo in itertools.product(*[range(-1, len(opts)) for opts in items]):
        chosen = [(i, o) for i, o in enumerate(combo) if o >= 0]
        if any(frozenset(p) in clash for p in itertools.combinations(chosen, 2)):
            continue
        if curve_with(length, base, items, chosen).max(initial=0) > budget:
            continue
        if host_budget is not None and sum(items[i][o].host for i, o in chosen) > host_budget:
            continue
        cost = sum(items[i][o].cost for i, o in chosen) + lateness(items, queues, chosen)
        best = cost if best is None else min(best, cost)
    return best


def test_lateness_by_hand():
    # One engine, two slots: 3 s of capacity for slot 0, 5 s for slots 0..1 together.
    queue = Queue((3.0, 5.0))
    items = [(Option((), 0.0, ((0, 0, 2.0),)),), (Option((), 0.0, ((0, 1, 2.0),)),), (Option((), 0.0, ((0, 0, 2.0),)),)]
    assert lateness(items, [queue], [(0, 0), (1, 0)]) == 0.0  # 2 <= 3, 4 <= 5
    assert lateness(items, [queue], [(0, 0), (2, 0)]) == 1.0  # 4 > 3 in slot 0
    assert lateness(items, [queue], [(0, 0), (1, 0), (2, 0)]) == 1.0  # max(4 - 3, 6 - 5)


def test_mixed_plan_beats_either_single_option_by_hand():
    # Two tensors of 100 B over 0..9 and 200 B fixed over 3..6; budget 250: both must leave
    # 1..8. Offloading one puts 4 s of copy on an engine with 5 s of room; offloading both
    # is 3 s late. Recomputing costs 2 s and 30 B of temporaries at 7. Best: offload one,
    # recompute the other (2 s); both offloaded cost 3 s, both recomputed 4 s.
    base = [(0, 9, 100), (0, 9, 100), (3, 6, 200)]

    def offload():
        return Option(((1, 8, -100),), 0.0, ((0, 0, 4.0),))

    def recompute():
        return Option(((1, 8, -100), (7, 7, 30)), 2.0)

    items = [(offload(), recompute()), (offload(), recompute())]
    queues = [Queue((5.0,))]
    result = solve(10, base, items, 250, queues, solver="milp")
    assert result.feasible and sorted(o for _, o in result.chosen) == [0, 1] and result.cost == 2.0
    only_offload = solve(10, base, [(offload(),), (offload(),)], 250, queues, solver="milp")
    only_recompute = solve(10, base, [(recompute(),), (recompute(),)], 250, queues, solver="milp")
    assert only_offload.cost == 3.0 and only_recompute.cost == 4.0
    assert solve(10, base, items, 250, queues).cost == 2.0  # "auto" finds it too


@st.composite
def option_problems(draw):
    length = draw(st.integers(4, 16))
    n = draw(st.integers(1, 4))
    base, items = [], []
    for _ in range(n):
        birth = draw(st.integers(0, length - 2))
        death = draw(st.integers(birth + 1, length - 1))
        nbytes = draw(st.integers(1, 100))
        base.append((birth, death, nbytes))
        options = []
        for _ in range(draw(st.integers(1, 2))):
            a = draw(st.integers(birth, death))
            b = draw(st.integers(a, death))
            changes = [(a, b, -nbytes)]
            if draw(st.booleans()):
                changes.append((b, b, draw(st.integers(1, 50))))  # a recomputation's temporaries
            work = ((0, draw(st.integers(0, 2)), draw(st.floats(0, 3))),) if draw(st.booleans()) else ()
            options.append(Option(tuple(changes), draw(st.floats(0, 5)), work))
        items.append(tuple(options))
    base.append((0, length - 1, draw(st.integers(0, 50))))
    pairs = [(i, o) for i, opts in enumerate(items) for o in range(len(opts))]
    conflicts = []
    if len(pairs) >= 2 and draw(st.booleans()):
        a, b = draw(st.sampled_from(list(itertools.combinations(pairs, 2))))
        if a[0] != b[0]:
            conflicts.append((a, b))
    queues = [Queue(tuple(sorted(draw(st.lists(st.floats(0, 4), min_size=3, max_size=3)))))]
    return length, base, items, draw(st.integers(0, 400)), queues, conflicts


def exact_within(items, best: float) -> float:
    """How far the exact program's cost may be from the least: float rounding, and HiGHS's own tolerance on
    costs scaled by the largest option's (``cost_unit``): with options of 2 s and 10 us, it returned the
    10 us one beside an answer costing nothing (found by hypothesis on 2026-12-04; with no 2 s option, or a
    1 ms one, it found the free answer)."""
    unit = max([o.cost for options in items for o in options] + [w[2] for options in items for o in options
                                                                  for w in o.work] + [0.0])
    return 1e-6 * max(1.0, best) + OPTIMALITY_GAP * unit


@settings(max_examples=80, deadline=None)
@given(option_problems())
def test_exact_program_matches_brute_force(problem):
    length, base, items, budget, queues, conflicts = problem
    best = brute_force(length, base, items, budget, queues, conflicts)
    exact = milp_options(length, base, items, budget, queues, conflicts, time_limit=5)
    if best is None:
        assert exact is None or not exact.feasible
        return
    assert exact is not None and exact.feasible and exact.peak <= budget
    # Within the absolute gap it stops at (a hundred-thousandth of the queues' span), and no further.
    assert abs(exact.cost - best) <= exact_within(items, best) + ABSOLUTE_GAP_OF_SPAN * max(queues[0].capacity)
    greedy = greedy_options(length, base, items, budget, queues, conflicts)
    chosen = solve(length, base, items, budget, queues, conflicts)
    assert chosen.feasible and chosen.cost <= (greedy.cost if greedy.feasible else math.inf) + 1e-9
    assert chosen.cost <= best * (1 + 1e-2) + 1e-9  # within the accepted gap of the optimum
    taken = {frozenset(p) for p in itertools.combinations(chosen.chosen, 2)}
    assert not any(frozenset(c) in taken for c in conflicts)
    assert len({i for i, _ in chosen.chosen}) == len(chosen.chosen)  # one option per item


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), min_size=1, max_size=8),
       st.lists(st.integers(0, 4), min_size=8, max_size=8))
def test_binding_slots_keep_every_queue_row_that_can_bind(work, capacity):
    """The rows the program keeps state the same lateness as a row per loaded slot, for any loads
    (small integer capacities, often equal, sometimes decreasing)."""
    load: dict[int, dict[int, float]] = {}
    for column, (slot, seconds) in enumerate(work):
        load.setdefault(slot, {})[column] = float(seconds)
    slots, steps = _binding_slots(load, capacity)
    assert slots == sorted(slots) and set(slots) <= set(load)
    every, running = [], 0.0
    for slot in sorted(load):
        running += sum(load[slot].values())
        every.append(running - capacity[slot])
    kept, running = [], 0.0
    for slot, step in zip(slots, steps):
        running += sum(step.values())
        kept.append(running - capacity[slot])
    assert max(kept) == max(every)
    assert running == sum(sum(v.values()) for v in load.values())  # no work dropped


def test_greedy_failing_with_several_options_is_not_taken_as_proof_of_infeasibility():
    """Hypothesis found it: greedy frees point 8 with the option that stops there, then cannot
    lower point 9; the item's other option frees both, and meets a budget of 0."""
    base = [(8, 9, 1), (0, 9, 0)]
    items = [(Option(((8, 8, -1),), 0.0), Option(((8, 9, -1),), 0.0))]
    assert not greedy_options(10, base, items, 0).feasible
    chosen = solve(10, base, items, 0, [Queue((0.0, 0.0, 0.0))])
    assert chosen.feasible and chosen.chosen == ((0, 1),) and chosen.peak == 0
    # A budget below what every choice leaves is still reported at once, without the exact search.
    assert solve(10, [(8, 9, 2)], items, 0).solver == "greedy"


@st.composite
def host_problems(draw):
    """``option_problems`` whose options also take host bytes, with a host budget."""
    length, base, items, budget, queues, conflicts = draw(option_problems())
    items = [tuple(dataclasses.replace(o, host=draw(st.integers(0, 100))) for o in options) for options in items]
    return length, base, items, budget, queues, conflicts, draw(st.integers(0, 250))


TINY_BESIDE_LARGE = (  # the example of exact_within: its one free answer saves 3 bytes at point 4
    6, [(0, 4, 71), (4, 5, 3), (0, 1, 1), (0, 1, 1), (0, 5, 0)],
    [(Option(((0, 0, -71),), 2.0), Option(((0, 4, -71),), 1e-5)),
     (Option(((4, 4, -3),), 0.0), Option(((4, 4, -3), (4, 4, 1)), 0.0)),
     (Option(((0, 0, -1),), 0.0),), (Option(((0, 0, -1),), 0.0),)],
    73, [Queue(capacity=(0.0, 0.0, 0.0))], [], 0)


@settings(max_examples=80, deadline=None)
@given(host_problems())
@example(TINY_BESIDE_LARGE)
def test_a_host_budget_bounds_every_solver_and_the_exact_one_matches_brute_force(problem):
    length, base, items, budget, queues, conflicts, host_budget = problem
    best = brute_force(length, base, items, budget, queues, conflicts, host_budget)
    exact = milp_options(length, base, items, budget, queues, conflicts, time_limit=5, host_budget=host_budget)
    for answer in (exact, greedy_options(length, base, items, budget, queues, conflicts, host_budget),
                   solve(length, base, items, budget, queues, conflicts, host_budget=host_budget)):
        if answer is not None and answer.feasible:
            assert answer.host == sum(items[i][o].host for i, o in answer.chosen) <= host_budget
            assert answer.peak <= budget
    if best is None:
        assert exact is None or not exact.feasible
        return
    assert exact is not None and exact.feasible and abs(exact.cost - best) <= exact_within(items, best)
    assert solve(length, base, items, budget, queues, conflicts,
                 host_budget=host_budget).cost <= best * (1 + 1e-2) + 1e-9


def test_a_host_budget_turns_an_offload_into_a_recomputation_by_hand():
    # One item of 100 bytes over 1..8, on 10 fixed bytes: offloading it (cheap, 60 host bytes) or
    # recomputing it (dear, no host bytes) saves all of it.
    base = [(1, 8, 100), (0, 9, 10)]
    items = [(Option(((1, 8, -100),), 1.0, host=60), Option(((1, 8, -100),), 5.0))]
    for solver in ("greedy", "milp", "auto"):
        assert solve(10, base, items, 50, solver=solver).chosen == ((0, 0),)
        capped = solve(10, base, items, 50, solver=solver, host_budget=59)
        assert capped.chosen == ((0, 1),) and capped.host == 0 and capped.cost == 5.0
        assert not solve(10, base, [items[0][:1]], 50, solver=solver, host_budget=59).feasible


def test_highs_options_are_used_only_where_highs_knows_them(monkeypatch):
    """MIP_OPTIONS go to HiGHS verbatim: a SciPy whose HiGHS lacks one would warn at every solve, so
    it plans without them (and without a warning)."""
    import warnings

    from fxoffload.passes import solvers

    solvers._mip_options.cache_clear()
    assert solvers._mip_options() == solvers.MIP_OPTIONS  # this SciPy's HiGHS knows them
    monkeypatch.setattr(solvers, "MIP_OPTIONS", {"no_such_highs_option": 1})
    solvers._mip_options.cache_clear()
    try:
        assert solvers._mip_options() == {}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            found = solvers.solve_milp(solvers.SolverInput(4, [(0, 3, 10)], [[solvers.Option(((0, 3, -6),), 1.0)]], 5))
        assert found.feasible and found.chosen == ((0, 0),)
    finally:
        solvers._mip_options.cache_clear()


def _reference_greedy(problem: SolverInput) -> tuple:
    """Greedy as first written, option by option in Python (the vectorised ``solve_greedy`` must choose
    what it chose, ties included): take, at the curve's peak, the option with the least cost per byte
    saved there, then the most bytes, then the first (item, option); then undo, costliest first, what
    the budget does not need."""
    items, budget = problem.items, problem.budget
    cur = _curve(problem.length, problem.base)
    clash = _conflicting(problem.conflicts)
    total = [[o.cost + sum(w[2] for w in o.work) for o in options] for options in items]
    host_left = math.inf if problem.host_budget is None else problem.host_budget
    chosen: dict[int, int] = {}
    while cur.size and cur.max() > budget:
        t = int(cur.argmax())
        taken = set(chosen.items())
        best, best_key = None, None
        for i, options in enumerate(items):
            if i in chosen:
                continue
            for o, option in enumerate(options):
                saved = -sum(d for a, b, d in option.changes if a <= t <= b)
                blocked = clash.get((i, o))
                if saved <= 0 or option.host > host_left or (blocked and not blocked.isdisjoint(taken)):
                    continue
                key = (total[i][o] / saved, -saved, i, o)
                if best_key is None or key < best_key:
                    best, best_key = (i, o), key
        if best is None:
            break
        chosen[best[0]] = best[1]
        host_left -= items[best[0]][best[1]].host
        _apply(cur, items[best[0]][best[1]])
    if cur.size and cur.max() <= budget:
        for i, o in sorted(chosen.items(), key=lambda p: -total[p[0]][p[1]]):
            _apply(cur, items[i][o], -1)
            if cur.max() <= budget:
                del chosen[i]
            else:
                _apply(cur, items[i][o])
    return tuple(sorted(chosen.items()))


@st.composite
def greedy_problems(draw):
    """``host_problems`` with ties made likely (costs from a few values, equal sizes) and more conflicts,
    with or without a host budget."""
    length, base, items, budget, queues, conflicts, host_budget = draw(host_problems())
    tie = draw(st.booleans())
    items = [tuple(dataclasses.replace(o, cost=draw(st.sampled_from([0.0, 1.0, 2.0])) if tie else o.cost)
                   for o in options) for options in items]
    pairs = [(i, o) for i, opts in enumerate(items) for o in range(len(opts))]
    for a, b in itertools.combinations(pairs, 2):
        if a[0] != b[0] and draw(st.integers(0, 4)) == 0:
            conflicts.append((a, b))
    return SolverInput(length, base, items, budget, queues, conflicts,
                       host_budget if draw(st.booleans()) else None)


@settings(max_examples=300, deadline=None)
@given(greedy_problems())
def test_greedy_chooses_what_the_option_by_option_greedy_chooses(problem):
    assert solve_greedy_input(problem).chosen == _reference_greedy(problem)
