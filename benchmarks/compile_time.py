"""Compile time of the passes on the whole Llama-2-7B graph, as a user meets it: cold, one process per run.

Runs ``fxoffload plan --preset llama-2-7b --seq 4096 --budget 0.5 --strategy auto --json``
(the CLI's defaults otherwise: bf16, ``min_bytes`` 64 KiB, ``h100-pcie5``) in a fresh
process ``--runs`` times and prints, for each run, the wall time of fxoffload's passes split
by stage (measured on this machine), with the plan's digest and its predicted step overhead
(simulated on the profile, not measured). The digests must agree: the plan may not depend on
the machine's load. ``--write`` puts the table into ``benchmarks/RESULTS.md``.

    python benchmarks/compile_time.py [--runs 3] [--budget 0.5] [--strategy auto] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import write_section  # noqa: E402

# The console script's way in (``fxoffload plan``): ``python -m fxoffload`` ran these passes about a
# third slower on this machine (2026-11-24), for a reason not found.
CLI = [sys.executable, "-c", "import sys; from fxoffload.cli import main; sys.exit(main())"]


def one_run(budget: str, strategy: str) -> dict:
    args = ["plan", "--preset", "llama-2-7b", "--seq", "4096", "--budget", budget, "--strategy", strategy,
            "--json", "--no-plot"]
    done = subprocess.run(CLI + args, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    graph, = report["graphs"]
    return {"passes": report["seconds"]["fxoffload_passes"], "stages": report["seconds"]["fxoffload_stages"],
            "trace_and_plan": report["seconds"]["trace_and_plan"], "digest": graph["plan_digest"],
            "overhead": graph["overhead"], "partition": graph["partition"],
            "within": graph["within_budget"]}


def table(runs: list[dict]) -> list[str]:
    stages = list(runs[0]["stages"])
    lines = ["| run | passes (s) | " + " | ".join(stages) + " | trace and plan (s) | plan digest | "
             "overhead (simulated) |",
             "|---" * (len(stages) + 5) + "|"]
    for k, run in enumerate(runs, 1):
        lines.append(f"| {k} | **{run['passes']:.2f}** | " + " | ".join(f"{run['stages'][s]:.2f}" for s in stages)
                     + f" | {run['trace_and_plan']:.1f} | `{run['digest']}` | {run['overhead']:+.1%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--write", action="store_true", help="also write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    runs = []
    for k in range(args.runs):
        runs.append(one_run(args.budget, args.strategy))
        print(f"run {k + 1}: passes {runs[-1]['passes']:.2f} s", file=sys.stderr)
    median = statistics.median(run["passes"] for run in runs)
    digests = {run["digest"] for run in runs}
    lines = table(runs) + [
        "",
        f"Median of the passes: **{median:.2f} s** over {len(runs)} cold runs "
        f"({os.cpu_count()} cores); partition chosen: {runs[0]['partition']}; within the budget: "
        f"{all(run['within'] for run in runs)}; the same plan every run: {len(digests) == 1}.",
    ]
    print("\n".join(lines))
    if len(digests) != 1:
        raise SystemExit(f"the runs made different plans: {sorted(digests)}")
    if args.write:
        command = "python benchmarks/compile_time.py " + " ".join(sys.argv[1:])
        body = (f"{datetime.date.today()}, `{command}`: `fxoffload plan --preset llama-2-7b --seq 4096 "
                f"--budget {args.budget} --strategy {args.strategy} --json`, each run in a fresh process. Seconds "
                "are wall time measured on this machine; the overhead is the step's, simulated on h100-pcie5 "
                "(not measured). \"repartition (PyTorch)\" is PyTorch's recompute-only partitioner, run as one "
                "of strategy auto's alternatives.\n\n" + "\n".join(lines))
        heading = f"Compile time: Llama-2-7B, budget {args.budget}, strategy {args.strategy} (measured, CPU)"
        print(f"wrote {write_section(heading, body)}")


if __name__ == "__main__":
    main()
