"""Compile time of the passes on a whole 7B-class graph, as a user meets it: cold, one process per run.

Runs ``fxoffload plan --preset llama-2-7b --budget 0.5 --strategy auto --json``
(``--preset``: another of the CLI's presets; the CLI's defaults otherwise: the model's sequence
length up to 4096, batch 1, bf16, ``min_bytes`` 64 KiB, ``h100-pcie5``) in a fresh process
``--runs`` times, then ``--module-runs`` times as ``python -m fxoffload plan``, then ``--busy-runs``
times while another process keeps one core busy (a Python loop). For each run it
prints the wall time of fxoffload's passes split by stage (measured on this machine), with the
plan's digest and its predicted step overhead (simulated on the profile, not measured). The digests
must agree: the plan may not depend on the machine's load. ``--write`` puts the table into
``benchmarks/RESULTS.md``.

    python benchmarks/compile_time.py [--runs 3] [--module-runs 1] [--busy-runs 1] [--preset llama-2-7b]
                                      [--budget 0.5] [--strategy auto] [--write]
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

# Two ways in: the console script's (``fxoffload plan``), and ``python -m fxoffload plan``, which ran
# the passes a fifth to twice as slow on this machine (2026-11-24 to 11-27): its stack is a few frames
# deeper, and PyTorch's recompute-only partition then met the end of a chunk of Python's frame stack
# at a hot loop (found 2026-11-28; ``fxoffload.backend.partition.with_stack_headroom`` gives it room since).
LAUNCHERS = {
    "fxoffload": [sys.executable, "-c", "import sys; from fxoffload.tools.cli import main; sys.exit(main())"],
    "python -m fxoffload": [sys.executable, "-m", "fxoffload"],
}
LAUNCHERS["fxoffload, one core busy"] = LAUNCHERS["fxoffload"]
SPIN = [sys.executable, "-c", "while True: pass"]
# Why a preset's plan digest (budget 0.5, strategy auto) last changed: a change that alters the plan says so here.
DIGEST_CHANGES = {
    "llama-2-7b": "Digest d17a3fa4b3a79cb1 until 2026-11-28; 79b7f30520437714 since HiGHS's RINS heuristic is off "
                  "(`passes.solvers.MIP_OPTIONS`; `benchmarks/solver_corpus.py` times seven 7B-class programs under "
                  "it): the same predicted step (+3.9%), peaks, transfers and recomputations in number and offloaded "
                  "bytes, and the same solver gap (0.46%), a tie broken otherwise; the plan stage 1.13-1.17 s -> "
                  "0.90-0.95 s (its joint program 0.72 s -> 0.57 s). ac28da317ab3d8a6 since 2026-12-06: "
                  "`fxoffload plan` traces four layers and copies the joint graph's "
                  "(`tracing.trace_copying_layers`), whose nodes FX names otherwise; the plan is the same, each "
                  "decision, copy and place by its position in the graph, and every figure of the report (checked "
                  "against `--trace-every-layer`, which still gives 79b7f30520437714).",
    "gpt2-xl": "Digest 613f8a991270b2db since 2026-12-06 (3a88eefff56a0c1f before): `fxoffload plan` traces four "
               "layers and copies the joint graph's, whose nodes FX names otherwise; the plan is the same by "
               "position and every figure of the report (checked against `--trace-every-layer`, which still "
               "gives 3a88eefff56a0c1f).",
}


def one_run(launcher: str, preset: str, budget: str, strategy: str) -> dict:
    args = ["plan", "--preset", preset, "--budget", budget, "--strategy", strategy, "--json", "--no-plot"]
    spin = subprocess.Popen(SPIN) if launcher.endswith("busy") else None
    try:
        done = subprocess.run(LAUNCHERS[launcher] + args, capture_output=True, text=True)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    if done.returncode:
        raise SystemExit(f"fxoffload {' '.join(args)} failed:\n{done.stderr}")
    report = json.loads(done.stdout)
    graph, = report["graphs"]
    return {"passes": report["seconds"]["fxoffload_passes"], "stages": report["seconds"]["fxoffload_stages"],
            "trace_and_plan": report["seconds"]["trace_and_plan"], "digest": graph["plan_digest"],
            "overhead": graph["overhead"], "partition": graph["partition"],
            "within": graph["within_budget"], "launcher": launcher}


def table(runs: list[dict]) -> list[str]:
    stages = list(runs[0]["stages"])
    lines = ["| run | command | passes (s) | " + " | ".join(stages) + " | trace and plan (s) | plan digest | "
             "overhead (simulated) |",
             "|---" * (len(stages) + 6) + "|"]
    for k, run in enumerate(runs, 1):
        lines.append(f"| {k} | `{run['launcher']}` | **{run['passes']:.2f}** | "
                     + " | ".join(f"{run['stages'][s]:.2f}" for s in stages)
                     + f" | {run['trace_and_plan']:.1f} | `{run['digest']}` | {run['overhead']:+.1%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="cold runs of fxoffload plan (default 3)")
    parser.add_argument("--module-runs", type=int, default=1, help="then cold runs of python -m fxoffload plan")
    parser.add_argument("--busy-runs", type=int, default=1,
                        help="then cold runs of fxoffload plan with another process keeping one core busy")
    parser.add_argument("--preset", default="llama-2-7b", help="a model preset of fxoffload plan")
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--write", action="store_true", help="also write the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    runs = []
    launchers = (["fxoffload"] * args.runs + ["python -m fxoffload"] * args.module_runs
                 + ["fxoffload, one core busy"] * args.busy_runs)
    for launcher in launchers:
        runs.append(one_run(launcher, args.preset, args.budget, args.strategy))
        print(f"run {len(runs)} ({launcher}): passes {runs[-1]['passes']:.2f} s", file=sys.stderr)
    median = statistics.median(run["passes"] for run in runs if run["launcher"] == "fxoffload")
    plan_median = statistics.median(run["stages"]["plan"] for run in runs if run["launcher"] == "fxoffload")
    digests = {run["digest"] for run in runs}
    lines = table(runs) + [
        "",
        f"Median of the passes: **{median:.2f} s**, of its plan stage **{plan_median:.2f} s**, over {args.runs} "
        f"cold runs of `fxoffload plan` ({os.cpu_count()} cores); partition chosen: {runs[0]['partition']}; "
        f"within the budget: {all(run['within'] for run in runs)}; the same plan every run (one core busy or not): "
        f"{len(digests) == 1}.",
    ]
    print("\n".join(lines))
    if len(digests) != 1:
        raise SystemExit(f"the runs made different plans: {sorted(digests)}")
    if args.write:
        command = "python benchmarks/compile_time.py " + " ".join(sys.argv[1:])
        body = (f"{datetime.date.today()}, `{command}`: `fxoffload plan --preset {args.preset} "
                f"--budget {args.budget} --strategy {args.strategy} --json`, each run in a fresh process. Seconds "
                "are wall time measured on this machine; the overhead is the step's, simulated on h100-pcie5 "
                "(not measured). \"repartition (PyTorch)\" is PyTorch's recompute-only partitioner, run as one "
                "of strategy auto's alternatives." + (f" {DIGEST_CHANGES[args.preset]}" if args.preset in DIGEST_CHANGES
                                                        else "") + "\n\n" + "\n".join(lines))
        heading = f"Compile time: {args.preset}, budget {args.budget}, strategy {args.strategy} (measured, CPU)"
        print(f"wrote {write_section(heading, body)}")


if __name__ == "__main__":
    main()
