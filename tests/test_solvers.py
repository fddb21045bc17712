"""Solvers on plain numbers: hand-computed cases and properties (hypothesis)."""


import pytest
from hypothesis import given, settings, strategies as st

from passes.solvers import Candidate, choose_offloads, evaluate, min_peak, solve_greedy, solve_milp


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
