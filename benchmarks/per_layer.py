"""One graph per layer against the whole step as one graph: the 7B presets, simulated.

    python benchmarks/per_layer.py                 # 3 presets x (3 per-layer + 2 whole-step plans)
    python benchmarks/per_layer.py --no-whole      # per-layer rows only (seconds, not minutes)

Each row is one ``fxoffload plan`` run (fake tensors, nothing allocated) at batch 1 x 4096, bf16,
budget 0.5, on the ``h100-pcie5`` profile. Per-layer rows compile each decoder layer on its own
(``--per-layer``: ``runs_per_step`` = the number of layers) and replay the step of every layer's
run; whole-step rows compile the step as one graph. Overheads and peaks are **simulated**
(memory model, roofline cost model, simulators); only the planning seconds are measured, here.
Writes ``benchmarks/RESULTS.md`` (the per-layer section) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time

from results import write_section

PRESETS = ("llama-2-7b", "llama-3-8b", "mistral-7b")
PER_LAYER = (("per layer, auto", ["--per-layer"]),
             ("per layer, offload", ["--per-layer", "--strategy", "offload"]),
             ("per layer, offload, no crossing", ["--per-layer", "--strategy", "offload", "--no-cross-graphs"]))
WHOLE = (("whole step, auto", []), ("whole step, offload", ["--strategy", "offload"]))
GIB = 2 ** 30


def plan(preset: str, extra: list[str]) -> tuple[dict, float]:
    argv = [sys.executable, "-m", "fxoffload", "plan", "--preset", preset, "--seq", "4096", "--batch", "1",
            "--dtype", "bf16", "--budget", "0.5", "--profile", "h100-pcie5", "--json", "--quiet", "--no-plot", *extra]
    start = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(run.stdout), time.perf_counter() - start


def row(preset: str, label: str, report: dict, seconds: float) -> str:
    step = report["step"]
    within = "within" if step["within_budget"] else "**over**"
    return (f"| {preset} | {label} | {step['invocations']} | {step['overhead']:+.1%} | "
            f"{step['activation_peak_before'] / GIB:.1f} -> {step['activation_peak_after'] / GIB:.1f} GiB "
            f"({within} {step['budget_bytes'] / GIB:.1f} GiB) | {step['crossing_copies']} | {seconds:.0f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-step rows (minutes each)")
    args = parser.parse_args()
    rows = []
    for preset in PRESETS:
        for label, extra in PER_LAYER + (() if args.no_whole else WHOLE):
            report, seconds = plan(preset, extra)
            rows.append(row(preset, label, report, seconds))
            print(rows[-1], flush=True)
    date = datetime.date.today().isoformat()
    text = "\n".join([
        f"Written by `python benchmarks/per_layer.py{' --no-whole' if args.no_whole else ''}` on {date}. Batch 1 x "
        "4096, bf16, budget 0.5 (of the step's activation peak without offloading), `h100-pcie5` profile. "
        "Overheads and peaks are **simulated** (no GPU ran); the last column is this machine's wall time for "
        "the `fxoffload plan` run, measured. Per-layer steps replay the decoder layers' runs only (embedding, "
        "head and loss are outside the compiled graphs), the hidden state each layer saves (its input, made "
        "by the layer before) included; whole-step rows are one graph of everything. \"copies across\" counts "
        "copies that crossed a graph boundary (deferred releases and copies started ahead).",
        "",
        "| preset | plan | graph runs | step overhead | step activation peak (budget) | copies across | plan time |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(f"wrote {write_section('One graph per layer against the whole step (simulated)', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
