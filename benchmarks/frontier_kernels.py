"""Inductor's kernels for the frontier's ways at their full size, written for this CPU from a kept GPU run.

    python benchmarks/frontier_kernels.py benchmarks/measured/frontier-h200-run5.json
    python benchmarks/frontier_kernels.py F --ways 'plain,memory_budget=0.5'   # some ways only
    python benchmarks/frontier_kernels.py F --write      # its section of benchmarks/RESULTS.md

Issue 50: each transfer must leave Inductor's fusions as they are. ``benchmarks/fusions.py`` checks that on a
small block, under plans made for that block; the plans a GPU runs are made for the run's model (8 Llama-3-8B
layers at 8192 tokens), and place their copies, releases and recomputations elsewhere. Here each way the run
measured (PyTorch's and fxoffload's; measured selection, which chooses by timing, is left out) is traced as
``frontier_predict`` traces it: the run's model under fake tensors (shapes only, nothing allocated), with the
run's options and calibrated ``device_profile``, priced as the run priced it. The compiler is Inductor for the
CPU, made to write each graph's code without compiling or running its C++ kernels
(:func:`code_only`): the graphs then run as FX graphs on the fake tensors. The code of a block's last forward
and backward (fxoffload's second step runs the graph planned for all the blocks) is read for the kernels it
calls, one function per kernel (``fusions.one_function_per_kernel``), by name with Inductor's index dropped
(``frontier.kernel_family``), against the way's baseline: plain, or full checkpointing for the checkpointed
way.

Read it as: a kernel of the baseline's missing and others in its place is a fusion split (or merged); a
kernel more with nothing missing is most likely a recomputation's (a plan's or PyTorch's). Measured on this
machine's CPU backend: Inductor's scheduler is the same for Triton, its kernels are not always (a GPU run's
profile lists the kernels it added by name: ``frontier.kernels_added_by_name``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import re
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks"), str(ROOT)]

from frontier import Way, backend_for, chosen_ways, default_ways, kernel_family, plan_notes  # noqa: E402
from frontier_predict import profile_from, read_run, setup_from, two_fake_steps  # noqa: E402
from fusions import one_function_per_kernel  # noqa: E402
from results import write_section  # noqa: E402

HEADING = "Inductor's kernels for the frontier's ways at full size (measured, CPU)"
KERNEL_CALL = re.compile(r"^\s*(cpp_fused_\w+)\(", re.MULTILINE)


@dataclass(frozen=True)
class Written:
    """One graph's code as Inductor wrote it."""

    backward: bool
    source: str


@contextlib.contextmanager
def code_only() -> Iterator[list[Written]]:
    """Inductor writes each graph's code, and the compiled graph runs the FX graph it was given instead (a
    copy taken before Inductor's own passes), so that fake tensors can run it. Yields the code written, in
    compile order. The C++ kernels are not compiled (:func:`kernels_not_compiled`): the code names them all."""
    import torch._inductor.compile_fx as compile_fx

    from fxoffload.backend.ordering import follow_source_layouts

    written: list[Written] = []
    original = compile_fx.fx_codegen_and_compile

    def codegen(gm, example_inputs, inputs_to_check, *args, **kwargs):
        graph = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        output = original(gm, example_inputs, inputs_to_check, *args, **kwargs)
        follow_source_layouts(graph)  # the layouts lowering gave the copies, taken before it
        written.append(Written(bool(kwargs.get("is_backward")), output.source_code))

        def run(inputs: list) -> list:
            arguments = list(inputs)
            inputs.clear()  # boxed, as Inductor's own callables take them
            return list(graph(*arguments))

        output.current_callable = run
        return output

    compile_fx.fx_codegen_and_compile = codegen
    try:
        with one_function_per_kernel(), kernels_not_compiled():
            yield written
    finally:
        compile_fx.fx_codegen_and_compile = original


@contextlib.contextmanager
def kernels_not_compiled() -> Iterator[None]:
    """Inductor's generated modules load with a stub for each C++ kernel instead of compiling it (the
    compiler's time: about 30 s of a cold two-layer compile here); a stub called raises. The modules loaded
    meanwhile, stubs and all, are dropped from Inductor's in-memory cache on the way out, so that a later
    compile of the same code in this process loads (and compiles) it afresh."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    def not_compiled(*args, **kwargs):
        raise RuntimeError("a kernel written under frontier_kernels.code_only was not compiled: not run")

    originals = AsyncCompile.cpp, AsyncCompile.cpp_pybinding
    AsyncCompile.cpp = AsyncCompile.cpp_pybinding = lambda self, *args, **kwargs: not_compiled
    try:
        yield
    finally:
        AsyncCompile.cpp, AsyncCompile.cpp_pybinding = originals
        PyCodeCache.cache_clear()


def kernels(source: str) -> Counter:
    """The kernels a graph's code calls, by family, each as many times as it is called."""
    return Counter(kernel_family(name) for name in KERNEL_CALL.findall(source))


@dataclass(frozen=True)
class WayKernels:
    """A block's kernels under one way: its last forward's and backward's, and (fxoffload) its plan."""

    way: str
    forward: Counter
    backward: Counter
    plan: str | None
    recomputed: int | None  # the recomputations of the last graph's plan (fxoffload's ways)


def compile_way(run_figures: dict, way: Way) -> WayKernels:
    """Two fake steps of ``way`` on the run's model, compiled by Inductor for the CPU (:func:`code_only`)."""
    setup = setup_from(run_figures["setup"])
    torch._dynamo.reset()
    backend, fx_backend = backend_for(setup, way, profile_from(run_figures["device_profile"]), cuda=True)
    with code_only() as written, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the budget's own warnings: the run's figures say what it reached
        two_fake_steps(setup, way, backend, setup.inner)
    forward = next(w for w in reversed(written) if not w.backward)
    backward = next(w for w in reversed(written) if w.backward)
    if fx_backend is None:
        return WayKernels(way.name, kernels(forward.source), kernels(backward.source), None, None)
    return WayKernels(way.name, kernels(forward.source), kernels(backward.source), "; ".join(plan_notes(fx_backend)),
                      len(fx_backend.records[-1].plan.recomputes))


def baseline_name(way: Way) -> str:
    return Way("checkpoint" if way.checkpointed else "plain").name


@dataclass(frozen=True)
class Difference:
    """A way's kernels against its baseline's, in one graph: families with more calls, with fewer."""

    added: dict[str, int]
    gone: dict[str, int]

    @property
    def split(self) -> bool:
        """A kernel of the baseline's is missing: a fusion was split (or merged) differently."""
        return bool(self.gone)


def difference(mine: Counter, base: Counter) -> Difference:
    return Difference(dict(sorted((mine - base).items())), dict(sorted((base - mine).items())))


def ways_of(run_figures: dict) -> list[Way]:
    """The run's ways (PyTorch's and fxoffload's) without measured selection."""
    names = {r["way"] for r in run_figures["runs"]}
    return [w for w in default_ways(measured=()) if w.name in names]


def with_baselines(ways: list[Way]) -> list[Way]:
    """``ways``, each one's baseline first where it is missing, in the order of ``default_ways``."""
    wanted = {w.name for w in ways} | {baseline_name(w) for w in ways}
    return [w for w in default_ways(measured=()) if w.name in wanted]


def _named(counts: dict[str, int]) -> str:
    return ", ".join(f"`{name}`" + (f" x{n}" if n > 1 else "") for name, n in counts.items()) or "-"


def render(path: Path, run_figures: dict, rows: list[WayKernels], ways: list[Way], seconds: float) -> str:
    setup = setup_from(run_figures["setup"])
    shape = setup.shape
    by_name = {r.way: r for r in rows}
    intro = (f"Written by `python benchmarks/frontier_kernels.py {path.as_posix()}` on "
             f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {seconds:.0f} s: the run's model "
             f"({shape.layers} layers, hidden {shape.hidden}, FFN {shape.ffn}, {setup.batch} x {setup.seq} "
             f"tokens, {setup.dtype}, compiled {setup.compile}) traced under fake tensors with the run's "
             "calibrated profile, each block's last forward and backward written by Inductor for this CPU "
             "(its C++ kernels neither compiled nor run). Kernels by family (Inductor's index dropped) against "
             "the way's baseline (plain; full checkpointing for the checkpointed way): a kernel gone with "
             "another in its place is a fusion split; a kernel more with none gone is most likely a "
             "recomputation's.")
    lines = [intro, "",
             "| way | plan | forward kernels | backward kernels | forward: added / gone | backward: added / gone |",
             "|---|---|---|---|---|---|"]
    for way in ways:
        row = by_name[way.name]
        base = by_name[baseline_name(way)]
        forward, backward = difference(row.forward, base.forward), difference(row.backward, base.backward)
        same = row is base
        lines.append(f"| {row.way} | {row.plan or '-'} | {sum(row.forward.values())} | {sum(row.backward.values())} | "
                     + (" | ".join("(the baseline)" for _ in range(2)) if same else
                        f"{_named(forward.added)} / {_named(forward.gone)} | {_named(backward.added)} / "
                        f"{_named(backward.gone)}") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a GPU run's frontier.json (benchmarks/measured/frontier-*.json)")
    parser.add_argument("--ways", help="only the ways whose name contains one of these comma-separated words "
                                       "(each with its baseline)")
    parser.add_argument("--write", action="store_true", help="write its section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    run_figures = read_run(args.run)
    start = time.monotonic()
    ways = with_baselines(chosen_ways(ways_of(run_figures), args.ways))
    rows = []
    for way in ways:
        rows.append(compile_way(run_figures, way))
        print(f"{way.name}: {sum(rows[-1].forward.values())} forward, {sum(rows[-1].backward.values())} backward "
              "kernels", flush=True)
    text = render(args.run, run_figures, rows, ways, time.monotonic() - start)
    print(text)
    if args.write:
        print(f"wrote {write_section(HEADING, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
