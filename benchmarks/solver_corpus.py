"""The planner's exact programs, kept and timed under HiGHS options (issue 52: planning in seconds).

    python benchmarks/solver_corpus.py dump DIR -- --preset llama-2-7b --batch 1 --seq 4096 --dtype bf16 \\
        --profile h100-pcie5 --budget 0.5
    python benchmarks/solver_corpus.py time DIR [DIR ...] --options "{}" \\
        --options "{'mip_heuristic_run_rins': False}"

``dump`` runs ``fxoffload plan`` with the given flags in this process and writes every program the exact
solver is handed (``passes.solvers.solve_milp``: its ``SolverInput`` and limits, a pickle each, in the
order solved) to DIR. ``time`` solves each kept program again under ``passes.solvers.MIP_OPTIONS``
updated with each ``--options`` mapping (a Python literal), and prints per option set and program the
wall seconds (measured, this machine) and the answer's cost (the solver's objective, seconds
predicted): so that a change of HiGHS options is judged on many programs at once, not on the one
that prompted it. The programs are plain numbers (no FX graph); they hold the shapes of the model
they came from.
"""

from __future__ import annotations

import argparse
import ast
import pickle
import sys
import time
from pathlib import Path

from fxoffload.passes import solvers
from fxoffload.tools.cli import main as fxoffload_main


def dump(folder: Path, plan_args: list[str]) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    original, count = solvers.solve_milp, [0]

    def kept(problem, **limits):
        with open(folder / f"program-{count[0]:02d}.pkl", "wb") as f:
            pickle.dump((problem, limits), f)
        count[0] += 1
        return original(problem, **limits)

    solvers.solve_milp = kept  # solve() looks it up in its module at each call
    try:
        status = fxoffload_main(["plan", *plan_args, "--json", "--no-plot"])
    finally:
        solvers.solve_milp = original
    print(f"kept {count[0]} program(s) in {folder}", file=sys.stderr)
    return status or 0


def time_programs(folders: list[Path], option_sets: list[dict]) -> list[dict]:
    """Per option set and program: seconds (measured) and cost (predicted seconds) of ``solve_milp``."""
    programs = [path for folder in folders for path in sorted(folder.glob("program-*.pkl"))]
    default = dict(solvers.MIP_OPTIONS)
    rows = []
    try:
        for options in option_sets:
            solvers.MIP_OPTIONS.clear()
            solvers.MIP_OPTIONS.update({**default, **options})
            solvers._mip_options.cache_clear()
            for path in programs:
                with open(path, "rb") as f:
                    problem, limits = pickle.load(f)
                start = time.perf_counter()
                answer = solvers.solve_milp(problem, **limits)
                rows.append({"options": options, "program": str(path), "items": len(problem.items),
                             "seconds": time.perf_counter() - start,
                             "cost": None if answer is None else answer.cost,
                             "gap": None if answer is None else answer.gap})
    finally:
        solvers.MIP_OPTIONS.clear()
        solvers.MIP_OPTIONS.update(default)
        solvers._mip_options.cache_clear()
    return rows


def _options(text: str) -> dict:
    value = ast.literal_eval(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--options: got {text!r}; accepted: a mapping such as "
                                         "\"{'presolve': 'on'}\"")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["dump"]:
        if len(argv) < 3 or argv[2] != "--":
            raise SystemExit("usage: solver_corpus.py dump DIR -- FXOFFLOAD_PLAN_FLAGS ...")
        return dump(Path(argv[1]), argv[3:])
    parser = argparse.ArgumentParser(description="time kept exact programs under HiGHS options")
    parser.add_argument("command", choices=["time"])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--options", type=_options, action="append", default=None,
                        help="HiGHS options added to MIP_OPTIONS (a Python mapping); repeat to compare")
    args = parser.parse_args(argv)
    rows = time_programs(args.folders, args.options or [{}])
    for row in rows:
        cost = "none" if row["cost"] is None else f"{row['cost'] * 1e3:.6f} ms"
        print(f"{row['options']!s:50} {row['program']:50} {row['items']:4d} items  {row['seconds']:6.3f} s  {cost}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
