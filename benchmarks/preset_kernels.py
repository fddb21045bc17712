"""Inductor's kernels with and without fxoffload for the presets' architectures at their published widths.

    python benchmarks/preset_kernels.py                        # every preset, budgets 0.5 and 0.3
    python benchmarks/preset_kernels.py --only gpt2-xl --budgets 0.5   # prints, writes nothing
    python benchmarks/preset_kernels.py --write                # its section of benchmarks/RESULTS.md (about 3 minutes)

Issue 50: a transfer must not split a kernel Inductor fuses without it. ``benchmarks/frontier_kernels.py``
checks the frontier's Llama at the size a GPU runs it; the models users bring are others. Each of
``fxoffload plan``'s presets (``fxoffload.tools.models.PRESETS``: transformers models built from their
published configs, nothing downloaded) is built with two layers at its published widths under fake tensors,
one step (its own cross-entropy loss, batch 1, ``SEQ`` tokens or the preset's images), compiled whole by
Inductor for the CPU (``frontier_kernels.code_only``: the code written, its kernels neither compiled nor
run), plain and under fxoffload at each budget (strategy offload: the partition is plain's, so that every
difference is the copies'; the ``h100-pcie5`` profile; a budget out of reach planned at the lowest peak it
reaches). Every graph's kernels are counted by name with Inductor's index dropped, against plain's: a kernel
gone with others in its place is a fusion split; one more with none gone, a kernel the copies made Inductor
write.

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
from frontier_kernels import code_only, difference, kernels  # noqa: E402
from fxoffload.tools.models import PRESETS, from_preset  # noqa: E402
from results import write_section  # noqa: E402

HEADING = "Inductor's kernels with and without fxoffload, the presets at their widths (measured, CPU)"
LAYERS, SEQ, PROFILE = 2, 2048, "h100-pcie5"
BUDGETS = (0.5, 0.3)


@dataclass(frozen=True)
class Compiled:
    """One step of a preset under one way: every graph's kernels, summed; the plans' words (fxoffload)."""

    preset: str
    budget: float | None
    forward: Counter
    backward: Counter
    plans: str


def compile_preset(name: str, budget: float | None, seq: int = SEQ) -> Compiled:
    """One fake step of ``name`` (``LAYERS`` layers, ``seq`` tokens or fewer), compiled whole by Inductor
    for the CPU: plain (``budget`` None) or under fxoffload at ``budget``."""
    source = from_preset(name, layers=LAYERS)
    seq = min(source.default_seq, seq)
    torch._dynamo.reset()
    backend = "inductor" if budget is None else fxoffload.offload_backend(
        memory_budget=budget, strategy="offload", device_profile=PROFILE, on_infeasible="warn")
    with code_only() as written, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
            step, inputs, kwargs = source.build(1, seq, torch.bfloat16)
            torch.compile(step, backend=backend)(*inputs, **kwargs).backward()
    forward, backward = Counter(), Counter()
    for code in written:
        (backward if code.backward else forward).update(kernels(code.source))
    plans = "" if isinstance(backend, str) else "; ".join(_plan_words(r.plan) for r in backend.records)
    return Compiled(name, budget, forward, backward, plans)


def _plan_words(plan) -> str:
    return f"{len(plan.transfers)} copies, {len(plan.recomputes)} recomputed, partition {plan.partition}"


def _named(counts: dict[str, int]) -> str:
    return ", ".join(f"`{name}`" + (f" x{n}" if n > 1 else "") for name, n in counts.items()) or "-"


def row(compiled: Compiled, plain: Compiled) -> str:
    forward, backward = difference(compiled.forward, plain.forward), difference(compiled.backward, plain.backward)
    return (f"| {compiled.preset} | {compiled.budget} | {compiled.plans} | {sum(compiled.forward.values())} "
            f"({sum(plain.forward.values())}) | {sum(compiled.backward.values())} ({sum(plain.backward.values())}) | "
            f"{_named(forward.added)} / {_named(forward.gone)} | {_named(backward.added)} / {_named(backward.gone)} |")


def more_kernels(compiled: Compiled, plain: Compiled) -> bool:
    """Whether a graph of ``compiled`` calls more kernels than plain's: a split, or a kernel written apart."""
    return (sum(compiled.forward.values()) > sum(plain.forward.values())
            or sum(compiled.backward.values()) > sum(plain.backward.values()))


def render(rows: list[str], more: list[str], seconds: float) -> str:
    intro = (f"Written by `python benchmarks/preset_kernels.py --write` on {datetime.date.today().isoformat()}, "
             f"torch {torch.__version__}, {seconds:.0f} s: each preset built with {LAYERS} layers at its published "
             f"widths under fake tensors, batch 1, {SEQ} tokens (or its images), bfloat16, one step compiled whole "
             "by Inductor for this CPU (its C++ kernels neither compiled nor run), plain and under fxoffload "
             f"(strategy offload: plain's partition, {PROFILE}). "
             "Kernels of every graph by name (Inductor's index dropped), plain's count in brackets; added / gone "
             "against plain. A kernel gone with others in its place is a fusion split; one more with none gone, a "
             "kernel the copies made Inductor write.")
    summary = (f"More kernels than plain in a graph: {len(more)} of {len(rows)} rows" +
               (f" ({', '.join(more)}); not yet fixed (DEVELOPING.md)." if more else "."))
    return "\n".join([intro, "", "| preset | budget | plans | forward kernels | backward kernels | "
                      "forward: added / gone | backward: added / gone |", "|---|---|---|---|---|---|---|", *rows,
                      "", summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(PRESETS), help="these presets only")
    parser.add_argument("--budgets", nargs="+", type=float, default=BUDGETS, help="memory budgets (0 < b <= 1)")
    parser.add_argument("--write", action="store_true", help="write its section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budgets):
        parser.error(f"--budgets: each a fraction in (0, 1], got {args.budgets}")
    if args.write and (args.only or tuple(args.budgets) != BUDGETS):
        parser.error("--write: the section is written for every preset at the default budgets (no --only, --budgets)")
    start, rows, more = time.monotonic(), [], []
    for name in args.only or PRESETS:
        plain = compile_preset(name, None)
        for budget in args.budgets:
            compiled = compile_preset(name, budget)
            rows.append(row(compiled, plain))
            if more_kernels(compiled, plain):
                more.append(f"{name} at {budget}")
            print(rows[-1], flush=True)
    text = render(rows, more, time.monotonic() - start)
    print(text)
    if args.write:
        print(f"wrote {write_section(HEADING, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
