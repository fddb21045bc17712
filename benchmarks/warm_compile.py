"""Compile time again in a new process: Inductor's FX graph cache, plain compile and fxoffload, on this CPU.

    python benchmarks/warm_compile.py            # prints the table
    python benchmarks/warm_compile.py --write    # its section of benchmarks/RESULTS.md (about 2 minutes)

A small Llama (``--layers`` decoder layers of ``--hidden``, ``--seq`` tokens; ``examples/llama_layers``) is
compiled whole by Inductor, plain and under fxoffload (budget 0.5, strategy offload, ``min_bytes=0``, so that
this small model has transfers), and one training step runs. Each way gets a fresh Inductor cache folder
(``TORCHINDUCTOR_CACHE_DIR``) and runs twice, each in a fresh process: cold, then warm (what a restarted job
meets). Per graph, the seconds in ``compile_fx_inner`` (Inductor's lowering, code generation and the C++
compiler; measured by Dynamo's own timer, ``compilation_time_metrics``) and the FX graph cache's hits,
misses and bypasses. Until 2026-12-06 every graph of fxoffload's bypassed the cache (``control_deps``, our
ordering edges, is not marked cacheable; ``fxoffload.backend.fusion_distance.cached_under_our_source``):
the last way, "bypassed as before", runs fxoffload so. Then, until later that day, a forward whose offloads
the backward prefetches was lowered in every process, its lowering telling the prefetches the strides its
offloads write; now a forward handed back from the cache tells them through its code
(``ordering.layouts_from_code``). The third way, "forward lowered in each process", runs fxoffload as in
between (as under a C++ wrapper now: ``backend._no_python_wrapper``).
The C++ compiler's outputs are cached by their source either way: a warm run's graph that misses the FX
graph cache still skips it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples"), str(ROOT)]

HEADING = "Compile time again in a new process: Inductor's FX graph cache (measured, CPU)"
LOWERED, BYPASSED = "fxoffload, forward lowered in each process", "fxoffload, bypassed as before"
WAYS = ("plain", "fxoffload", LOWERED, BYPASSED)
CACHE = ("hit", "miss", "bypass")


def child(way: str, layers: int, hidden: int, seq: int) -> dict:
    """One cold or warm process: compile the model under ``way``, run one step, say what the compile took."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    import fxoffload
    from llama_layers import LlamaShape, LlamaStack

    shape = LlamaShape(layers=layers, hidden=hidden, heads=4, kv_heads=2, ffn=hidden * 11 // 4, vocab=512)
    torch.manual_seed(0)
    model = LlamaStack(shape)
    tokens = torch.randint(0, shape.vocab, (1, seq))
    if way == BYPASSED:  # what fxoffload did before 2026-12-06: control_deps unmarked
        import contextlib

        import fxoffload.backend

        fxoffload.backend.cached_under_our_source = lambda gm: contextlib.nullcontext()
    if way == LOWERED:  # what it did later that day: a forward of paired offloads kept out of the cache
        import fxoffload.backend

        fxoffload.backend._no_python_wrapper = lambda kwargs: True
    backend = "inductor" if way == "plain" else fxoffload.offload_backend(
        inner="inductor", memory_budget=0.5, strategy="offload", min_bytes=0)
    start = time.perf_counter()
    torch.compile(model, backend=backend)(tokens).float().square().sum().backward()
    step = time.perf_counter() - start
    return {"graphs": [round(s, 2) for s in compilation_time_metrics.get("compile_fx_inner", [])],
            "cache": {name: counters["inductor"][f"fxgraph_cache_{name}"] for name in CACHE},
            "first_step_s": round(step, 2),
            "transfers": None if way == "plain" else len(backend.records[0].plan.transfers)}


def measure(args: argparse.Namespace) -> list[dict]:
    """Each way cold then warm, each run a fresh process over the way's own fresh cache folder."""
    rows = []
    for way in WAYS:
        with tempfile.TemporaryDirectory(prefix="warm_compile_") as cache:
            for run in ("cold", "warm"):
                command = [sys.executable, __file__, "--child", way, "--layers", str(args.layers),
                           "--hidden", str(args.hidden), "--seq", str(args.seq)]
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
                if done.returncode:
                    raise SystemExit(f"{way} ({run}) failed:\n{done.stderr[-4000:]}")
                rows.append({"way": way, "run": run, **json.loads(done.stdout.strip().splitlines()[-1])})
                print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| way | run | transfers | forward compile | backward compile | FX graph cache (hit / miss / bypass) "
             "| first step, compile included |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        forward, backward = (row["graphs"] + [None, None])[:2]
        lines.append(f"| {row['way']} | {row['run']} | {row['transfers'] if row['transfers'] is not None else '-'} "
                     f"| {_seconds(forward)} | {_seconds(backward)} "
                     f"| {' / '.join(str(row['cache'][name]) for name in CACHE)} | {row['first_step_s']:.1f} s |")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.hidden, args.seq)))
        return 0
    started = time.monotonic()
    rows = measure(args)
    import torch

    body = (f"{datetime.date.today().isoformat()}, `python benchmarks/warm_compile.py"
            f"{'' if (args.layers, args.hidden, args.seq) == (4, 256, 256) else ' ' + ' '.join(sys.argv[1:])}"
            f" --write`, torch {torch.__version__}, {time.monotonic() - started:.0f} s: a Llama of {args.layers} "
            f"layer{'s' if args.layers != 1 else ''} (hidden {args.hidden}, {args.seq} tokens) compiled whole by "
            "Inductor for this CPU, plain and "
            "under fxoffload (budget 0.5, strategy offload, `min_bytes=0`), one training step each, each way twice "
            "over one fresh Inductor cache folder, each run a fresh process: cold, then warm. Compile: seconds in "
            "`compile_fx_inner` per graph (Dynamo's timer: Inductor's lowering, code generation, the C++ compiler), "
            "measured on this machine. The C++ compiler's outputs are cached by their source in both ways. "
            "fxoffload's forward, handed back from the cache, tells the backward's prefetches the strides its "
            "offloads write through its code (`ordering.layouts_from_code`). \"forward lowered in each process\": "
            "fxoffload as it was earlier on 2026-12-06, such a forward kept out of the cache (as under a C++ "
            "wrapper now), its lowering telling the prefetches. \"bypassed as before\": fxoffload as it was "
            "until 2026-12-06, its `control_deps` not marked cacheable, so that every graph of its bypassed the "
            "cache. No figure: the graph was not compiled (plain compile's warm run found the whole pair in "
            "AOTAutograd's cache, which fxoffload keeps off for its graphs: a hit would skip its passes).\n\n"
            + table(rows))
    print(body)
    if args.write:
        from results import write_section

        print(f"wrote {write_section(HEADING, body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
