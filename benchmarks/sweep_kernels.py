"""Inductor's kernels with and without fxoffload over the architecture sweep's models, on this CPU.

    python benchmarks/sweep_kernels.py                      # every architecture at budget 0.5; prints
    python benchmarks/sweep_kernels.py --only gpt2 bert     # some of them
    python benchmarks/sweep_kernels.py --write              # its section of benchmarks/RESULTS.md (about 6 minutes)

Issue 50: a transfer must not make Inductor write a kernel more. ``benchmarks/preset_kernels.py`` checks the
presets at their published widths; the sweep (``benchmarks/sweep.py``) covers 30 ``transformers`` model types
(causal, MoE, encoder, seq2seq, vision) at small configs, each with its own loss, tied embeddings included.
Each is compiled whole, plain and under fxoffload at the budget (strategy offload: the partition is plain's,
so that every difference is the copies'; ``min_bytes=0``, so that these small models have transfers; the
backend's default profile; a budget out of reach is planned at the lowest peak it reaches). Inductor writes
each graph's code for this CPU (``frontier_kernels.code_only``: its C++ kernels neither compiled nor run, the
graphs run as FX graphs), and every graph's kernels are counted by name with Inductor's index dropped, against
plain's. A kernel gone with others in its place is a fusion split; one more with none gone, a kernel the copies
made Inductor write. The verdict compares graph by graph, in compile order; a row whose ways compiled
another number of graphs, or forwards and backwards in another order (a recompilation in one), is marked so and
not compared.

Measured on this machine's CPU backend: Inductor's scheduler is the same for Triton, its kernels are not always.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import fxoffload  # noqa: E402
import sweep  # noqa: E402
from frontier_kernels import code_only, difference, kernels  # noqa: E402
from preset_kernels import _named  # noqa: E402
from results import write_section  # noqa: E402

HEADING = "Inductor's kernels with and without fxoffload, the sweep's architectures (measured, CPU)"
BUDGET = 0.5


@dataclass(frozen=True)
class Kernels:
    """One step of a model under one way: each graph's kernels, in compile order; the plans' words."""

    graphs: tuple[Counter, ...]
    backward: tuple[bool, ...]  # for each graph, whether it is a backward
    plans: str

    def total(self, backward: bool) -> Counter:
        """Every forward (backward) graph's kernels, summed."""
        return sum((g for g, b in zip(self.graphs, self.backward) if b is backward), Counter())


def compile_model(arch: sweep.Architecture, budget: float | None) -> Kernels:
    """One step of ``arch``'s model, compiled whole by Inductor for this CPU: plain (``budget`` None) or under
    fxoffload at ``budget`` (strategy offload, ``min_bytes=0``)."""
    torch._dynamo.reset()
    model, batch = sweep.build(arch)
    backend = "inductor" if budget is None else fxoffload.offload_backend(
        memory_budget=budget, strategy="offload", min_bytes=0, on_infeasible="warn")
    with code_only() as written, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=backend)(**batch).loss.backward()
    plans = "" if isinstance(backend, str) else "; ".join(
        f"{len(r.plan.transfers)} copies" for r in backend.records)
    return Kernels(tuple(kernels(c.source) for c in written), tuple(c.backward for c in written), plans)


def verdict(mine: Kernels, plain: Kernels) -> str:
    """``graphs differ`` (not compared: another number of graphs, or forwards and backwards in another order),
    ``more`` (a graph calls more kernels than plain's graph compiled at the same place) or ``same or fewer``."""
    if mine.backward != plain.backward:
        return "graphs differ"
    more = any(sum(m.values()) > sum(p.values()) for m, p in zip(mine.graphs, plain.graphs))
    return "more" if more else "same or fewer"


def row(model_type: str, mine: Kernels, plain: Kernels) -> str:
    mine_fw, mine_bw, plain_fw, plain_bw = mine.total(False), mine.total(True), plain.total(False), plain.total(True)
    forward, backward = difference(mine_fw, plain_fw), difference(mine_bw, plain_bw)
    return (f"| {model_type} | {mine.plans} | {sum(mine_fw.values())} ({sum(plain_fw.values())}) | "
            f"{sum(mine_bw.values())} ({sum(plain_bw.values())}) | {verdict(mine, plain)} | "
            f"{_named(forward.added)} / {_named(forward.gone)} | {_named(backward.added)} / {_named(backward.gone)} |")


def render(rows: list[str], more: list[str], differ: list[str], seconds: float) -> str:
    intro = (f"Written by `python benchmarks/sweep_kernels.py --write` on {datetime.date.today().isoformat()}, "
             f"torch {torch.__version__}, {seconds:.0f} s: each of the sweep's architectures at its small config "
             f"(`benchmarks/sweep.py`: 2 layers, hidden 256, batch {sweep.BATCH}, {sweep.SEQ} tokens or "
             f"{sweep.IMAGE}x{sweep.IMAGE} images, float32), its own loss, one step compiled whole by Inductor for "
             "this CPU (its C++ kernels neither compiled nor run), plain and under fxoffload at "
             f"`memory_budget={BUDGET}` (strategy offload: plain's partition; `min_bytes=0`). Kernels of all "
             "graphs by name (Inductor's index dropped), plain's count in brackets; added / gone against plain; the "
             "verdict compares each graph with plain's compiled at the same place. A "
             "kernel gone with others in its place is a fusion split; one more with none gone, a kernel the "
             "copies made Inductor write.")
    summary = [f"More kernels than plain in a graph: {len(more)} of {len(rows) - len(differ)} compared rows" +
               (f" ({', '.join(more)}); not yet fixed (DEVELOPING.md)." if more else ".")]
    if differ:
        summary.append("Not compared (the two ways compiled another number of graphs, or forwards and backwards in "
                       f"another order): {', '.join(differ)}.")
    return "\n".join([intro, "", "| model type | plans | forward kernels | backward kernels | verdict | "
                      "forward: added / gone | backward: added / gone |", "|---|---|---|---|---|---|---|", *rows,
                      "", *summary])


def main(argv: list[str] | None = None) -> int:
    types = [a.model_type for a in sweep.ARCHITECTURES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=types, metavar="MODEL_TYPE", help="these model types only")
    parser.add_argument("--write", action="store_true", help="write its section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.write and args.only:
        parser.error("--write: the section is written for every architecture (no --only)")
    start, rows, more, differ = time.monotonic(), [], [], []
    for arch in sweep.ARCHITECTURES:
        if args.only and arch.model_type not in args.only:
            continue
        plain, mine = compile_model(arch, None), compile_model(arch, BUDGET)
        rows.append(row(arch.model_type, mine, plain))
        outcome = verdict(mine, plain)
        (more if outcome == "more" else differ if outcome == "graphs differ" else []).append(arch.model_type)
        print(rows[-1], flush=True)
    text = render(rows, more, differ, time.monotonic() - start)
    print(text)
    if args.write:
        print(f"wrote {write_section(HEADING, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
