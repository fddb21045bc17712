"""The memory/time frontier, measured: fxoffload's budgeted plans against PyTorch's own recompute budget
and full checkpointing, every way in one process on one GPU.

    python benchmarks/frontier.py --out DIR               # on an H100 or H200 (torch 2.11), every way
    python benchmarks/frontier.py --out DIR --profile     # and a torch.profiler summary of one step per way
    python benchmarks/frontier.py --dry-run --out DIR     # every way on this CPU, small sizes (CI runs it)
    python benchmarks/frontier.py --from-json F [F2 ...] --write   # GPU runs' figures into benchmarks/RESULTS.md
    python benchmarks/frontier.py --summarize-again F TRACES       # F's profiles again, from its kept raw traces

The model (``examples/llama_layers.py``) defaults to 8 decoder layers shaped like Llama-3-8B's at 1 x 8192
tokens in bf16, each block compiled on its own (torchtitan style; the embedding, head and loss eager);
``--layers --hidden --heads --kv-heads --ffn --vocab --seq --batch --compile whole`` change it, and
``--compile per-block+loss`` compiles the final norm, the head and the loss as one region too, in every
way alike (fxoffload then sees where the step's peak is: the logits; the layer-input way plans the
blocks only).

The ways: plain (Inductor); PyTorch's ``activation_memory_budget`` at each budget; full checkpointing per
block (non-reentrant); fxoffload ``memory_budget`` at each budget under each strategy (``auto`` is the
default options), and at ``--measured-budgets`` (default 0.5) strategy auto with ``select="measured"``
(its candidate plans timed in extra warm-up steps, the fastest kept; the notes say which); checkpointing
per block with fxoffload offloading the layer inputs. Per way: the median step (forward and backward,
after warm-up steps; ``--timed`` steps, every one kept, with the pinned blocks each made), the device peak
(``max_memory_allocated`` above what was allocated before the step), the device bytes held when the
backward begins, and for fxoffload's ways its predictions (the simulated step over the step's graph runs,
the bytes it predicts held). The verdicts place each fxoffload way on PyTorch's frontier: the straight
line between the two PyTorch points (plain, its budgets, full checkpointing) whose measured peaks bracket
the way's measured peak, and say whether the difference is beyond the steps' spread (the larger
half-interquartile range of the timed steps of the way and of the two points: a difference inside it is a
tie as far as this run can tell).

Timed steps are interleaved (since 2026-12-04): every way is built over one model (its weights shared)
and compiled and warmed up first, then ``--timed`` rounds run one timed step of each way, round r
starting at the r-th way, so that a drift of the device's speed over the run (its clocks, as it warms)
falls on every way alike instead of on the ways measured last. Each way's blocks are compiled behind a
forward of their own (``isolated``: Dynamo keeps compiled graphs per code object, and ways held side by
side would otherwise share one cache). Its memory step and its profile follow, way by way, and the
cached pinned blocks are given back once, at the end. ``--sequential`` measures each way in a row,
from a fresh model, as runs 1-9 did (the JSON's ``order`` says which).

``--profile`` summarises one more step per way from torch.profiler's trace (``summarize_trace``, free of
torch): kernel time by kind and the kernels added against plain, in all and by name (``kernel_family``:
which kernel a way adds or splits), each stream's busy time and the compute
stream's idle time within the step, told apart by cause from the launch of the work after each gap
(``idle_causes``: the device waiting for the host, and of it for the host inside fxoffload's op calls;
queued work waiting on the device, a copy's event most likely, by the kernel held back; the device moving
between queued kernels), copy bytes and throughput by direction, and the host time of fxoffload's ops;
the same kernels' time against the baseline's, forward and backward apart and under a copy or not
(``same_kernels``: whether the copies slow the compute beside them, told apart from the device's own
drift by PyTorch's ways, which copy nothing, and, interleaved, by each baseline profiled again after every
way: ``profile_baselines_again``); then each fxoffload way against issue 50's profile bar
(``profile_bar``). ``--keep-traces`` keeps the raw
traces, and ``--summarize-again F TRACES`` summarises a kept run's profiles again from them with today's
code (runs 3, 5 and 6 were, on 2026-12-03). Limits: a copy the host issued late (a slow op call) reads as
the device's wait for it; the trace's host and device clocks are taken as one (Kineto aligns them).

``--dry-run`` runs every way on this CPU with the eager inner compiler (``aot_eager_decomp_partition``
for PyTorch's ways): its figures are not a GPU's and are never written to RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import re
import json
import statistics
import sys
import tempfile
import time
import types
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks"), str(ROOT)]

import fxoffload  # noqa: E402
from fxoffload.backend.selection import WARMUP_STEPS  # noqa: E402
from _recipes import plain_backend  # noqa: E402
from gpu_session import Run, Steps, measure_memory, predict, record_steps, timed_step, warm_up  # noqa: E402
from gpu_session import _host_stats as host_stats  # noqa: E402
from gpu_session import _one_line as one_line  # noqa: E402
from llama_layers import LlamaShape, LlamaStack  # noqa: E402
from results import gpu_or_dry_run, save_run, show_measured  # noqa: E402
from same_kernels import UNDER_COPY_SHARE, LaunchedKernel, kernel_sequence, same_kernels  # noqa: E402

HEADING = "Frontier (measured)"
BUDGETS = (0.7, 0.5, 0.3)
COMPILES = ("per-block", "per-block+loss", "whole")
STRATEGIES = ("auto", "offload", "recompute")
MEASURED_BUDGETS = (0.5,)
SELECT_STEPS = 2  # timed steps per candidate under select="measured"
# Warm-up steps measured selection adds: the re-plan once the first step counted the runs, then at most
# one candidate per plan strategy auto makes, each its warm-up steps and its timed steps.
SELECTION_WARMUP = 1 + len(fxoffload.passes.CANDIDATE_KEYS) * (WARMUP_STEPS + SELECT_STEPS)
GIB = 2 ** 30


@dataclass(frozen=True)
class Setup:
    """The model, the batch and how each way's step is compiled and timed."""

    shape: LlamaShape
    batch: int
    seq: int
    dtype: str
    # "per-block" (each block on its own, the head and loss eager), "per-block+loss" (the head and loss
    # too, as one region) or "whole" (the step as one graph)
    compile: str
    inner: str  # fxoffload's inner compiler: "inductor" on a GPU, "eager" in the dry run
    warmup: int  # at least 2: fxoffload re-plans and recompiles a block graph at the second step (runs_per_step)
    timed: int

    @staticmethod
    def for_run(dry_run: bool) -> "Setup":
        if dry_run:
            return Setup(LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=128), batch=1, seq=64,
                         dtype="float32", compile="per-block", inner="eager", warmup=2, timed=2)
        return Setup(LlamaShape(), batch=1, seq=8192, dtype="bfloat16", compile="per-block", inner="inductor",
                     warmup=3, timed=5)


@dataclass(frozen=True)
class Way:
    """One way to run the step: ``kind`` is plain, pytorch (its recompute budget), checkpoint, fxoffload,
    or checkpoint+fxoffload (checkpointed blocks, their inputs offloaded)."""

    kind: str
    budget: float | None = None
    strategy: str | None = None
    select: str = "predicted"  # fxoffload's select option

    @property
    def name(self) -> str:
        if self.kind == "plain":
            return "plain"
        if self.kind == "pytorch":
            return f"PyTorch activation_memory_budget={self.budget}"
        if self.kind == "checkpoint":
            return "full checkpointing per block"
        if self.kind == "checkpoint+fxoffload":
            return "checkpointing per block, layer inputs offloaded (fxoffload)"
        measured = ", select=measured" if self.select == "measured" else ""
        return f"fxoffload memory_budget={self.budget}, strategy={self.strategy}{measured}"

    @property
    def checkpointed(self) -> bool:
        return self.kind in ("checkpoint", "checkpoint+fxoffload")


def default_ways(budgets: Iterable[float] = BUDGETS, strategies: Iterable[str] = STRATEGIES,
                 measured: Iterable[float] = MEASURED_BUDGETS) -> list[Way]:
    """PyTorch's points first (the frontier), then fxoffload's ways: its default options (auto) first, then
    measured selection, then the other strategies (a deadline skips the last ways first)."""
    budgets, strategies = tuple(budgets), tuple(strategies)
    by_strategy = [[Way("fxoffload", b, s) for b in budgets] for s in strategies]
    return [Way("plain"), *(Way("pytorch", b) for b in budgets), Way("checkpoint"), *by_strategy[0],
            *(Way("fxoffload", b, "auto", "measured") for b in measured), *sum(by_strategy[1:], []),
            Way("checkpoint+fxoffload")]


def chosen_ways(ways: list[Way], wanted: str | None) -> list[Way]:
    """The ways whose name contains one of ``wanted``'s comma-separated words (every way when None)."""
    if wanted is None:
        return ways
    words = [w.strip() for w in wanted.split(",") if w.strip()]
    chosen = [way for way in ways if any(word in way.name for word in words)]
    if not chosen:
        raise SystemExit(f"frontier: --ways {wanted!r} names none of the ways: "
                         + "; ".join(way.name for way in ways))
    return chosen


@dataclass
class Frontier:
    device: str
    torch_version: str
    dry_run: bool
    started: str
    setup: Setup
    runs: list[Run] = field(default_factory=list)
    profiles: dict = field(default_factory=dict)  # way name -> summarize_trace(...)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    device_profile: dict = field(default_factory=dict)  # the profile the plans were made with (profile_figures)
    order: str = "interleaved"  # the timed steps: "interleaved" (rounds over the ways) or "sequential"
    step_order: list[str] = field(default_factory=list)  # the way of each timed step, in the order they ran
    # A baseline's profile made again after every way's (interleaved, with --profile): way name -> summary
    profiled_again: dict = field(default_factory=dict)

    def save(self, out: Path | None) -> None:
        save_run(out, "frontier", self, render)


def profile_figures(profile: Any) -> dict:
    """A ``DeviceProfile`` as plain JSON figures (dtypes by name), so that a GPU run's plans can be made
    again on a CPU from the same calibration."""
    figures = asdict(profile)
    figures["flops"] = [[str(dtype).removeprefix("torch."), rate] for dtype, rate in profile.flops]
    return figures


# ----------------------------------------------------------------------------- the step

class HeadAndLoss(nn.Module):
    """The stack's final norm, its head and the next-token loss (eager under ``--compile per-block``); a
    region of its own under ``per-block+loss``, so that a planner sees the step's peak there (the logits,
    in float32)."""

    def __init__(self, stack: LlamaStack | WayStack) -> None:
        super().__init__()
        self.norm, self.head = stack.norm, stack.head

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1).float(), targets.flatten())


class StackThenLoss(nn.Module):
    """Tokens in, next-token loss out, the head and the loss one module (:class:`HeadAndLoss`)."""

    def __init__(self, stack: nn.Module, head_and_loss: nn.Module) -> None:
        super().__init__()
        self.stack, self.head_and_loss = stack, head_and_loss

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head_and_loss(self.stack.hidden(tokens[:, :-1]), tokens[:, 1:])


class WayStack(nn.Module):
    """A stack's embedding, final norm and head with one way's blocks (compiled, checkpointed), the stack
    itself left as it is: ways built over one stack share its weights."""

    def __init__(self, stack: LlamaStack, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.shape = stack.shape
        self.embed, self.norm, self.head = stack.embed, stack.norm, stack.head
        self.blocks = nn.ModuleList(blocks)

    hidden = LlamaStack.hidden


class _Region(nn.Module):
    """A module behind a forward of its own (:func:`isolated`)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return self.inner(*args)


def isolated(tag: str) -> type[nn.Module]:
    """A module class whose ``forward`` (a call of the module it wraps) is a code object of its own, named for
    ``tag``. Dynamo keeps compiled graphs per code object: every way's blocks run one ``forward``, so ways
    held compiled side by side would share one cache, told apart only by a guard on the backend (plain and
    PyTorch's budgets compile with one backend, their difference a config read at compile time), past
    ``recompile_limit`` entries run eagerly, and the ways measured last would check the most guards a call.
    One class per way: its blocks share one code object, as one block class's do (one graph serves them)."""
    name = "forward_" + re.sub(r"\W", "_", tag)
    code = _Region.forward.__code__.replace(co_name=name, co_qualname=name)
    forward = types.FunctionType(code, _Region.forward.__globals__, name)
    return type(name, (_Region,), {"forward": forward})


def fresh_stack(setup: Setup, device: torch.device) -> LlamaStack:
    """The stack every way measures, its weights seeded."""
    torch.manual_seed(0)
    return LlamaStack(setup.shape).to(device=device, dtype=getattr(torch, setup.dtype))


def build_step(setup: Setup, way: Way, backend: Any, device: torch.device,
               stack: LlamaStack | None = None) -> nn.Module:
    """``way``'s step over ``stack`` (a fresh one on ``device`` when None; one made under fake tensors, or one
    the other ways share: it is left as it is), compiled with ``backend`` as ``setup`` says, behind
    forwards of the way's own (:func:`isolated`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if stack is None:
        stack = fresh_stack(setup, device)
    region = isolated(way.name)
    blocks = []
    for block in stack.blocks:
        if way.checkpointed:
            block = checkpoint_wrapper(block)
        if setup.compile != "whole":
            block = torch.compile(region(block), backend=backend, fullgraph=True)
        blocks.append(block)
    way_stack = WayStack(stack, blocks)
    head_and_loss = HeadAndLoss(way_stack)
    if setup.compile == "per-block+loss":
        # The layer-input way offloads the blocks' inputs only: its head and loss compile without a plan.
        loss_backend = plain_backend(setup.inner) if way.kind == "checkpoint+fxoffload" else backend
        head_and_loss = torch.compile(isolated(f"{way.name} loss")(head_and_loss), backend=loss_backend,
                                      fullgraph=True)
    step = StackThenLoss(way_stack, head_and_loss)  # tokens in, next-token loss out
    return torch.compile(region(step), backend=backend) if setup.compile == "whole" else step


def backend_for(setup: Setup, way: Way, profile: Any, cuda: bool) -> tuple[Any, Any]:
    """(the backend to compile with, fxoffload's backend or None)."""
    if way.kind not in ("fxoffload", "checkpoint+fxoffload"):
        return plain_backend(setup.inner), None
    options: dict[str, Any] = {"inner": setup.inner, "device_profile": profile}
    if way.kind == "fxoffload":
        # on_infeasible="warn": a budget out of reach still runs, at the lowest peak it reaches (noted).
        options.update(memory_budget=way.budget, strategy=way.strategy, on_infeasible="warn")
        if way.select == "measured":
            options.update(select="measured", select_steps=SELECT_STEPS)
    else:
        options.update(strategy="offload")  # no budget: every layer input the plan can move
    if not cuda:
        options["min_bytes"] = 0  # the dry run's tensors are all small
    backend = fxoffload.offload_backend(**options)
    return backend, backend


def compile_context(way: Way) -> Callable[[], Any]:
    if way.kind == "pytorch":
        return lambda: torch._functorch.config.patch(activation_memory_budget=way.budget)
    return contextlib.nullcontext


@dataclass
class Prepared:
    """One way built, compiled and warmed up (:func:`prepare_way`), taking its timed steps (:func:`interleave`);
    ``step`` is None once it failed (its run says why)."""

    way: Way
    run: Run
    step: nn.Module | None = None
    fx_backend: Any = None
    first: dict = field(default_factory=dict)  # the pinned allocator's counters before its first step
    steps: Steps = field(default_factory=Steps)


def _failed(prepared: Prepared, error: Exception) -> None:
    """Record ``error`` in the way's run (one failing way must not cost the others' figures)."""
    prepared.run.error = one_line(error)
    prepared.run.notes.append(traceback.format_exc(limit=4)[-1500:])
    prepared.step = None


def prepare_way(frontier: Frontier, way: Way, tokens: torch.Tensor, device: torch.device, profile: Any, cuda: bool,
                stack: LlamaStack | None = None) -> Prepared:
    """Build ``way``'s step over ``stack`` (a fresh one when None), compile it and run its warm-up steps."""
    setup = frontier.setup
    prepared = Prepared(way, Run(setup.compile, way.name))
    try:
        backend, prepared.fx_backend = backend_for(setup, way, profile, cuda)
        step = build_step(setup, way, backend, device, stack)
        prepared.first = host_stats(cuda)
        warmup = setup.warmup + (SELECTION_WARMUP if way.select == "measured" else 0)
        warm_up(step, tokens, warmup, compile_context(way))
        prepared.step = step
    except Exception as error:  # noqa: BLE001 -- recorded in its run
        _failed(prepared, error)
    return prepared


def interleave(prepared: list[Prepared], tokens: torch.Tensor, rounds: int, cuda: bool, order: list[str],
               after_round: Callable[[], None] = lambda: None) -> None:
    """``rounds`` rounds of one timed step of each way still standing, round r starting at the r-th way, each
    step's way appended to ``order``, ``after_round`` called after each: a drift of the device's speed falls
    on every way alike, and no way always follows the same other way."""
    for r in range(rounds):
        for k in range(len(prepared)):
            way = prepared[(r + k) % len(prepared)]
            if way.step is None:
                continue
            try:
                timed_step(way.step, tokens, cuda, way.steps)
            except Exception as error:  # noqa: BLE001 -- recorded in its run
                _failed(way, error)
                continue
            order.append(way.run.way)
        after_round()


def finish_way(frontier: Frontier, prepared: Prepared, tokens: torch.Tensor, cuda: bool, with_profile: bool,
               traces: Path | None, release: bool) -> Run:
    """The way's median step, its memory step, fxoffload's predictions and notes, and its profile. With
    ``release``, the cached pinned blocks are given back after its memory step, and the pinned blocks made
    since its first step noted (no other way's steps ran in between)."""
    run, step = prepared.run, prepared.step
    if step is None:
        return run
    try:
        record_steps(run, prepared.steps)
        measure_memory(step, tokens, cuda, run, prepared.first if release else {}, release=release)
        if prepared.fx_backend is not None:
            predict(prepared.fx_backend, run)
            run.notes += selection_notes(prepared.fx_backend) + plan_notes(prepared.fx_backend)
        if with_profile:
            keep = traces / trace_name(run.way) if traces else None
            frontier.profiles[run.way] = profile_step(step, tokens, cuda, keep)
    except Exception as error:  # noqa: BLE001 -- recorded in its run
        _failed(prepared, error)
    return run


def one_way(frontier: Frontier, way: Way, tokens: torch.Tensor, device: torch.device, profile: Any, cuda: bool,
            with_profile: bool, traces: Path | None = None) -> Run:
    """Build, compile, run and measure one way, alone and from a fresh model (``--sequential``); an error is
    recorded, not raised."""
    torch._dynamo.reset()
    prepared = prepare_way(frontier, way, tokens, device, profile, cuda)
    interleave([prepared], tokens, frontier.setup.timed, cuda, frontier.step_order)
    return finish_way(frontier, prepared, tokens, cuda, with_profile, traces, release=True)


def sequential_ways(frontier: Frontier, ways: list[Way], tokens: torch.Tensor, device: torch.device, profile: Any,
                    cuda: bool, args: argparse.Namespace, past_deadline: Callable[[], bool],
                    say: Callable[[str], None]) -> None:
    """Every way in a row (:func:`one_way`), those past the deadline skipped, each saved as it ends."""
    for way in ways:
        if past_deadline():
            frontier.skipped.append(f"{way.name}: past the deadline")
            continue
        run = one_way(frontier, way, tokens, device, profile, cuda, args.profile, args.keep_traces)
        frontier.runs.append(run)
        frontier.save(args.out)
        say(f"{way.name}: {_outcome(run)}")


def _outcome(run: Run) -> str:
    return f"FAILED {run.error}" if run.error else f"step {_ms(run.step_seconds)}, peak {_gib(run.peak_bytes)}"


def interleaved_ways(frontier: Frontier, ways: list[Way], tokens: torch.Tensor, device: torch.device, profile: Any,
                     cuda: bool, args: argparse.Namespace, past_deadline: Callable[[], bool],
                     say: Callable[[str], None]) -> None:
    """Every way over one model: built and warmed up in turn (those past the deadline skipped), their timed
    steps in rounds (:func:`interleave`), then each way's memory step and profile; the cached pinned blocks
    are given back at the end."""
    torch._dynamo.reset()
    stack = fresh_stack(frontier.setup, device)
    prepared = []
    for way in ways:
        if past_deadline():
            frontier.skipped.append(f"{way.name}: past the deadline")
            continue
        prepared.append(prepare_way(frontier, way, tokens, device, profile, cuda, stack))
        run = prepared[-1].run
        say(f"{way.name}: " + (f"FAILED {run.error}" if run.error else "compiled and warmed up"))
    frontier.runs = [p.run for p in prepared]
    frontier.save(args.out)

    def saved() -> None:  # the steps so far, kept: a run killed in its memory steps or profiles still has them
        for way in prepared:
            if way.step is not None and way.steps.seconds:
                record_steps(way.run, way.steps, note=False)
        frontier.save(args.out)

    interleave(prepared, tokens, frontier.setup.timed, cuda, frontier.step_order, saved)
    say(f"{len(frontier.step_order)} timed steps in {frontier.setup.timed} rounds")
    for way in prepared:
        run = finish_way(frontier, way, tokens, cuda, args.profile, args.keep_traces, release=False)
        frontier.save(args.out)
        say(f"{way.way.name}: {_outcome(run)}")
    if args.profile:
        profile_baselines_again(frontier, prepared, tokens, cuda, args.keep_traces)
        frontier.save(args.out)
    if cuda:
        fxoffload.release_host_memory()


AGAIN = " (profiled again)"  # a baseline's second profile: its trace's name, and its row's


def profile_baselines_again(frontier: Frontier, prepared: list[Prepared], tokens: torch.Tensor, cuda: bool,
                            traces: Path | None) -> None:
    """Profile each baseline (plain, full checkpointing) again after every way's profile: the same kernels'
    time against its first profile (``same_kernels``) is the device's drift over the profiles, which each
    way's comparison with its baseline carries in part (runs 5-8, measured in a row: every way's forward
    3-7% slower than plain's, PyTorch's too)."""
    baselines = (Way("plain").name, Way("checkpoint").name)
    for way in prepared:
        if way.way.name in baselines and way.step is not None and not way.run.error:
            keep = traces / trace_name(way.way.name + AGAIN) if traces else None
            frontier.profiled_again[way.way.name] = profile_step(way.step, tokens, cuda, keep)


def trace_name(way_name: str) -> str:
    """The file a way's raw trace is kept in (``--keep-traces``)."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", way_name) + ".json.gz"


def summarize_again(path: Path, traces: Path) -> list[str]:
    """Summarise the profiles of the run at ``path`` (a ``frontier.json``) again from its kept raw traces
    with today's ``summarize_trace``, and note so among its remarks; the ways whose trace is there."""
    figures = json.loads(path.read_text())
    done = []
    for summaries, suffix in ((figures["profiles"], ""), (figures.get("profiled_again", {}), AGAIN)):
        for way in summaries:
            trace = traces / trace_name(way + suffix)
            if trace.exists():
                events = json.loads(gzip.decompress(trace.read_bytes())).get("traceEvents", [])
                summaries[way] = summarize_trace(events)
                done.append(way + suffix)
    if not done:
        raise SystemExit(f"frontier: no trace of {path}'s profiled ways in {traces} "
                         "(named as --keep-traces names them)")
    said = f"Profiles summarised again from the raw traces in `{traces.as_posix()}`"
    remark = (f"{said} by `python benchmarks/frontier.py --summarize-again {path.as_posix()} {traces.as_posix()}` "
              "(the compute stream's idle time by cause, its kernels by name and their time against the baseline's).")
    figures["remarks"] = [r for r in figures.get("remarks", []) if not r.startswith(said)] + [remark]
    path.write_text(json.dumps(figures, indent=1, default=str))  # as save_run writes it
    return done


def plan_notes(backend: Any) -> list[str]:
    """Each distinct plan the step ran: its digest, copies and recomputations, so that a CPU can make the
    same plan again (with the run's ``device_profile``) and tell whether it did."""
    seen, notes = set(), []
    for record in backend.step_invocations() or backend.records[-1:]:
        digest = fxoffload.passes.plan_digest(record.plan, record.schedule)
        if digest not in seen:
            seen.add(digest)
            recomputed = sum(1 for d in record.plan.decisions if d.action == "recompute")
            early = sum(p.deferred_before_last for p in record.schedule.placements)
            deferred = f" ({early} released without a wait in the runs before the last)" if early else ""
            notes.append(f"plan {digest}: {len(record.plan.transfers)} copies{deferred}, {recomputed} recomputed, "
                         f"partition {record.plan.partition}")
    return notes


def selection_notes(backend: Any) -> list[str]:
    """What measured selection kept in each compiled region, with every candidate's measured median."""
    notes = []
    for record in backend.records:
        if (selection := record.selection) is not None:
            timed = ", ".join(f"{t.key} {_ms(t.median)}" for t in selection.candidates)
            notes.append(f"region {record.region}: measured selection kept {selection.kept.key} ({timed} "
                         "per step, medians)")
    return notes


# ----------------------------------------------------------------------------- the profile

def profile_step(step: nn.Module, tokens: torch.Tensor, cuda: bool, keep: Path | None = None) -> dict:
    """torch.profiler over one steady step, its Chrome trace summarised (``summarize_trace``).

    One unprofiled step runs first: ``measure`` ends by giving back the cached pinned blocks, and a step
    right after it makes them all again (``cudaHostAlloc``, 20-30 ms of host time per copy measured on an
    H200), which is no steady step's cost. The device is synchronized after it, as between timed steps."""
    step(tokens).backward()
    if cuda:  # as between measure's timed steps: else this step's first copies find the blocks the last
        torch.cuda.synchronize()  # step's prefetches still use, and make new ones (seen on an H200)
    for p in step.parameters():
        p.grad = None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step(tokens).backward()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
        if keep is not None:  # the raw trace, for a look at the timeline away from the device
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_bytes(gzip.compress(text.encode()))
        events = json.loads(text).get("traceEvents", [])
    for p in step.parameters():
        p.grad = None
    return summarize_trace(events)


KERNEL_KINDS = (("triton", ("triton_",)), ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
                ("attention", ("flash", "fmha", "attention")), ("elementwise", ("elementwise", "reduce")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def kernel_family(name: str) -> str:
    """A kernel's name without Inductor's index (``triton_poi_fused_mul_12`` -> ``triton_poi_fused_mul``): a
    kernel split in two renumbers every kernel after it, so that names compare across ways by what they
    fuse."""
    return re.sub(r"_\d+$", "", name)


def kernels_added_by_name(profile: dict, base: dict) -> list[tuple[str, int]]:
    """The compute stream's kernels of ``profile`` against ``base``'s, by family (:func:`kernel_family`):
    each family whose count differs and by how much, largest first (absent from summaries made before
    names were kept: none)."""
    mine, theirs = profile.get("compute_kernel_names"), base.get("compute_kernel_names")
    if mine is None or theirs is None:
        return []
    found = [(name, mine.get(name, 0) - theirs.get(name, 0)) for name in sorted(set(mine) | set(theirs))]
    return sorted((f for f in found if f[1]), key=lambda f: (-abs(f[1]), f[0]))


Intervals = list[tuple[float, float]]


def _merged(intervals: Intervals) -> Intervals:
    """The union of ``intervals`` (start, end) as disjoint intervals, in order."""
    out: Intervals = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _busy(intervals: Intervals) -> float:
    """The length of the union of ``intervals``."""
    return sum(end - start for start, end in _merged(intervals))


def _gaps(busy: Intervals, span: tuple[float, float]) -> Intervals:
    """The parts of ``span`` no interval of ``busy`` covers."""
    out, at = [], span[0]
    for start, end in _merged(busy):
        if start > at:
            out.append((at, min(start, span[1])))
        at = max(at, end)
    if at < span[1]:
        out.append((at, span[1]))
    return out


def _overlap(a: Intervals, b: Intervals) -> float:
    """The length of the intersection of two unions of intervals."""
    a, b, total, i, j = _merged(a), _merged(b), 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Launch:
    """A CUDA API call on the host (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaMemcpyAsync``...), found
    by the correlation id its device work carries."""

    start: float
    thread: Any


@dataclass(frozen=True)
class DeviceOp:
    """A kernel, copy or memset on one stream, with the correlation id of its launch."""

    start: float
    end: float
    correlation: Any
    name: str


@dataclass
class IdleCauses:
    """A stream's idle time by cause, in microseconds (:func:`idle_causes`)."""

    host_bound: float = 0.0
    in_fxoffload: float = 0.0  # of host_bound: the launching thread inside an fxoffload op call
    in_first_fxoffload: float = 0.0  # of in_fxoffload: inside the step's first fxoffload op call
    device_bound: float = 0.0
    switching: float = 0.0  # queued work's gaps under SWITCH_US: the device moving to the next kernel
    before: dict[str, float] = field(default_factory=dict)  # device_bound, by the kernel it held back

    def waits_before(self, most: int = 3) -> dict[str, float]:
        """The kernels held back longest by device-bound idle time, longest first."""
        return dict(sorted(self.before.items(), key=lambda item: -item[1])[:most])


SWITCH_US = 10.0  # a gap of queued work shorter than this is the device moving to its next kernel


def idle_causes(ops: list[DeviceOp], span: tuple[float, float], launches: dict[Any, Launch],
                fxoffload_calls: dict[Any, Intervals]) -> IdleCauses:
    """Each gap of ``ops`` (one stream's work) within ``span``, by the launch of the work that ends it.
    Launched after the gap began: the device had nothing queued and waited for the host; the part of
    the gap up to the launch that the launching thread spent inside an fxoffload op call is that op's
    host time holding the device back. Launched before (queued work that did not start: a stream waiting
    on an event), or with no launch to be found, or with no work after it: waiting on the device, unless
    the gap is shorter than ``SWITCH_US`` (about 1-2 us between any two queued kernels on an H200: plain's
    400 kernels switch for about 1 ms a step). Of the host's part inside fxoffload's calls, the part inside
    the step's first call is told apart: the host is barely ahead of the device at the step's start, and
    that call is the one that takes the caching host allocator's backlog (runs 7 and 8, DEVELOPING)."""
    causes, at = IdleCauses(), span[0]
    first = min((call for calls in fxoffload_calls.values() for call in calls), default=None)
    for op in sorted(ops, key=lambda o: o.start) + [DeviceOp(span[1], span[1], None, "")]:
        gap = op.start - at
        if gap > 0:
            launch = launches.get(op.correlation) if op.correlation is not None else None
            if launch is not None and launch.start > at:
                causes.host_bound += gap
                waited = [(at, min(launch.start, op.start))]
                causes.in_fxoffload += _overlap(waited, fxoffload_calls.get(launch.thread, []))
                if first is not None and first in fxoffload_calls.get(launch.thread, []):
                    causes.in_first_fxoffload += _overlap(waited, [first])
            elif gap < SWITCH_US:
                causes.switching += gap
            else:
                causes.device_bound += gap
                if op.name:
                    causes.before[op.name] = causes.before.get(op.name, 0.0) + gap
        at = max(at, op.end)
    return causes


def _kernel_sequence(ops: list[DeviceOp], launches: dict[Any, Launch], in_flight: Intervals) -> dict:
    """The compute stream's kernels in order (``same_kernels.kernel_sequence``), each with the thread that
    launched it (None where its launch is not in the trace)."""
    copies = _merged(in_flight)
    launched = [LaunchedKernel(op.start, op.end, kernel_family(op.name),
                               launches[op.correlation].thread if op.correlation in launches else None,
                               op.end > op.start and _overlap([(op.start, op.end)], copies)
                               >= UNDER_COPY_SHARE * (op.end - op.start))
                for op in ops]
    return kernel_sequence(launched)


def _direction(name: str) -> str | None:
    if "HtoD" in name or "Host to Device" in name:
        return "host_to_device"
    if "DtoH" in name or "Device to Host" in name:
        return "device_to_host"
    return None


def summarize_trace(events: list[dict]) -> dict:
    """A Chrome trace's events (torch.profiler's export) as the step's device timeline, in microseconds:
    kernels by kind, each stream's busy time, the compute stream's (the one with the most kernel time)
    idle time within the step's span, copies by direction and the host time of fxoffload's ops. Pinned
    blocks made within the step (``cudaHostAlloc``: a steady step makes none) are counted with their host
    time.

    The idle time is told apart by its cause (:func:`idle_causes`), from the launch of the work that ends
    each gap: waiting for the host (that work was launched after the gap began: the device had run out of
    work), and of it the part the launching thread spent inside an fxoffload op call (the ops' host time
    holding the device back); else waiting on the device (the work was queued and waited: for a copy's
    event, most likely), and by the kernel it held back. Also the idle time that passed with a copy in
    flight, and (``idle_in_fxoffload_host_us``, kept for older summaries) with the host inside an
    fxoffload op call at the same moment, which says nothing of cause: the host runs ahead of the device."""
    kernels: dict[str, dict] = {}
    streams: dict[str, list[tuple[float, float]]] = {}
    kernel_time: dict[str, float] = {}
    kernel_count: dict[str, int] = {}
    kernel_names: dict[str, dict[str, int]] = {}
    copies: dict[str, dict] = {}
    host_ops: dict[str, dict] = {}
    host_calls: Intervals = []
    host_calls_by_thread: dict[Any, Intervals] = {}
    launches: dict[Any, Launch] = {}
    device_ops: dict[str, list[DeviceOp]] = {}
    kernel_ops: dict[str, list[DeviceOp]] = {}
    in_flight: Intervals = []
    host_alloc = {"calls": 0, "us": 0.0}
    span = [float("inf"), float("-inf")]
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name, start, dur = e.get("cat", ""), e.get("name", ""), float(e["ts"]), float(e["dur"])
        args = e.get("args") or {}
        if cat == "cpu_op" and name.startswith("fxoffload::"):
            op = host_ops.setdefault(name, {"calls": 0, "us": 0.0})
            op["calls"] += 1
            op["us"] += dur
            host_calls.append((start, start + dur))
            host_calls_by_thread.setdefault(e.get("tid"), []).append((start, start + dur))
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:  # a launch, or another API call
            launches[args["correlation"]] = Launch(start, e.get("tid"))
        if cat == "cuda_runtime" and name == "cudaHostAlloc":  # a pinned block made within the step
            host_alloc["calls"] += 1
            host_alloc["us"] += dur
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = str(args.get("stream", "?"))
        streams.setdefault(stream, []).append((start, start + dur))
        device_ops.setdefault(stream, []).append(DeviceOp(start, start + dur, args.get("correlation"), name))
        span = [min(span[0], start), max(span[1], start + dur)]
        if cat == "kernel":
            kind = kernels.setdefault(kernel_kind(name), {"count": 0, "us": 0.0})
            kind["count"] += 1
            kind["us"] += dur
            kernel_time[stream] = kernel_time.get(stream, 0.0) + dur
            kernel_ops.setdefault(stream, []).append(device_ops[stream][-1])
            kernel_count[stream] = kernel_count.get(stream, 0) + 1
            families = kernel_names.setdefault(stream, {})
            families[kernel_family(name)] = families.get(kernel_family(name), 0) + 1
        elif cat == "gpu_memcpy" and (direction := _direction(name)):
            copy = copies.setdefault(direction, {"count": 0, "bytes": 0, "us": 0.0})
            copy["count"] += 1
            copy["bytes"] += int(args.get("bytes", 0) or 0)
            copy["us"] += dur
            in_flight.append((start, start + dur))
    for copy in copies.values():
        copy["gb_per_s"] = copy["bytes"] / copy["us"] / 1e3 if copy["us"] else None
    busy = {stream: _busy(intervals) for stream, intervals in streams.items()}
    compute = max(kernel_time, key=kernel_time.get) if kernel_time else None
    step_us = span[1] - span[0] if compute is not None else 0.0
    idle = _gaps(streams[compute], (span[0], span[1])) if compute is not None else []
    causes = idle_causes(device_ops.get(compute, []), (span[0], span[1]), launches, host_calls_by_thread)
    return {"kernels": kernels, "kernel_count": sum(k["count"] for k in kernels.values()),
            "compute_kernels": kernel_count.get(compute, 0),
            "compute_kernel_names": dict(sorted(kernel_names.get(compute, {}).items())),
            "stream_busy_us": busy, "compute_stream": compute, "step_us": step_us,
            "compute_idle_us": step_us - busy[compute] if compute is not None else 0.0,
            "idle_copy_in_flight_us": _overlap(idle, in_flight),
            "idle_in_fxoffload_host_us": _overlap(idle, host_calls),
            "idle_host_bound_us": causes.host_bound, "idle_host_bound_in_fxoffload_us": causes.in_fxoffload,
            "idle_host_bound_in_first_fxoffload_us": causes.in_first_fxoffload,
            "idle_device_bound_us": causes.device_bound, "idle_switching_us": causes.switching,
            "idle_waits_before": causes.waits_before(),
            "compute_kernel_seq": _kernel_sequence(kernel_ops.get(compute, []), launches, in_flight),
            "copies": copies, "fxoffload_host": host_ops, "host_alloc": host_alloc}


# ----------------------------------------------------------------------------- the verdicts

@dataclass(frozen=True)
class Point:
    name: str
    peak: float
    step: float
    spread: float | None = None  # its timed steps' spread (spread_of), in seconds (None: not recorded)


class Line(NamedTuple):
    """PyTorch's step at a peak (:func:`frontier_line`), the points it lies between, and how far their
    medians may move: the larger of their timed steps' half-interquartile ranges (None where a run did not
    record them)."""

    seconds: float
    between: str
    spread: float | None


def _larger(*spreads: float | None) -> float | None:
    return None if any(s is None for s in spreads) else max(spreads)


def frontier_line(points: list[Point], peak: float, floor: str | None = None) -> Line | None:
    """PyTorch's step at ``peak`` on the straight line between its two points whose peaks bracket it, with
    the two names; below its lowest point, that point's step where it is ``floor`` (full checkpointing: no
    faster way to hold less), or where ``floor`` is None. None above the highest point (a way that holds more
    than plain is on no line of PyTorch's), and below a lowest point that is not the floor (a run that left
    PyTorch's lower points out brackets nothing there)."""
    ordered = sorted(points, key=lambda p: p.peak)
    if not ordered or peak > ordered[-1].peak:
        return None
    if peak <= ordered[0].peak:
        lowest = ordered[0]
        return Line(lowest.step, lowest.name, lowest.spread) if floor in (None, lowest.name) else None
    for low, high in zip(ordered, ordered[1:]):
        if low.peak <= peak <= high.peak:
            spread = _larger(low.spread, high.spread)
            if high.peak == low.peak:
                return Line(min(low.step, high.step), f"{low.name} / {high.name}", spread)
            t = (peak - low.peak) / (high.peak - low.peak)
            return Line(low.step + t * (high.step - low.step), f"{low.name} .. {high.name}", spread)
    return None


def spread_of(samples: list[float] | None) -> float | None:
    """Half the interquartile range of a way's timed steps (inclusive quartiles): how far its median may
    move, a single slow step (a pinned block made, a collection) left out as the range would not. None
    with fewer than two (runs kept before the steps were recorded have none)."""
    if not samples or len(samples) < 2:
        return None
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    return (high - low) / 2


def verdicts(runs: list[dict]) -> list[dict]:
    """Each fxoffload way placed against PyTorch's frontier (plain, its budgets, full checkpointing). A
    verdict is ``decided`` where the way's step and the line differ by more than the larger spread
    (:func:`spread_of`) of the timed steps of the way and of the two points (None where a run did not
    record its steps)."""
    points = [Point(r["way"], r["peak_bytes"], r["step_seconds"], spread_of(r.get("step_samples"))) for r in runs
              if not r["error"] and r["peak_bytes"] and _kind(r["way"]) in ("plain", "pytorch", "checkpoint")]
    out = []
    for r in runs:
        if r["error"] or not r["peak_bytes"] or _kind(r["way"]) not in ("fxoffload", "checkpoint+fxoffload"):
            continue
        line = frontier_line(points, r["peak_bytes"], floor=Way("checkpoint").name)
        spread = None if line is None else _larger(spread_of(r.get("step_samples")), line.spread)
        out.append({"way": r["way"], "peak_bytes": r["peak_bytes"], "step_seconds": r["step_seconds"],
                    "line_seconds": None if line is None else line.seconds,
                    "between": None if line is None else line.between,
                    "faster_by": None if line is None else 1 - r["step_seconds"] / line.seconds,
                    "spread_seconds": spread,
                    "decided": None if spread is None else abs(r["step_seconds"] - line.seconds) > spread})
    return out


_NAME_KINDS = (("plain", "plain"), ("PyTorch activation_memory_budget", "pytorch"),
               ("full checkpointing", "checkpoint"), ("checkpointing per block, layer inputs", "checkpoint+fxoffload"),
               ("fxoffload memory_budget", "fxoffload"))


def _kind(way_name: str) -> str:
    """The kind of a way from its name (as ``Way.name`` writes it)."""
    return next(kind for prefix, kind in _NAME_KINDS if way_name.startswith(prefix))


# ----------------------------------------------------------------------------- rendering

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _gib(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / GIB:.2f} GiB" if abs(v) >= GIB / 10 else f"{v / 2**20:.2f} MiB"


PREDICTION_TOLERANCE = 0.05  # of the baseline's step: how far a predicted overhead may be from its measurement


def overheads(runs: list[dict]) -> dict[str, tuple[float, float | None]]:
    """Each fxoffload way's overhead over its set-up's baseline (plain; full checkpointing for the
    checkpointed way), measured and predicted, both as a share of the baseline's measured step.

    The prediction covers the compiled graphs only (the simulated step over the step's graph runs, less
    the same graphs' compute without copies); the measured step also holds the eager embedding, head and
    loss. Its extra seconds are therefore put over the measured step, not over its own graphs' compute,
    which would overstate it by the eager share."""
    baseline = {kind: next((r for r in runs if r["way"] == Way(kind).name and not r["error"]), None)
                for kind in ("plain", "checkpoint")}
    out = {}
    for r in runs:
        kind = _kind(r["way"])
        base = baseline["checkpoint" if kind == "checkpoint+fxoffload" else "plain"]
        if r["error"] or kind not in ("fxoffload", "checkpoint+fxoffload") or base is None:
            continue
        predicted = None
        if r["predicted_step_seconds"] and r["predicted_compute_seconds"]:
            predicted = (r["predicted_step_seconds"] - r["predicted_compute_seconds"]) / base["step_seconds"]
        out[r["way"]] = (r["step_seconds"] / base["step_seconds"] - 1, predicted)
    return out


def _prediction_verdict(measured: float, predicted: float | None) -> str:
    if predicted is None:
        return "-"
    off = abs(measured - predicted)
    return f"{off:.1%} {'within' if off <= PREDICTION_TOLERANCE else 'outside'} {PREDICTION_TOLERANCE:.0%}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"


def _step(run: dict) -> str:
    """The median step, and the fastest and slowest timed step where the run recorded them."""
    samples = run.get("step_samples")
    seen = f" ({min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f})" if samples and len(samples) >= 2 else ""
    return _ms(run["step_seconds"]) + seen


def _runs_table(frontier: dict) -> list[str]:
    runs = frontier["runs"]
    plain = next((r for r in runs if r["way"] == Way("plain").name and not r["error"]), None)
    over = overheads(runs)
    lines = ["| way | step | vs plain | device peak | held at backward | predicted step | predicted held | "
             "copies | overhead | predicted | off by (of the step) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["error"]:
            lines.append(f"| {r['way']} | failed: {r['error'][:200]} | | | | | | | | | |")
            continue
        ratio = f"{r['step_seconds'] / plain['step_seconds']:.3f}" if plain else "-"
        lines.append(f"| {r['way']} | {_step(r)} | {ratio} | {_gib(r['peak_bytes'])} | "
                     f"{_gib(r['held_at_backward'])} | {_ms(r['predicted_step_seconds'])} | "
                     f"{_gib(r['predicted_held_at_backward'])} | {'-' if r['transfers'] is None else r['transfers']} | "
                     f"{_share(over.get(r['way'], (None,))[0])} | {_share(over.get(r['way'], (None, None))[1])} | "
                     f"{_prediction_verdict(*over[r['way']]) if r['way'] in over else '-'} |")
    return lines


def _unsteady_lines(frontier: dict) -> list[str]:
    """The ways whose timed steps made pinned blocks (``step_host_allocs``, kept since 2026-12-04): those steps
    were not steady, and the median says less of the way."""
    made = [f"{r['way']}: {', '.join(map(str, r['step_host_allocs']))}" for r in frontier["runs"]
            if any(r.get("step_host_allocs") or ())]
    return ["", "Timed steps that made pinned blocks (each step's count, in order): " + "; ".join(made) + "."] \
        if made else []


def _verdict_lines(frontier: dict) -> list[str]:
    found = verdicts(frontier["runs"])
    if not found:
        return []
    lines = ["", "Against PyTorch's frontier (its step at the same measured peak, on the line between its two "
             "points that bracket it). Beyond the steps' spread: the way's step and the line differ by more than "
             "the larger half-interquartile range of the timed steps of the way and of the two points (runs "
             "before 2026-12-04 did not record their steps).", "",
             "| way | step | PyTorch's line | between | faster by | beyond the steps' spread |",
             "|---|---|---|---|---|---|"]
    for v in found:
        if v["line_seconds"] is None:
            lines.append(f"| {v['way']} | {_ms(v['step_seconds'])} | - | on no line of this run's points (above "
                         "plain, or below its lowest point, not full checkpointing) | - | - |")
            continue
        lines.append(f"| {v['way']} | {_ms(v['step_seconds'])} | {_ms(v['line_seconds'])} | {v['between']} | "
                     f"{v['faster_by']:+.1%} | {_decided(v)} |")
    return lines


def _decided(verdict: dict) -> str:
    if verdict.get("decided") is None:  # absent from verdicts of runs that recorded no steps
        return "steps not recorded"
    spread = f"±{verdict['spread_seconds'] * 1e3:.1f} ms"
    return f"yes ({spread})" if verdict["decided"] else f"no: a tie within {spread}"


def _profile_lines(frontier: dict) -> list[str]:
    profiles = frontier["profiles"]
    if not profiles:
        return []
    plain = profiles.get(Way("plain").name)
    lines = ["", "Profile of one step per way (torch.profiler): kernels on all streams, those added against plain, "
             "the compute stream's busy and idle time within the step, copies each way, fxoffload's host time. "
             "The compute stream's idle time by cause (`summarize_trace`), from the launch of the work after each "
             "gap: waiting for the host (launched after the gap began; in brackets, while the launching thread was "
             "in one of fxoffload's op calls, and of that in the step's first op call), waiting on the device "
             "(queued, held back: by a copy's event, most likely; the kernel held back longest beside it), and "
             "the device moving between queued kernels (gaps "
             f"under {SWITCH_US:.0f} us). Idle while a copy was in flight: at the same moment, whatever the cause.",
             "", "| way | kernels | added | compute busy | compute idle | "
             "waiting for the host (in our ops; in the step's first op call) | "
             "waiting on the device | held back longest | between kernels | idle, a copy in flight | "
             "step span | to host | to device | fxoffload host time | pinned blocks made |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for way, p in profiles.items():
        added = "-" if plain is None else f"{p['compute_kernels'] - plain['compute_kernels']:+d}"
        busy = p["stream_busy_us"].get(p["compute_stream"], 0.0) if p["compute_stream"] else 0.0

        def copy(direction: str) -> str:
            c = p["copies"].get(direction)
            if not c:
                return "-"
            rate = "" if c["gb_per_s"] is None else f", {c['gb_per_s']:.1f} GB/s"
            return f"{c['bytes'] / GIB:.2f} GiB in {c['us'] / 1e3:.1f} ms{rate}"

        host = ", ".join(f"{name.split('::')[1]} {o['calls']} x {o['us'] / o['calls']:.0f} us"
                         for name, o in p["fxoffload_host"].items()) or "-"
        lines.append(f"| {way} | {p['kernel_count']} | {added} | {busy / 1e3:.1f} ms | "
                     f"{p['compute_idle_us'] / 1e3:.1f} ms | {_causes(p)} | "
                     f"{p['idle_copy_in_flight_us'] / 1e3:.1f} ms | {p['step_us'] / 1e3:.1f} ms | "
                     f"{copy('device_to_host')} | {copy('host_to_device')} | {host} | {_made(p)} |")
    return lines + _kernel_name_lines(frontier) + _same_kernel_lines(frontier) + _profile_bar_lines(frontier)


NAMES_SHOWN = 6  # kernel families listed per way, the largest differences first


def _baseline_of(way: str) -> str:
    """The way a way's kernels are put against: full checkpointing for the checkpointed way, else plain."""
    return Way("checkpoint" if _kind(way) == "checkpoint+fxoffload" else "plain").name


def _kernel_name_lines(frontier: dict) -> list[str]:
    profiles = frontier["profiles"]
    rows = []
    for way, p in profiles.items():
        base = profiles.get(_baseline_of(way))
        if way in (Way("plain").name, Way("checkpoint").name) or base is None \
                or "compute_kernel_names" not in p or "compute_kernel_names" not in base:
            continue  # a summary made before names were kept says nothing of them
        found = kernels_added_by_name(p, base)
        shown = ", ".join(f"{n:+d} `{name[:80]}`" for name, n in found[:NAMES_SHOWN]) or "the same"
        more = f" (and {len(found) - NAMES_SHOWN} more)" if len(found) > NAMES_SHOWN else ""
        rows.append(f"- {way}: {shown}{more}")
    if not rows:
        return []
    return ["", "The compute stream's kernels by name against plain's (full checkpointing's for the checkpointed "
            "way), a Triton kernel's index dropped (`kernel_family`): what each way adds or splits.", "", *rows]


def _against(part: Any) -> str:
    return "-" if part.change is None else f"{part.change:+.1%} ({part.kernels}, {part.base_us / 1e3:.1f} ms)"


def _same_kernel_row(label: str, found: Any) -> str:
    return (f"| {label} | {found.way_kernels} against {found.base_kernels} | {_against(found.forward)} | "
            f"{_against(found.backward)} | {_against(found.under_copy)} | {_against(found.without_copy)} |")


def _same_kernel_lines(frontier: dict) -> list[str]:
    profiles = frontier["profiles"]
    rows = []
    for way, p in profiles.items():
        base = profiles.get(_baseline_of(way))
        if way in (Way("plain").name, Way("checkpoint").name) or base is None:
            continue
        if (found := same_kernels(p, base)) is None or not found.way_kernels:
            continue  # a summary made before the kernels were kept, or of a CPU's step (no device kernels)
        rows.append(_same_kernel_row(way, found))
    for way, again in frontier.get("profiled_again", {}).items():  # absent from runs before 2026-12-04 (night)
        if way in profiles and (found := same_kernels(again, profiles[way])) is not None and found.way_kernels:
            rows.append(_same_kernel_row(f"{way}{AGAIN}, after every way", found))
    if not rows:
        return []
    return ["", "The same kernels' time against plain's (full checkpointing's for the checkpointed way), "
            "`same_kernels`: each part's compute-stream kernels matched to the baseline's by name in order (a "
            "kernel a way adds, splits or moves has no match and is left out), their time over the baseline's (in "
            "brackets: kernels matched, the baseline's time). Forward and backward apart (the autograd engine "
            "launches the backward from a thread of its own); under a copy: the way's kernels with a copy in "
            f"flight for at least {UNDER_COPY_SHARE:.0%} of their time. A way that copies nothing (PyTorch's) "
            "shows the device's own drift between the profiled steps, and a baseline profiled again after every "
            "way (since 2026-12-04, interleaved runs) its drift over them.", "",
            "| way | kernels | forward | backward | under a copy | with none |", "|---|---|---|---|---|---|", *rows]


HELD_BACK_SHOWN_US = 100.0  # the kernel held back longest is named from this much of its waiting on


def _causes(profile: dict) -> str:
    """The idle time's causes, as four cells (absent from summaries made before they were told apart)."""
    if "idle_host_bound_us" not in profile:
        return "- | - | - | -"
    longest = next(iter(profile["idle_waits_before"].items()), None)
    held = "-"
    if longest is not None and longest[1] >= HELD_BACK_SHOWN_US:
        held = f"`{longest[0][:60]}` {longest[1] / 1e3:.1f} ms"
    ms = {key: f"{profile[key] / 1e3:.1f} ms" for key in ("idle_host_bound_us", "idle_host_bound_in_fxoffload_us",
                                                          "idle_device_bound_us", "idle_switching_us")}
    first = profile.get("idle_host_bound_in_first_fxoffload_us")  # absent from summaries made before it was
    ours = ms["idle_host_bound_in_fxoffload_us"] + ("" if first is None else f"; first call {first / 1e3:.2f} ms")
    return (f"{ms['idle_host_bound_us']} ({ours}) | {ms['idle_device_bound_us']} | "
            f"{held} | {ms['idle_switching_us']}")


KERNELS_PER_TRANSFER = 0.1  # issue 50's profile bar: plain's kernels plus one per ten transfers at most
IDLE_SHARE = 0.01  # and the compute stream idle at most 1% of the step, for fxoffload's copies and op calls


def profile_bar(frontier: dict) -> list[dict]:
    """Each fxoffload way's profile against issue 50's bar: the compute stream's kernels against its
    set-up's baseline's (plain; full checkpointing for the checkpointed way) plus one per ten transfers,
    and its idle time caused by fxoffload (waiting on the device, and for the host inside fxoffload's op
    calls) against 1% of the step. The idle time plain has too (the host at the step's start, the device
    between kernels) is no copy's and no op's."""
    profiles = frontier["profiles"]
    out = []
    for r in frontier["runs"]:
        kind = _kind(r["way"])
        p = profiles.get(r["way"])
        base = profiles.get(_baseline_of(r["way"]))
        if base is None or p is None or r["error"] or kind not in ("fxoffload", "checkpoint+fxoffload") \
                or "idle_host_bound_us" not in p:
            continue
        caused = p["idle_device_bound_us"] + p["idle_host_bound_in_fxoffload_us"]
        out.append({"way": r["way"], "added": p["compute_kernels"] - base["compute_kernels"],
                    "allowed": (r["transfers"] or 0) * KERNELS_PER_TRANSFER, "transfers": r["transfers"],
                    "idle_share": caused / p["step_us"] if p["step_us"] else None})
    return out


def _profile_bar_lines(frontier: dict) -> list[str]:
    found = profile_bar(frontier)
    if not found:
        return []
    lines = ["", f"Against the profile bar (issue 50, at 0.7): kernels on the compute stream at most plain's plus one "
             f"per ten transfers; idle time for fxoffload's copies and op calls at most {IDLE_SHARE:.0%} of the step. "
             "The checkpointed way's kernels are put against full checkpointing's.", "",
             "| way | kernels added | allowed | idle for copies and op calls | within |", "|---|---|---|---|---|"]
    for v in found:
        within = v["added"] <= v["allowed"] and v["idle_share"] is not None and v["idle_share"] <= IDLE_SHARE
        share = "-" if v["idle_share"] is None else f"{v['idle_share']:.2%}"
        lines.append(f"| {v['way']} | {v['added']:+d} | {v['allowed']:.1f} ({v['transfers']} transfers) | {share} | "
                     f"{'yes' if within else 'no'} |")
    return lines


def _made(profile: dict) -> str:
    made = profile.get("host_alloc")  # absent from runs summarised before it was counted
    return "not counted" if made is None else f"{made['calls']} ({made['us'] / 1e3:.1f} ms)"


def _order_line(frontier: dict) -> str:
    if frontier.get("order", "sequential") == "sequential":  # runs 1-9 kept no order: they ran so
        return ("Timed steps: each way's in a row, after its own build, compile and warm-up, from a fresh model "
                "(sequential).")
    return ("Timed steps: interleaved. Every way was built over one model and compiled and warmed up first, then "
            f"each of {frontier['setup']['timed']} rounds ran one timed step of every way, round r starting at "
            "the r-th way, so that a drift of the device's speed over the run falls on every way alike; then each "
            "way's memory step (and profile).")


def render(frontier: dict) -> str:
    # A run saved before its ways' timed steps ran (interleaved: after the builds) lists those ways as pending.
    pending = [r["way"] for r in frontier["runs"] if not r["error"] and r["step_seconds"] is None]
    frontier = {**frontier, "runs": [r for r in frontier["runs"] if r["error"] or r["step_seconds"] is not None]}
    s = frontier["setup"]
    shape = s["shape"]
    kind = "dry run on a CPU (not a GPU measurement)" if frontier["dry_run"] else f"measured on {frontier['device']}"
    lines = [f"Written by `python benchmarks/frontier.py` ({kind}), torch {frontier['torch_version']}, started "
             f"{frontier['started']}, {frontier['seconds']:.0f} s in all. Columns headed predicted are fxoffload's "
             "simulator and memory model; every other figure is measured.", "",
             f"Model: {shape['layers']} Llama-style layers (hidden {shape['hidden']}, {shape['heads']} heads, "
             f"{shape['kv_heads']} KV heads, FFN {shape['ffn']}, vocabulary {shape['vocab']}), batch {s['batch']} x "
             f"{s['seq']} tokens, {s['dtype']}, compiled {s['compile']}, inner compiler {s['inner']}; the median of "
             f"{s['timed']} steps after {s['warmup']} warm-up steps (in brackets where recorded: the fastest and the "
             "slowest of them). Peak: `max_memory_allocated` over one step "
             "above what was allocated before it. Held at backward: bytes allocated when the backward began. "
             "Overhead: the step over its set-up's baseline (plain; full checkpointing for the checkpointed way), "
             "measured, and predicted: the simulated extra seconds of the compiled graphs over the baseline's "
             "measured step (predictions leave out the eager embedding, head and loss, in held bytes too). Off "
             "by: the two overheads' difference, as a share of the step.", "", _order_line(frontier), ""]
    if frontier.get("device_profile"):
        p = frontier["device_profile"]
        lines += [f"Device profile the plans were made with ({p['name']}): copies {p['h2d_bandwidth'] / 1e9:.1f} GB/s "
                  f"to the device, {p['d2h_bandwidth'] / 1e9:.1f} GB/s to the host, duplex {p['duplex']}, memory "
                  f"{p['memory_bandwidth'] / 1e9:.0f} GB/s, " + ", ".join(f"{d} {f / 1e12:.0f} TFLOP/s"
                                                                   for d, f in p["flops"]) + ".", ""]
    lines += _runs_table(frontier) + _unsteady_lines(frontier) + _verdict_lines(frontier) + _profile_lines(frontier)
    if pending:
        lines += ["", "Not timed yet (the run was saved before their timed steps): " + "; ".join(pending)]
    if frontier["skipped"]:
        lines += ["", "Skipped: " + "; ".join(frontier["skipped"])]
    if frontier.get("remarks"):  # written beside a run's figures afterwards, on reading them (see the JSON)
        lines += ["", "Remarks:", ""] + [f"- {r}" for r in frontier["remarks"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every way on this CPU, small sizes")
    parser.add_argument("--out", type=Path, help="folder for frontier.json and frontier.md")
    parser.add_argument("--profile", action="store_true", help="also summarise one profiled step per way")
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--measured-budgets", type=float, nargs="*", default=list(MEASURED_BUDGETS),
                        help="budgets at which strategy auto also runs with select='measured' (none: leave it out)")
    parser.add_argument("--keep-traces", type=Path, help="with --profile: also keep each way's raw Chrome trace "
                        "(gzipped) in this folder")
    parser.add_argument("--ways", help="run only the ways whose name contains one of these comma-separated "
                        "words (e.g. 'plain,strategy=auto'); default every way")
    parser.add_argument("--timed", type=int, help="timed steps per way, their median reported (default 5; "
                        "the dry run's 2)")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds after which the remaining ways "
                        "are skipped (default 540; interleaved, the ways not yet built)")
    parser.add_argument("--sequential", action="store_true", help="measure each way in a row, from a fresh "
                        "model (runs 1-9), instead of interleaving the ways' timed steps in rounds")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int, help="model size (default: Llama-3-8B's layer, 8 layers, "
                            "1 x 8192 tokens; the dry run's are smaller)")
    parser.add_argument("--compile", choices=COMPILES, help="compile each block (and with per-block+loss the head "
                        "and loss as one region of their own, every way alike), or the step as one "
                        "graph (default per-block)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render GPU runs' frontier.json instead of "
                        "running (several: each under its own heading, a run and its repeat)")
    parser.add_argument("--write", action="store_true", help="with --from-json: write its RESULTS.md section")
    parser.add_argument("--summarize-again", type=Path, nargs=2, metavar=("JSON", "TRACES"), help="summarise a "
                        "GPU run's profiles again from the raw traces kept with --keep-traces (today's "
                        "summarize_trace), in place")
    args = parser.parse_args(argv)
    if args.timed is not None and args.timed < 1:
        parser.error(f"--timed {args.timed}: at least 1 timed step")
    for flag, budgets in (("--budgets", args.budgets), ("--measured-budgets", args.measured_budgets)):
        if any(not 0 < b <= 1 for b in budgets):
            parser.error(f"{flag} {budgets}: each must be a fraction in (0, 1]")
    return args


def setup_from(args: argparse.Namespace, dry_run: bool) -> Setup:
    setup = Setup.for_run(dry_run)
    sizes = {f: getattr(args, f) for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
             if getattr(args, f) is not None}
    try:
        shape = replace(setup.shape, **sizes)
    except ValueError as error:
        raise SystemExit(f"frontier: {error}") from None
    return replace(setup, shape=shape, **{f: getattr(args, f) for f in ("seq", "batch", "compile", "timed")
                                          if getattr(args, f) is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize_again:
        done = summarize_again(*args.summarize_again)
        print(f"summarised again: {', '.join(done)}")
        return 0
    if args.from_json:
        show_measured("frontier", HEADING, args.from_json, args.write, render)
        return 0
    cuda = gpu_or_dry_run("frontier", args.write, args.dry_run)
    start = time.monotonic()
    say = lambda line: print(f"[{time.monotonic() - start:6.1f} s] {line}", flush=True)  # noqa: E731
    frontier = Frontier(torch.cuda.get_device_name() if cuda else "cpu", torch.__version__, not cuda,
                        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        setup_from(args, not cuda))
    profile = fxoffload.calibrate() if cuda else fxoffload.offload_backend().config.profile
    frontier.device_profile = profile_figures(profile)
    say(f"profile: {profile.name}{' (calibrated)' if cuda else ' (dry run: the default, not calibrated)'}")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    s = frontier.setup
    tokens = torch.randint(0, s.shape.vocab, (s.batch, s.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    ways = chosen_ways(default_ways(args.budgets, args.strategies, args.measured_budgets), args.ways)
    past_deadline = lambda: time.monotonic() - start > args.deadline  # noqa: E731
    frontier.order = "sequential" if args.sequential else "interleaved"
    measured = sequential_ways if args.sequential else interleaved_ways
    measured(frontier, ways, tokens, device, profile, cuda, args, past_deadline, say)
    frontier.seconds = time.monotonic() - start
    frontier.save(args.out)
    print(render(asdict(frontier)))
    return 1 if any(r.error for r in frontier.runs) else 0


if __name__ == "__main__":
    sys.exit(main())
