"""The memory/time frontier, measured: fxoffload's budgeted plans against PyTorch's own recompute budget
and full checkpointing, every way in one process on one GPU.

    python benchmarks/frontier.py --out DIR               # on an H100 or H200 (torch 2.11), every way
    python benchmarks/frontier.py --out DIR --profile     # and a torch.profiler summary of one step per way
    python benchmarks/frontier.py --dry-run --out DIR     # every way on this CPU, small sizes (CI runs it)
    python benchmarks/frontier.py --from-json F [F2 ...] --write   # GPU runs' figures into benchmarks/RESULTS.md

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
per block with fxoffload offloading the layer inputs. Per way: the median
step (forward and backward, after warm-up steps), the device peak (``max_memory_allocated`` above what
was allocated before the step), the device bytes held when the backward begins, and for fxoffload's ways
its predictions (the simulated step over the step's graph runs, the bytes it predicts held). The
verdicts place each fxoffload way on PyTorch's frontier: the straight line between the two PyTorch points
(plain, its budgets, full checkpointing) whose measured peaks bracket the way's measured peak.

``--profile`` summarises one more step per way from torch.profiler's trace (``summarize_trace``, free of
torch): kernel time by kind and the kernels added against plain, each stream's busy time and the compute
stream's idle time within the step (and how much of it passed with a copy in flight, or with the host
inside one of fxoffload's op calls: a late prefetch, or the ops' host time holding the device back), copy
bytes and throughput by direction, and the host time of fxoffload's ops.

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
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks"), str(ROOT)]

import fxoffload  # noqa: E402
from fxoffload.backend.selection import WARMUP_STEPS  # noqa: E402
from _recipes import plain_backend  # noqa: E402
from gpu_session import Run, measure, predict  # noqa: E402
from gpu_session import _one_line as one_line  # noqa: E402
from llama_layers import LlamaShape, LlamaStack  # noqa: E402
from results import gpu_or_dry_run, save_run, show_measured  # noqa: E402

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

    def __init__(self, stack: LlamaStack) -> None:
        super().__init__()
        self.norm, self.head = stack.norm, stack.head

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1).float(), targets.flatten())


class StackThenLoss(nn.Module):
    """Tokens in, next-token loss out, the head and the loss one module (:class:`HeadAndLoss`)."""

    def __init__(self, stack: LlamaStack, head_and_loss: nn.Module) -> None:
        super().__init__()
        self.stack, self.head_and_loss = stack, head_and_loss

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head_and_loss(self.stack.hidden(tokens[:, :-1]), tokens[:, 1:])


def build_step(setup: Setup, way: Way, backend: Any, device: torch.device,
               stack: LlamaStack | None = None) -> nn.Module:
    """A fresh stack (seeded weights) on ``device``, or ``stack`` as it is (one made under fake tensors),
    compiled with ``backend`` as ``setup`` says."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if stack is None:
        torch.manual_seed(0)
        stack = LlamaStack(setup.shape).to(device=device, dtype=getattr(torch, setup.dtype))
    for i, block in enumerate(stack.blocks):
        if way.checkpointed:
            block = checkpoint_wrapper(block)
        if setup.compile != "whole":
            block = torch.compile(block, backend=backend, fullgraph=True)
        stack.blocks[i] = block
    head_and_loss = HeadAndLoss(stack)
    if setup.compile == "per-block+loss":
        # The layer-input way offloads the blocks' inputs only: its head and loss compile without a plan.
        loss_backend = plain_backend(setup.inner) if way.kind == "checkpoint+fxoffload" else backend
        head_and_loss = torch.compile(head_and_loss, backend=loss_backend, fullgraph=True)
    step = StackThenLoss(stack, head_and_loss)  # tokens in, next-token loss out
    return torch.compile(step, backend=backend) if setup.compile == "whole" else step


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


def one_way(frontier: Frontier, way: Way, tokens: torch.Tensor, device: torch.device, profile: Any, cuda: bool,
            with_profile: bool, traces: Path | None = None) -> Run:
    """Build, compile, run and measure one way; an error is recorded, not raised."""
    setup = frontier.setup
    run = Run(setup.compile, way.name)
    torch._dynamo.reset()
    try:
        backend, fx_backend = backend_for(setup, way, profile, cuda)
        step = build_step(setup, way, backend, device)
        sizes = replace(setup, warmup=setup.warmup + SELECTION_WARMUP) if way.select == "measured" else setup
        measure(step, tokens, sizes, cuda, run, compile_context(way))
        if fx_backend is not None:
            predict(fx_backend, run)
            run.notes += selection_notes(fx_backend) + plan_notes(fx_backend)
        if with_profile:
            keep = traces / (re.sub(r"[^A-Za-z0-9.]+", "_", way.name) + ".json.gz") if traces else None
            frontier.profiles[way.name] = profile_step(step, tokens, cuda, keep)
    except Exception as error:  # noqa: BLE001 -- one failing way must not cost the others' figures
        run.error = one_line(error)
        run.notes.append(traceback.format_exc(limit=4)[-1500:])
    return run


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


def _direction(name: str) -> str | None:
    if "HtoD" in name or "Host to Device" in name:
        return "host_to_device"
    if "DtoH" in name or "Device to Host" in name:
        return "device_to_host"
    return None


def summarize_trace(events: list[dict]) -> dict:
    """A Chrome trace's events (torch.profiler's export) as the step's device timeline, in microseconds:
    kernels by kind, each stream's busy time, the compute stream's (the one with the most kernel time)
    idle time within the step's span, copies by direction and the host time of fxoffload's ops. The idle
    time is told apart: while a copy was in flight (a prefetch landing late, most likely), and while the
    host was inside an fxoffload op call (the op's host time holding the device back). Pinned blocks made
    within the step (``cudaHostAlloc``: a steady step makes none) are counted with their host time."""
    kernels: dict[str, dict] = {}
    streams: dict[str, list[tuple[float, float]]] = {}
    kernel_time: dict[str, float] = {}
    kernel_count: dict[str, int] = {}
    copies: dict[str, dict] = {}
    host_ops: dict[str, dict] = {}
    host_calls: Intervals = []
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
        if cat == "cuda_runtime" and name == "cudaHostAlloc":  # a pinned block made within the step
            host_alloc["calls"] += 1
            host_alloc["us"] += dur
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = str(args.get("stream", "?"))
        streams.setdefault(stream, []).append((start, start + dur))
        span = [min(span[0], start), max(span[1], start + dur)]
        if cat == "kernel":
            kind = kernels.setdefault(kernel_kind(name), {"count": 0, "us": 0.0})
            kind["count"] += 1
            kind["us"] += dur
            kernel_time[stream] = kernel_time.get(stream, 0.0) + dur
            kernel_count[stream] = kernel_count.get(stream, 0) + 1
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
    return {"kernels": kernels, "kernel_count": sum(k["count"] for k in kernels.values()),
            "compute_kernels": kernel_count.get(compute, 0),
            "stream_busy_us": busy, "compute_stream": compute, "step_us": step_us,
            "compute_idle_us": step_us - busy[compute] if compute is not None else 0.0,
            "idle_copy_in_flight_us": _overlap(idle, in_flight),
            "idle_in_fxoffload_host_us": _overlap(idle, host_calls),
            "copies": copies, "fxoffload_host": host_ops, "host_alloc": host_alloc}


# ----------------------------------------------------------------------------- the verdicts

@dataclass(frozen=True)
class Point:
    name: str
    peak: float
    step: float


def frontier_line(points: list[Point], peak: float, floor: str | None = None) -> tuple[float, str] | None:
    """PyTorch's step at ``peak`` on the straight line between its two points whose peaks bracket it, with
    the two names; below its lowest point, that point's step where it is ``floor`` (full checkpointing: no
    faster way to hold less), or where ``floor`` is None. None above the highest point (a way that holds more
    than plain is on no line of PyTorch's), and below a lowest point that is not the floor (a run that left
    PyTorch's lower points out brackets nothing there)."""
    ordered = sorted(points, key=lambda p: p.peak)
    if not ordered or peak > ordered[-1].peak:
        return None
    if peak <= ordered[0].peak:
        return (ordered[0].step, ordered[0].name) if floor in (None, ordered[0].name) else None
    for low, high in zip(ordered, ordered[1:]):
        if low.peak <= peak <= high.peak:
            if high.peak == low.peak:
                return min(low.step, high.step), f"{low.name} / {high.name}"
            t = (peak - low.peak) / (high.peak - low.peak)
            return low.step + t * (high.step - low.step), f"{low.name} .. {high.name}"
    return None


def verdicts(runs: list[dict]) -> list[dict]:
    """Each fxoffload way placed against PyTorch's frontier (plain, its budgets, full checkpointing)."""
    points = [Point(r["way"], r["peak_bytes"], r["step_seconds"]) for r in runs
              if not r["error"] and r["peak_bytes"] and _kind(r["way"]) in ("plain", "pytorch", "checkpoint")]
    out = []
    for r in runs:
        if r["error"] or not r["peak_bytes"] or _kind(r["way"]) not in ("fxoffload", "checkpoint+fxoffload"):
            continue
        line = frontier_line(points, r["peak_bytes"], floor=Way("checkpoint").name)
        out.append({"way": r["way"], "peak_bytes": r["peak_bytes"], "step_seconds": r["step_seconds"],
                    "line_seconds": None if line is None else line[0], "between": None if line is None else line[1],
                    "faster_by": None if line is None else 1 - r["step_seconds"] / line[0]})
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
        lines.append(f"| {r['way']} | {_ms(r['step_seconds'])} | {ratio} | {_gib(r['peak_bytes'])} | "
                     f"{_gib(r['held_at_backward'])} | {_ms(r['predicted_step_seconds'])} | "
                     f"{_gib(r['predicted_held_at_backward'])} | {'-' if r['transfers'] is None else r['transfers']} | "
                     f"{_share(over.get(r['way'], (None,))[0])} | {_share(over.get(r['way'], (None, None))[1])} | "
                     f"{_prediction_verdict(*over[r['way']]) if r['way'] in over else '-'} |")
    return lines


def _verdict_lines(frontier: dict) -> list[str]:
    found = verdicts(frontier["runs"])
    if not found:
        return []
    lines = ["", "Against PyTorch's frontier (its step at the same measured peak, on the line between its two "
             "points that bracket it):", "", "| way | step | PyTorch's line | between | faster by |",
             "|---|---|---|---|---|"]
    for v in found:
        if v["line_seconds"] is None:
            lines.append(f"| {v['way']} | {_ms(v['step_seconds'])} | - | on no line of this run's points (above "
                         "plain, or below its lowest point, not full checkpointing) | - |")
            continue
        lines.append(f"| {v['way']} | {_ms(v['step_seconds'])} | {_ms(v['line_seconds'])} | {v['between']} | "
                     f"{v['faster_by']:+.1%} |")
    return lines


def _profile_lines(frontier: dict) -> list[str]:
    profiles = frontier["profiles"]
    if not profiles:
        return []
    plain = profiles.get(Way("plain").name)
    lines = ["", "Profile of one step per way (torch.profiler): kernels on all streams, those added against plain, "
             "the compute stream's busy and idle time within the step, copies each way, fxoffload's host time.", "",
             "| way | kernels | added | compute busy | compute idle | idle, a copy in flight | idle, in our op calls | "
             "step span | to host | to device | fxoffload host time | pinned blocks made |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
                     f"{p['compute_idle_us'] / 1e3:.1f} ms | {p['idle_copy_in_flight_us'] / 1e3:.1f} ms | "
                     f"{p['idle_in_fxoffload_host_us'] / 1e3:.1f} ms | {p['step_us'] / 1e3:.1f} ms | "
                     f"{copy('device_to_host')} | {copy('host_to_device')} | {host} | {_made(p)} |")
    return lines


def _made(profile: dict) -> str:
    made = profile.get("host_alloc")  # absent from runs summarised before it was counted
    return "not counted" if made is None else f"{made['calls']} ({made['us'] / 1e3:.1f} ms)"


def render(frontier: dict) -> str:
    s = frontier["setup"]
    shape = s["shape"]
    kind = "dry run on a CPU (not a GPU measurement)" if frontier["dry_run"] else f"measured on {frontier['device']}"
    lines = [f"Written by `python benchmarks/frontier.py` ({kind}), torch {frontier['torch_version']}, started "
             f"{frontier['started']}, {frontier['seconds']:.0f} s in all. Columns headed predicted are fxoffload's "
             "simulator and memory model; every other figure is measured.", "",
             f"Model: {shape['layers']} Llama-style layers (hidden {shape['hidden']}, {shape['heads']} heads, "
             f"{shape['kv_heads']} KV heads, FFN {shape['ffn']}, vocabulary {shape['vocab']}), batch {s['batch']} x "
             f"{s['seq']} tokens, {s['dtype']}, compiled {s['compile']}, inner compiler {s['inner']}; the median of "
             f"{s['timed']} steps after {s['warmup']} warm-up steps. Peak: `max_memory_allocated` over one step "
             "above what was allocated before it. Held at backward: bytes allocated when the backward began. "
             "Overhead: the step over its set-up's baseline (plain; full checkpointing for the checkpointed way), "
             "measured, and predicted: the simulated extra seconds of the compiled graphs over the baseline's "
             "measured step (predictions leave out the eager embedding, head and loss, in held bytes too). Off "
             "by: the two overheads' difference, as a share of the step.", ""]
    if frontier.get("device_profile"):
        p = frontier["device_profile"]
        lines += [f"Device profile the plans were made with ({p['name']}): copies {p['h2d_bandwidth'] / 1e9:.1f} GB/s "
                  f"to the device, {p['d2h_bandwidth'] / 1e9:.1f} GB/s to the host, duplex {p['duplex']}, memory "
                  f"{p['memory_bandwidth'] / 1e9:.0f} GB/s, " + ", ".join(f"{d} {f / 1e12:.0f} TFLOP/s"
                                                                   for d, f in p["flops"]) + ".", ""]
    lines += _runs_table(frontier) + _verdict_lines(frontier) + _profile_lines(frontier)
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
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds after which the remaining ways "
                        "are skipped (default 540)")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int, help="model size (default: Llama-3-8B's layer, 8 layers, "
                            "1 x 8192 tokens; the dry run's are smaller)")
    parser.add_argument("--compile", choices=COMPILES, help="compile each block (and with per-block+loss the head "
                        "and loss as one region of their own, every way alike), or the step as one "
                        "graph (default per-block)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render GPU runs' frontier.json instead of "
                        "running (several: each under its own heading, a run and its repeat)")
    parser.add_argument("--write", action="store_true", help="with --from-json: write its RESULTS.md section")
    args = parser.parse_args(argv)
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
    return replace(setup, shape=shape, **{f: getattr(args, f) for f in ("seq", "batch", "compile")
                                          if getattr(args, f) is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    for way in chosen_ways(default_ways(args.budgets, args.strategies, args.measured_budgets), args.ways):
        if time.monotonic() - start > args.deadline:
            frontier.skipped.append(f"{way.name}: past the deadline")
            continue
        run = one_way(frontier, way, tokens, device, profile, cuda, args.profile, args.keep_traces)
        frontier.runs.append(run)
        frontier.save(args.out)
        say(f"{way.name}: " + (f"FAILED {run.error}" if run.error else
                               f"step {_ms(run.step_seconds)}, peak {_gib(run.peak_bytes)}"))
    frontier.seconds = time.monotonic() - start
    frontier.save(args.out)
    print(render(asdict(frontier)))
    return 1 if any(r.error for r in frontier.runs) else 0


if __name__ == "__main__":
    sys.exit(main())
