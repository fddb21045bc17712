"""Checkpointed layers compiled one at a time, their inputs offloaded: the figures of issue 34.

    python benchmarks/layer_inputs.py              # simulated rows, then the measured FSDP2 run (2 processes)
    python benchmarks/layer_inputs.py --no-fsdp2   # simulated rows only

Simulated rows: one ``fxoffload plan --per-layer --checkpointing full --budget none --strategy offload``
run per preset and length (fake tensors, nothing allocated), on the ``h100-pcie5`` profile. Under full
checkpointing a layer saves only its input; the step's activation peak is the layer inputs held, and
the plan moves them to host memory. Peaks and overheads are **simulated** (memory model, roofline cost
model, step simulator); the overhead is against the same checkpointed step without offloading.

Measured row: ``examples/train_fsdp2.py --checkpoint`` under two gloo processes on this CPU (FSDP2 per
block, ``checkpoint_wrapper`` inside each compiled block, memory_budget 0.5 with the backend's default
options otherwise), against the same job compiled with ``aot_eager_decomp_partition``. CPU figures:
device and host are the same memory here, so they show the plan and its exactness, not a GPU's speed.
Writes its section of ``benchmarks/RESULTS.md`` and prints the rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

from results import write_section

ROOT = Path(__file__).resolve().parent.parent
RUNS = (("llama-2-7b", 4096), ("llama-3-8b", 8192), ("llama-3.1-8b", 32768), ("mistral-7b", 4096))
GIB = 2 ** 30
FSDP2 = ["--checkpoint", "--optimizer", "adamw", "--reference", "aot_eager_decomp_partition", "--check", "--measure",
         "--steps", "3", "--layers", "8", "--hidden", "128", "--vocab", "32", "--runs-per-step", "auto"]


def plan(preset: str, seq: int) -> dict:
    argv = [sys.executable, "-m", "fxoffload", "plan", "--preset", preset, "--seq", str(seq), "--batch", "1",
            "--dtype", "bf16", "--per-layer", "--checkpointing", "full", "--budget", "none", "--strategy", "offload",
            "--profile", "h100-pcie5", "--json", "--quiet", "--no-plot"]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout)


def simulated_row(preset: str, seq: int, report: dict) -> str:
    step = report["step"]
    before, after = step["activation_peak_before"], step["activation_peak_after"]
    inputs = step["invocations"]
    return (f"| {preset} | {seq} | {inputs} | {before / GIB:.2f} -> {after / GIB:.3f} GiB ({after / before:.3f}) | "
            f"{(before - after) / GIB:.2f} GiB | {step['overhead']:+.2%} | {step['crossing_copies']} | "
            f"{step['host_bytes'] / GIB:.2f} GiB |")


def fsdp2_lines() -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "examples" / "train_fsdp2.py"), *FSDP2]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"train_fsdp2.py failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    same = dict(re.findall(r"rank (\d): parameters after \d+ adamw steps bit-equal to \S+: (\w+)", run.stdout))
    peaks = re.findall(r"rank (\d): measured step activation peak (.*) with fxoffload, (.*) without \(([\d.]+)\)",
                       run.stdout)
    return [f"| {rank} | {same.get(rank)} | {with_} | {without} | {ratio} |" for rank, with_, without, ratio in peaks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fsdp2", action="store_true", help="skip the measured FSDP2 run")
    args = parser.parse_args()
    rows = []
    for preset, seq in RUNS:
        rows.append(simulated_row(preset, seq, plan(preset, seq)))
        print(rows[-1], flush=True)
    date = datetime.date.today().isoformat()
    text = [
        f"Written by `python benchmarks/layer_inputs.py{' --no-fsdp2' if args.no_fsdp2 else ''}` on {date}.",
        "",
        "Simulated (`h100-pcie5` profile, no GPU ran): `fxoffload plan --preset P --seq S --batch 1 --dtype bf16 "
        "--per-layer --checkpointing full --budget none --strategy offload`. Each decoder layer is checkpointed "
        "and compiled on its own, so each saves only its input; the step replays the decoder layers' runs "
        "(embedding, head and loss are outside the compiled graphs). Overhead: against the same checkpointed "
        "step without offloading. Saved: the step's activation peak before less after (the layer inputs moved).",
        "",
        "| preset | seq | layers | step activation peak | saved | step overhead | copies across | host memory |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    if not args.no_fsdp2:
        lines = fsdp2_lines()
        print("\n".join(lines))
        text += [
            "",
            "Measured on this CPU (2 gloo processes): `torchrun --standalone --nproc_per_node 2 "
            f"examples/train_fsdp2.py {' '.join(FSDP2)}`: an 8-layer Llama (hidden 128, vocabulary 32), "
            "`fully_shard` and non-reentrant `checkpoint_wrapper` per layer, each layer compiled with fxoffload at "
            "memory_budget 0.5 (other options the backend's defaults), against the same job compiled with "
            "`aot_eager_decomp_partition`. The step's activation peak is measured with `fxoffload.measure_peak` "
            "(embedding, head and FSDP2's buffers included).",
            "",
            "| rank | parameters bit-equal after 3 AdamW steps | measured step activation peak | without fxoffload "
            "| fraction |",
            "|---|---|---|---|---|",
            *lines,
        ]
    path = write_section("Checkpointed layers compiled one at a time: their inputs offloaded", "\n".join(text))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
