"""benchmarks/solver_corpus.py keeps the exact programs a plan solves and times them under HiGHS options:
the kept programs solve again to the planner's answers, an option set reaches HiGHS, and the solver's
options are as before afterwards."""

import sys
from pathlib import Path

import pytest

from fxoffload.passes import solvers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import solver_corpus  # noqa: E402

PLAN = ["--preset", "llama-2-7b", "--layers", "2", "--batch", "1", "--seq", "256", "--dtype", "bf16",
        "--profile", "h100-pcie5", "--budget", "0.3", "--strategy", "offload", "--quiet"]


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("programs")
    answers = []
    original = solvers.solve_milp

    def noted(problem, **limits):  # what the planner's own solves answered
        answer = original(problem, **limits)
        answers.append(None if answer is None else answer.cost)
        return answer

    solvers.solve_milp = noted
    try:
        assert solver_corpus.dump(folder, PLAN) == 0
    finally:
        solvers.solve_milp = original
    return folder, answers


def test_kept_programs_solve_again_to_the_planners_answers(kept):
    folder, answers = kept
    rows = solver_corpus.time_programs([folder], [{}])
    assert answers and [row["cost"] for row in rows] == answers


def test_an_option_set_reaches_highs_and_the_options_are_restored(kept):
    folder, answers = kept
    before = dict(solvers.MIP_OPTIONS)
    rows = solver_corpus.time_programs([folder], [{}, {"time_limit": 0.0}])
    assert dict(solvers.MIP_OPTIONS) == before
    halted = rows[len(rows) // 2:]
    assert all(row["cost"] is None or row["gap"] != 0 for row in halted), halted  # stopped at once
    assert [row["cost"] for row in rows[:len(rows) // 2]] == answers
