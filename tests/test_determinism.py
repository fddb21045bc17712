"""Deterministic plans: the same graph and options give the same plan, named by its digest
(``fxoffload.passes.scheduling.plan_digest``), in every process and under any load; a different rewrite gives
another digest."""

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fxoffload
from fxoffload.passes import plan_digest
from fxoffload.passes.solvers import Option, Queue
from tests.offload_only import solve_milp
from tests.conftest import compile_mlp  # the golden MLP, compiled with min_bytes=0

ROOT = Path(__file__).resolve().parent.parent

# A process of its own compiles a tiny Llama at budget 0.5 (strategy offload, through the exact
# solver) and prints each digest. (Under strategy auto, PyTorch's recompute-only partition wins here.)
PLAN_IN_A_PROCESS = """
import torch, fxoffload
from fxoffload.passes import plan_digest
from tests.conftest import lm_step, tiny_llama
torch.manual_seed(0)
backend = fxoffload.offload_backend(inner="eager", min_bytes=0, memory_budget=0.5, strategy="offload",
                                    solver="milp")
lm_step(torch.compile(tiny_llama().train(), backend=backend), torch.randint(0, 128, (2, 32)))
for record in backend.records:
    print(plan_digest(record.plan, record.schedule), len(record.plan.transfers), len(record.plan.recomputes))
"""


def digests_in_a_process(hash_seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    run = subprocess.run([sys.executable, "-c", PLAN_IN_A_PROCESS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split("\n")


@contextlib.contextmanager
def busy_cpu():
    """Every core spinning in another process, as a loaded machine (or a rank's neighbours) is."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


# Slow (two cold processes, 23 s): that a plan ignores the machine's load is the solver's doing
# (SciPy's HiGHS under a node limit), not the torch release's; the full suite (torch 2.13) runs it.
@pytest.mark.slow
def test_two_processes_make_the_same_plan_one_of_them_on_a_busy_cpu():
    """Two processes (as two ranks are), with different string hashing, one beside a busy CPU,
    plan the same graph alike."""
    first = digests_in_a_process("1")
    with busy_cpu():
        second = digests_in_a_process("2")
    assert first == second
    digest, transfers, recomputes = first[0].split()
    assert int(transfers) + int(recomputes) > 0  # a plan that moves something, not an empty one


def test_the_digest_names_what_the_rewrite_does():
    everything, half = compile_mlp(), compile_mlp(memory_budget=0.95, strategy="offload")
    digest = plan_digest(everything.plan, everything.schedule)
    text = fxoffload.explain(everything)
    assert digest in text and "passes took" in text and ", plan " in text  # and the stages' wall times
    assert digest != plan_digest(half.plan, half.schedule)  # fewer copies
    # One copy's wait one node earlier is another rewrite.
    placement = everything.schedule.placements[0]
    nodes = list(placement.wait_before.graph.nodes)
    moved = dataclasses.replace(placement, wait_before=nodes[nodes.index(placement.wait_before) - 1])
    schedule = dataclasses.replace(everything.schedule, placements=(moved, *everything.schedule.placements[1:]))
    assert plan_digest(everything.plan, schedule) != digest
    # Predictions are not part of it: the same rewrite with other predicted times.
    timed = dataclasses.replace(placement, h2d_seconds=placement.h2d_seconds + 1.0)
    schedule = dataclasses.replace(everything.schedule, placements=(timed, *everything.schedule.placements[1:]))
    assert plan_digest(everything.plan, schedule) == digest


def hard_program(seed: int = 1, items: int = 200, length: int = 400):
    """A program that branch and bound does not close in 100 nodes (about 1 s here): 200 saved
    tensors over 400 points, each offloaded (copy work on one engine) or recomputed (temporaries),
    under 55% of the unplanned peak."""
    rng = np.random.default_rng(seed)
    base, options, curve = [], [], np.zeros(length, dtype=np.int64)
    for _ in range(items):
        birth, death = int(rng.integers(0, length // 2)), int(rng.integers(length // 2, length))
        nbytes = int(rng.integers(50, 150))
        base.append((birth, death, nbytes))
        curve[birth : death + 1] += nbytes
        start, end = int(rng.integers(birth, (birth + death) // 2)), int(rng.integers((birth + death) // 2, death + 1))
        copy = ((0, int(rng.integers(0, 8)), float(rng.uniform(0.1, 1.0))),)
        options.append((Option(((start, end, -nbytes),), float(rng.uniform(0.5, 2.0)), copy),
                        Option(((start, end, -nbytes), (end, end, int(rng.integers(1, 30)))),
                               float(rng.uniform(0.5, 3.0)))))
    engine = Queue(tuple(np.cumsum(rng.uniform(0.5, 1.5, 8))))
    return length, base, options, int(curve.max() * 0.55), [engine]


def test_a_busy_cpu_does_not_change_where_the_exact_search_stops():
    """The exact search stops at a count of nodes, not at a time: beside a busy CPU it returns the
    same answer with the same gap. (Stopped by a 0.6 s clock instead, the busy run explored fewer
    nodes and returned another answer, or another gap.)"""
    problem = hard_program()
    quiet = solve_milp(*problem, node_limit=100)
    with busy_cpu():
        busy = solve_milp(*problem, node_limit=100)
    assert quiet.stopped == busy.stopped == "node limit"  # cut short, so where it stops matters
    assert (busy.chosen, busy.gap, busy.cost) == (quiet.chosen, quiet.gap, quiet.cost)


def test_what_the_solver_library_prints_does_not_reach_stdout_and_its_debug_line_is_dropped(capfd):
    """HiGHS prints a debug line on file descriptor 1 for some programs; ``fxoffload plan --json``
    writes its JSON there. The solver's calls hand what reaches descriptor 1 meanwhile to stderr,
    less that line (HiGHS 1.12's, word for word)."""
    from fxoffload.passes.solvers import _stdout_to_stderr

    print("before", flush=True)
    with _stdout_to_stderr():
        os.write(1, b"from C code\n")
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        os.write(1, b"more from C code\n")
    print("after", flush=True)
    captured = capfd.readouterr()
    assert captured.out == "before\nafter\n"
    assert captured.err == "from C code\nmore from C code\n"


def test_without_a_writable_temporary_directory_the_solver_still_keeps_stdout_clean(capfd, monkeypatch, tmp_path):
    """Where no temporary file can be made, descriptor 1 points at stderr during the solve: the
    JSON on stdout stays clean (HiGHS's lines reach stderr unfiltered), no descriptor is left open,
    and the solve is not refused."""
    import tempfile

    from fxoffload.passes.solvers import _stdout_to_stderr

    open_before = sorted(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    print("before", flush=True)
    with monkeypatch.context() as patch:  # only here: pytest's own capture makes temporary files
        patch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
        with _stdout_to_stderr():
            os.write(1, b"from C code\n")
    print("after", flush=True)
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("before\nafter\n", "from C code\n")
    if open_before is not None:
        assert sorted(os.listdir("/proc/self/fd")) == open_before


def test_the_mismatch_error_groups_the_ranks_by_the_plan_they_made():
    """What a job of four ranks, one of them planning differently, is told (the 2-process gloo test
    in test_distributed.py raises it for real)."""
    error = fxoffload.PlanMismatchError({0: (3, "aaaa"), 1: (3, "bbbb"), 2: (3, "aaaa"), 3: (3, "aaaa")})
    assert "(ranks 0, 2, 3: graph 3, plan digest aaaa; rank 1: graph 3, plan digest bbbb)" in str(error)
    assert error.digests[1] == (3, "bbbb")
