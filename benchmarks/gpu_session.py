"""The first GPU hour in one command: every figure a CPU cannot give, measured beside its prediction.

    python benchmarks/gpu_session.py --out DIR             # on a GPU: under 10 minutes, JSON and Markdown into DIR
    python benchmarks/gpu_session.py --dry-run --out DIR   # every step on this CPU, small sizes (CI runs it)
    python benchmarks/gpu_session.py --from-json F --write # the GPU run's figures into benchmarks/RESULTS.md

A GPU run's JSON is kept under ``benchmarks/measured/`` (nothing else can reproduce it on a CPU).

Steps, in this order (each one's figures are saved as soon as it ends, so a run cut short keeps them):

1. ``fxoffload.calibrate()``: the host link (each way, duplex), latency, device memory bandwidth, FLOP
   rates and the host cost of an fxoffload op call, measured. Every plan below is made for it.
2. ``fxoffload check`` (``fxoffload.tools.check.run_check``): a small GPT trained with and without fxoffload,
   numerics compared, peaks and step times beside their predictions (timed without debug mode).
3. A small Llama (torchtitan-style blocks, bf16, random weights) as three setups: the whole step compiled
   as one graph; each block compiled on its own; each block checkpointed (non-reentrant
   ``checkpoint_wrapper``) and then compiled on its own. Each setup runs four ways: compiled without
   offloading (the baseline), with fxoffload (``strategy="offload"``) at two budgets, and with PyTorch's own
   offloading pass (``torch._functorch.config.enable_activation_offloading``, every saved node marked
   through ``joint_custom_pass`` as PyTorch's tests mark theirs, on its own stream with prefetching).
   Measured per run: the median time of a forward and backward (after two warm-up steps), the device peak
   over one more (``torch.cuda.max_memory_allocated`` above what was allocated before it, gradients
   included), and the device bytes held when the backward began (the saved activations, the loss and
   copies still in flight). Predicted, for fxoffload's runs: the step's simulated time
   (``fxoffload.simulate_step`` over the step's graph runs), the saved bytes when the backward begins and,
   for the one-graph step, the memory model's device peak of the step's tensors. Each run ends with
   ``fxoffload.release_host_memory()``, noting the pinned bytes it gave back, so that the next run's
   count of pinned blocks made (and their host time) is its own.

What the predictions cover: the compiled graphs. With one graph per block, the embedding, the head and the
loss run outside them: their time and the logits they keep are in the measurement only, so compare the
overheads (against the baseline of the same setup) rather than the absolute figures there.

``--dry-run`` runs every step on this CPU with small sizes and the eager inner compiler (the CPU engine
copies on a background thread; ``calibrate`` needs CUDA and is replaced by the default profile, said so):
its figures are not a GPU's, and it never writes RESULTS.md. On a GPU the script writes
``gpu_session.json`` and ``gpu_session.md`` into ``--out``; ``--from-json`` renders that file into the
"GPU session" section of ``benchmarks/RESULTS.md``, marked as measured on the device it names.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]

import fxoffload  # noqa: E402
from _recipes import plain_backend  # noqa: E402
from torchtitan_blocks import Transformer, checkpoint_blocks  # noqa: E402

HEADING = "GPU session (measured)"
BUDGETS = (0.5, 0.25)
# The product's own configuration first: a session cut short by its deadline still brings it back.
SETUPS = ("per block, checkpointed", "per block", "one graph")
# The cost model prices the graph's ATen ops one by one: the same graph run unfused (aot_eager) shows
# how much of a step-time miss is Inductor's fusion.
WITHOUT_INDUCTOR = "compiled, no offloading, aot_eager"


@dataclass(frozen=True)
class Sizes:
    """The small Llama of step 3 and how long each run is timed."""

    layers: int
    dim: int
    heads: int
    vocab: int
    batch: int
    seq: int
    dtype: str
    inner: str  # the inner compiler of every run ("inductor" on a GPU, "eager" in the dry run)
    warmup: int
    timed: int

    @staticmethod
    def for_run(dry_run: bool) -> "Sizes":
        if dry_run:
            return Sizes(layers=2, dim=64, heads=4, vocab=128, batch=2, seq=32, dtype="float32", inner="eager",
                         warmup=2, timed=2)
        return Sizes(layers=4, dim=2048, heads=16, vocab=4096, batch=2, seq=2048, dtype="bfloat16",
                     inner="inductor", warmup=2, timed=5)


@dataclass
class Run:
    """One way of running one setup: what was measured, and what fxoffload predicted (None where nothing)."""

    setup: str
    way: str
    step_seconds: float | None = None
    step_samples: list[float] = field(default_factory=list)  # every timed step, in order (the median is above)
    # Pinned blocks CUDA's host allocator made in each timed step (``num_host_alloc``; empty where it counts
    # none): a timed step that made one (13-49 ms of host time each) was not a steady step.
    step_host_allocs: list[int] = field(default_factory=list)
    forward_seconds: float | None = None  # the compute stream's forward (CUDA events)
    predicted_forward_seconds: float | None = None
    peak_bytes: int | None = None
    held_at_backward: int | None = None
    predicted_step_seconds: float | None = None
    predicted_compute_seconds: float | None = None
    predicted_held_at_backward: int | None = None
    predicted_baseline_held: int | None = None
    predicted_peak_bytes: int | None = None
    # Pinned host bytes CUDA's host allocator had handed out when the backward began, above what it had
    # out before the step ("active_bytes.current"; its per-bucket "peak" is not a peak of one step).
    pinned_at_backward: int | None = None
    predicted_pinned_bytes: int | None = None  # the step's host copies in pinned power-of-two blocks
    host_allocs: int | None = None  # pinned blocks CUDA allocated over the whole run (cudaHostAlloc calls)
    host_alloc_seconds: float | None = None  # and the host time they took
    transfers: int | None = None
    offloaded_bytes: int | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Session:
    device: str
    torch_version: str
    dry_run: bool
    started: str
    sizes: Sizes
    profile: dict = field(default_factory=dict)
    check: dict = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    ops: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def save(self, out: Path | None) -> None:
        from results import save_run

        save_run(out, "gpu_session", self, render)


# ----------------------------------------------------------------------------- steps 1 and 2

def calibrate_step(session: Session, cuda: bool, say: Callable[[str], None]) -> Any:
    """Step 1: the calibrated profile on CUDA; the backend's default profile in the dry run (said so)."""
    if not cuda:
        profile = fxoffload.offload_backend().config.profile
        session.profile = {"name": profile.name, "measured": False,
                           "note": "dry run: no CUDA device, fxoffload.calibrate() not run; the default profile"}
        say(f"calibrate: would measure the link and the device; using the {profile.name} profile")
        return profile
    profile = fxoffload.calibrate()
    session.profile = {"measured": True, **{k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                            for k, v in asdict(profile).items()}}
    say(f"calibrate: {session.profile}")
    return profile


def check_step(session: Session, cuda: bool, say: Callable[[str], None]) -> None:
    """Step 2: ``fxoffload check`` (its timed steps run without debug mode)."""
    from fxoffload.tools.check import CheckConfig, format_report, run_check

    report = run_check(CheckConfig(), progress=lambda line: say(f"check: {line}"))
    session.check = report.as_dict()
    say(format_report(report))


# ----------------------------------------------------------------------------- step 3

class LossOf(nn.Module):
    """The whole step as one module (tokens in, loss out), so that one graph holds all of it."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def model_and_tokens(sizes: Sizes, cuda: bool) -> tuple[torch.device, Transformer, torch.Tensor]:
    """The device, the model every run copies (seeded weights), and the one batch every run trains on."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    base = Transformer(sizes.layers, sizes.dim, sizes.heads, sizes.vocab).to(getattr(torch, sizes.dtype))
    tokens = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    return device, base, tokens


def build(setup: str, device: torch.device, base: Transformer) -> Transformer:
    model = copy.deepcopy(base).to(device)
    if setup == "per block, checkpointed":
        checkpoint_blocks(model)
    return model


def compiled(model: Transformer, setup: str, backend: Any) -> nn.Module:
    """The step's module with ``backend`` over the whole step, or over each block."""
    if setup == "one graph":
        return torch.compile(LossOf(model), backend=backend)
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, backend=backend, fullgraph=True))
    return LossOf(model)


def mark_every_saved_node(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """PyTorch's offloading pass offloads the marked nodes that the forward saves (and can move)."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True
    return gm


def pytorch_pass_config(separate_stream: bool) -> dict:
    options = {"enable_activation_offloading": True, "joint_custom_pass": mark_every_saved_node}
    if separate_stream:  # its own stream, wait sinking and prefetching: CUDA streams only
        options.update(activation_offload_separate_stream=True, activation_offload_sink_wait=True,
                       activation_reload_prefetch=True)
    return options


def pytorch_pass_run(sizes: Sizes, setup: str, base: Transformer, tokens: torch.Tensor, device: torch.device,
                     cuda: bool, run: Run) -> Run:
    """PyTorch's pass on its own copy stream with prefetching (CUDA), else, or where that fails (torch
    2.11's stream ops do not compile under Inductor), on the compute stream: synchronous copies."""
    for separate in ((True, False) if cuda else (False,)):
        torch._dynamo.reset()
        model = build(setup, device, base)
        try:
            measure(compiled(model, setup, plain_backend(sizes.inner)), tokens, sizes, cuda, run,
                    lambda: torch._functorch.config.patch(**pytorch_pass_config(separate)))
        except Exception as error:  # noqa: BLE001 -- recorded; the compute-stream version is tried next
            run.notes.append(f"{'own copy stream' if separate else 'compute stream'}: {_one_line(error)}")
            run.error = _one_line(error)
            continue
        run.error = None
        run.notes.append("copies on its own stream, prefetched" if separate else
                         "copies on the compute stream (synchronous)")
        run.way = f"{run.way} ({'own stream' if separate else 'compute stream'})"
        break
    return run


def _host_stats(cuda: bool) -> dict:
    """CUDA's pinned host allocator's counters (``torch.cuda.memory.host_memory_stats``; {} where this torch
    or machine has none): fxoffload's host buffers come from it."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None) if cuda else None
    if stats is None:
        return {}
    try:
        return dict(stats())
    except Exception:  # noqa: BLE001 -- an optional figure
        return {}


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


@dataclass
class Steps:
    """One way's timed steps as they ran (:func:`timed_step`), put into its :class:`Run` by :func:`record_steps`."""

    seconds: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)  # the forward's device time (CUDA events)
    host_allocs: list[int] = field(default_factory=list)  # pinned blocks each step made


def _no_grads(step: nn.Module) -> None:
    for p in step.parameters():
        p.grad = None


def warm_up(step: nn.Module, tokens: torch.Tensor, steps: int, warm: Callable[[], Any]) -> None:
    """``steps`` steps inside ``warm``'s context (the compile)."""
    with warm():
        for _ in range(steps):
            _no_grads(step)
            step(tokens).backward()


def timed_step(step: nn.Module, tokens: torch.Tensor, cuda: bool, steps: Steps) -> None:
    """One step timed from a synchronized device to a synchronized device, added to ``steps``."""
    params = list(step.parameters())
    _sync(cuda)
    made = _host_stats(cuda).get("num_host_alloc")  # outside the timed window, as its pair below
    start = time.perf_counter()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    for p in params:
        p.grad = None
    if events:
        events[0].record()
    loss = step(tokens)
    if events:  # on the compute stream: the forward's end as the device reached it, no synchronization
        events[1].record()
    loss.backward()
    _sync(cuda)
    steps.seconds.append(time.perf_counter() - start)
    after = _host_stats(cuda).get("num_host_alloc")
    if made is not None and after is not None:
        steps.host_allocs.append(int(after - made))
    if events:
        steps.forward.append(events[0].elapsed_time(events[1]) / 1e3)


def record_steps(run: Run, steps: Steps, note: bool = True) -> None:
    """The median step, every sample, and the pinned blocks each made (with ``note``, named in the notes
    where any did: once, when the steps are all in)."""
    run.step_seconds = statistics.median(steps.seconds)
    run.step_samples = list(steps.seconds)
    run.step_host_allocs = list(steps.host_allocs)
    if note and any(run.step_host_allocs):
        run.notes.append("pinned blocks made in each timed step: " + ", ".join(map(str, run.step_host_allocs)))
    run.forward_seconds = statistics.median(steps.forward) if steps.forward else None


def measure_memory(step: nn.Module, tokens: torch.Tensor, cuda: bool, run: Run, first: dict,
                   release: bool = True) -> None:
    """One more step, measured for memory: its peak and what it held at the backward's start. ``first``:
    the pinned allocator's counters before the way's first step (the blocks made since are noted). With
    ``release``, the cached pinned blocks are given back after it (the next way starts from none)."""
    _no_grads(step)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        pinned_before = _host_stats(cuda).get("active_bytes.current")
        loss = step(tokens)
        torch.cuda.synchronize()
        run.held_at_backward = torch.cuda.memory_allocated() - before
        pinned = _host_stats(cuda).get("active_bytes.current")
        if pinned is not None and pinned_before is not None:
            run.pinned_at_backward = int(pinned - pinned_before)
        loss.backward()
        torch.cuda.synchronize()
        run.peak_bytes = torch.cuda.max_memory_allocated() - before
        last = _host_stats(cuda)
        if first and last:
            run.host_allocs = int(last.get("num_host_alloc", 0) - first.get("num_host_alloc", 0))
            run.host_alloc_seconds = (last.get("host_alloc_time.total", 0)
                                      - first.get("host_alloc_time.total", 0)) / 1e6
            run.notes.append(f"pinned blocks CUDA allocated over the run's steps: {run.host_allocs}, "
                             f"{run.host_alloc_seconds * 1e3:.1f} ms of host time in all")
        del loss
        # Each run starts from an empty cache of pinned blocks (the counts above are its own), and the
        # release itself is measured: what fxoffload.release_host_memory gave back.
        released = fxoffload.release_host_memory() if release else None
        if released is not None:
            run.notes.append(f"release_host_memory gave back {released / 2**20:.1f} MiB of cached pinned blocks")
    else:
        def one() -> torch.Tensor:
            _no_grads(step)
            loss = step(tokens)
            loss.backward()
            return loss

        run.peak_bytes = fxoffload.measure_peak(one).total_peak
    _no_grads(step)


def measure(step: nn.Module, tokens: torch.Tensor, sizes: Sizes, cuda: bool, run: Run,
            warm: Callable[[], Any]) -> None:
    """Warm-up steps (inside ``warm``'s context: the compile), then timed steps, then one measured for memory."""
    first = _host_stats(cuda)
    warm_up(step, tokens, sizes.warmup, warm)
    steps = Steps()
    for _ in range(sizes.timed):
        timed_step(step, tokens, cuda, steps)
    record_steps(run, steps)
    measure_memory(step, tokens, cuda, run, first)


def predict(backend: Any, run: Run) -> None:
    """fxoffload's predictions for the step that just ran (its last one)."""
    from fxoffload.passes.step import simulate_step

    invocations = backend.step_invocations() or list(backend.records[-1:])
    kept = backend.step_caller_kept() if backend.step_invocations() else None
    sim = simulate_step(invocations, caller_kept=kept)
    run.predicted_step_seconds, run.predicted_compute_seconds = sim.step_time, sim.compute_time
    run.predicted_forward_seconds = sim.backward_start
    run.predicted_pinned_bytes = sim.pinned_host_bytes
    forward_ops = sum(1 for start, _ in sim.activations if start < sim.backward_start)
    repartitioned = any(r.plan.partition.startswith("recompute-only") for r in invocations)
    if forward_ops:
        run.predicted_held_at_backward = sim.activations[forward_ops - 1][1]
        # A graph PyTorch's recompute-only partitioner re-partitioned is its own baseline in the
        # simulation: the saving against the plain partition is not predicted there.
        run.predicted_baseline_held = None if repartitioned else sim.baseline_activations[forward_ops - 1][1]
    if repartitioned:
        run.notes.append("strategy auto chose PyTorch's recompute-only partition: the simulated step's own "
                         "baseline is that graph, so no saving is predicted against the plain partition")
    plans = {id(r): r.plan for r in invocations}
    run.transfers = sum(len(r.plan.transfers) for r in invocations)
    run.offloaded_bytes = sum(int(t.nbytes) for r in invocations for t in r.plan.transfers)
    if len(plans) == 1 and len(invocations) == 1:
        run.predicted_peak_bytes = invocations[0].plan.total_peak_after
    run.notes.append(f"{len(invocations)} graph runs per step, {len(plans)} distinct plan(s)")
    if not all(plan.feasible for plan in plans.values()):
        run.notes.append("the budget was out of reach: the plan is the lowest peak it could reach "
                         "(on_infeasible='warn')")


def one_run(sizes: Sizes, setup: str, way: str, base: Transformer, tokens: torch.Tensor, device: torch.device,
            profile: Any, cuda: bool) -> Run:
    """Build, compile, run and measure one way of one setup; an error is recorded, not raised."""
    run = Run(setup, way)
    torch._dynamo.reset()
    try:
        model = build(setup, device, base)
        backend: Any = "aot_eager" if way == WITHOUT_INDUCTOR else plain_backend(sizes.inner)
        fx_backend = None
        if way.startswith("fxoffload"):
            budget = float(way.split()[-1])
            # on_infeasible="warn": a budget below what offloading can reach still runs, at the lowest peak
            # it can (the notes say so), so that the session brings back a figure for it.
            fx_backend = backend = fxoffload.offload_backend(
                memory_budget=budget, strategy="auto" if "auto" in way else "offload", inner=sizes.inner,
                device_profile=profile,
                on_infeasible="warn", **({"min_bytes": 0} if not cuda else {}))
        elif way == "PyTorch's offloading pass":
            return pytorch_pass_run(sizes, setup, base, tokens, device, cuda, run)
        measure(compiled(model, setup, backend), tokens, sizes, cuda, run, contextlib.nullcontext)
        if fx_backend is not None:
            predict(fx_backend, run)
            run.notes.append(f"transfers pending after the steps: {fxoffload.runtime.pending_transfers()}")
    except Exception as error:  # noqa: BLE001 -- one failing way must not cost the session's other figures
        run.error = _one_line(error)
        run.notes.append(traceback.format_exc(limit=4)[-1500:])
    return run


def _one_line(error: BaseException) -> str:
    """The innermost message of an error (dynamo wraps a backend's error in lines of its own)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    last = raised[-1] if raised else next((line for line in reversed(lines) if not line.startswith(
        ("Set TORCHDYNAMO", "Use tlparse"))), "")
    return f"{type(error).__name__}: {last}"[:400]


def llama_step(session: Session, profile: Any, cuda: bool, deadline: float, say: Callable[[str], None],
               out: Path | None) -> None:
    """Step 3: every setup, every way (see the module docstring)."""
    sizes = session.sizes
    device, base, tokens = model_and_tokens(sizes, cuda)
    ways = ["compiled, no offloading", *(f"fxoffload, budget {b}" for b in BUDGETS),
            f"fxoffload auto, budget {BUDGETS[0]}", "PyTorch's offloading pass", WITHOUT_INDUCTOR]
    for setup in SETUPS:
        for way in ways:
            if time.monotonic() > deadline:
                session.skipped.append(f"{setup} / {way}: past the deadline")
                say(f"skipped {setup} / {way}: past the deadline")
                continue
            if way == WITHOUT_INDUCTOR and setup != "one graph":
                continue
            run = one_run(sizes, setup, way, base, tokens, device, profile, cuda)
            session.runs.append(run)
            session.save(out)
            say(f"{setup} / {way}: " + (f"FAILED {run.error}" if run.error else row_text(asdict(run))))


def _op_key(node: torch.fx.Node) -> str:
    """A graph node's op as the profiler names it ("aten::mm")."""
    packet = getattr(node.target, "overloadpacket", None)
    return str(packet).replace(".", "::", 1) if packet is not None else str(node.target)


def ops_step(session: Session, profile: Any, cuda: bool, say: Callable[[str], None]) -> None:
    """Step 4: where the step-time prediction goes wrong, op by op. The one-graph step compiled by
    fxoffload with nothing to offload (budget 1.0) and the eager inner compiler, so that the graph that
    runs is the one the cost model priced, op for op; one step profiled (``torch.profiler``: each ATen
    op's device time, its kernels included) beside the cost model's seconds for the same ops."""
    from fxoffload.passes.cost_model import roofline

    sizes = session.sizes
    torch._dynamo.reset()
    device, base, tokens = model_and_tokens(sizes, cuda)
    backend = fxoffload.offload_backend(memory_budget=1.0, inner="eager", device_profile=profile)
    step = compiled(build("one graph", device, base), "one graph", backend)
    for _ in range(2):
        step(tokens).backward()
    _sync(cuda)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step(tokens).backward()
        _sync(cuda)
    measured = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) if cuda else getattr(event, "cpu_time_total", None)
        if total is None and cuda:
            total = getattr(event, "cuda_time_total", 0)
        measured[event.key] = (event.count, (total or 0) / 1e6)
    record = backend.records[-1]
    predicted: dict[str, list] = {}
    for node, work in zip(record.timeline.nodes, record.work):
        if node.op != "call_function":
            continue
        entry = predicted.setdefault(_op_key(node), [0, 0.0])
        entry[0] += 1
        entry[1] += roofline(work, record.profile)
    rows = [{"op": op, "graph_nodes": n, "predicted_seconds": t, "profiled_calls": measured.get(op, (None, None))[0],
             "measured_seconds": measured.get(op, (None, None))[1]} for op, (n, t) in predicted.items()]
    rows.sort(key=lambda r: -max(r["predicted_seconds"], r["measured_seconds"] or 0.0))
    session.ops = {"profile": record.profile.name, "device_time": cuda, "rows": rows,
                   "predicted_total": sum(r["predicted_seconds"] for r in rows),
                   "measured_total": sum(r["measured_seconds"] or 0.0 for r in rows)}
    say(f"ops: predicted {session.ops['predicted_total'] * 1e3:.2f} ms, measured "
        f"{session.ops['measured_total'] * 1e3:.2f} ms over {len(rows)} ops")


# ----------------------------------------------------------------------------- rendering

def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f} MiB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f} ms"


def _miss(predicted: float | None, measured: float | None) -> str:
    if not predicted or measured is None:
        return ""
    return f" ({measured / predicted - 1:+.0%})"


def row_text(run: dict) -> str:
    return (f"step {_ms(run['step_seconds'])} (predicted {_ms(run['predicted_step_seconds'])}), peak "
            f"{_mb(run['peak_bytes'])} (predicted {_mb(run['predicted_peak_bytes'])}), held at backward "
            f"{_mb(run['held_at_backward'])} (predicted {_mb(run['predicted_held_at_backward'])})")


def _baselines(session: dict) -> dict:
    return {r["setup"]: r for r in session["runs"] if r["way"] == "compiled, no offloading" and not r["error"]}


def _saved(run: dict, base: dict | None) -> tuple[int | None, int | None]:
    """Bytes held when the backward began, less than without offloading: (measured, predicted). Like for like
    in every setup (the logits a per-block step keeps outside the graphs cancel)."""
    measured = None if base is None or run["held_at_backward"] is None or base["held_at_backward"] is None else \
        base["held_at_backward"] - run["held_at_backward"]
    predicted = None if run["predicted_baseline_held"] is None else \
        run["predicted_baseline_held"] - run["predicted_held_at_backward"]
    return measured, predicted


def _compute_prediction(session: dict, setup: str) -> float | None:
    """The simulated step without offloading (the same for every fxoffload run of the setup)."""
    return next((r["predicted_compute_seconds"] for r in session["runs"]
                 if r["setup"] == setup and r["predicted_compute_seconds"]), None)


def misses(session: dict, tolerance: float = 0.10) -> list[str]:
    """Every prediction more than ``tolerance`` from its measurement: the closing note lists them."""
    out = []
    baselines = _baselines(session)
    for r in session["runs"]:
        if r["error"]:
            continue
        base = baselines.get(r["setup"])
        if r is base or r["way"] == WITHOUT_INDUCTOR:
            pairs = [("step time without offloading", _compute_prediction(session, r["setup"]), r["step_seconds"])]
        else:
            pairs = [("step time", r["predicted_step_seconds"], r["step_seconds"]),
                     ("device peak", r["predicted_peak_bytes"], r["peak_bytes"]),
                     ("saved at the backward's start", *reversed(_saved(r, base))),
                     ("pinned host memory at the backward's start", r.get("predicted_pinned_bytes"),
                      r.get("pinned_at_backward"))]
        if base and r is not base and r["predicted_step_seconds"] and r["predicted_compute_seconds"]:
            pairs.append(("step time over the baseline's", r["predicted_step_seconds"] / r["predicted_compute_seconds"],
                          r["step_seconds"] / base["step_seconds"]))
        for what, predicted, measured in pairs:
            if predicted and measured is not None and abs(measured / predicted - 1) > tolerance:
                out.append(f"{r['setup']} / {r['way']}: {what} predicted {predicted:.4g}, measured {measured:.4g} "
                           f"({measured / predicted - 1:+.0%})")
    for f in session["check"].get("figures", []):
        if f["predicted"] and f["measured"] is not None and abs(f["measured"] / f["predicted"] - 1) > tolerance:
            out.append(f"check: {f['name']}: predicted {f['predicted']:.4g}, measured {f['measured']:.4g}")
    return out


def _worth_noting(note: str) -> bool:
    """Notes the table does not already say: not tracebacks (the JSON keeps them), nor zero counts."""
    return not (note.startswith("Traceback") or note.endswith("after the steps: 0")
                or note.startswith("pinned blocks CUDA allocated over the run's steps: 0,"))


def _llama_row(session: dict, r: dict, baselines: dict) -> str:
    if r["error"]:
        return f"| {r['setup']} | {r['way']} | failed: {r['error'][:200]} | | | | | | | | | | | |"
    base = baselines.get(r["setup"])
    unplanned = r is base or r["way"] == WITHOUT_INDUCTOR
    predicted_step = _compute_prediction(session, r["setup"]) if unplanned else r["predicted_step_seconds"]
    measured_saved, predicted_saved = _saved(r, base) if r is not base else (None, None)
    return (f"| {r['setup']} | {r['way']} | {_ms(r['step_seconds'])} | {_ms(predicted_step)}"
            f"{_miss(predicted_step, r['step_seconds'])} | {_ms(r.get('forward_seconds'))} | "
            f"{_ms(r.get('predicted_forward_seconds'))} | {_mb(r['held_at_backward'])} | {_mb(measured_saved)} | "
            f"{_mb(predicted_saved)}{_miss(predicted_saved, measured_saved)} | {_mb(r['peak_bytes'])} | "
            f"{_mb(r['predicted_peak_bytes'])}{_miss(r['predicted_peak_bytes'], r['peak_bytes'])} | "
            f"{_mb(r.get('pinned_at_backward'))} | {_mb(r.get('predicted_pinned_bytes'))}"
            f"{_miss(r.get('predicted_pinned_bytes'), r.get('pinned_at_backward'))} | "
            f"{'-' if r['transfers'] is None else r['transfers']} |")


def _ops_lines(ops: dict, top: int = 15) -> list[str]:
    if not ops:
        return []
    if "error" in ops:
        return ["", f"Op by op: failed: {ops['error']}"]
    clock = "device time (torch.profiler)" if ops["device_time"] else "CPU time (torch.profiler; dry run)"
    lines = ["", f"Op by op, the one-graph step without offloading run unfused (the graph the cost model prices): "
             f"predicted {_ms(ops['predicted_total'])} in all (profile {ops['profile']}), measured "
             f"{_ms(ops['measured_total'])} ({clock}); the {top} largest:", "",
             "| op | graph nodes | predicted | measured | calls profiled |", "|---|---|---|---|---|"]
    for r in ops["rows"][:top]:
        lines.append(f"| {r['op']} | {r['graph_nodes']} | {_ms(r['predicted_seconds'])} | "
                     f"{_ms(r['measured_seconds'])}{_miss(r['predicted_seconds'], r['measured_seconds'])} | "
                     f"{'-' if r['profiled_calls'] is None else r['profiled_calls']} |")
    return lines


def render(session: dict) -> str:
    """The Markdown section: the profile, the check, one table of the Llama runs, the misses."""
    s = session["sizes"]
    kind = "dry run on a CPU (not a GPU measurement)" if session["dry_run"] else f"measured on {session['device']}"
    lines = [f"Written by `python benchmarks/gpu_session.py` ({kind}), torch {session['torch_version']}, started "
             f"{session['started']}, {session['seconds']:.0f} s in all. Columns headed predicted are fxoffload's "
             "memory model, cost model and simulator for the profile below; every other figure is measured.", ""]
    p = session["profile"]
    if p.get("measured"):
        lines.append("Calibrated (`fxoffload.calibrate()`, measured): " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in p.items() if k != "measured"))
    else:
        lines.append(f"Profile: {p.get('name')} ({p.get('note', '')})")
    check = session["check"]
    if check:
        lines += ["", f"`fxoffload check` on {check['device']} (profile {check['profile']}): "
                  f"{'PASS' if check['passed'] else 'FAIL'}.", "",
                  "| figure | predicted | measured | verdict |", "|---|---|---|---|"]
        for f in check["figures"]:
            def value(v):
                return "-" if v is None else (_mb(v) if f["unit"] == "B" else
                                              _ms(v) if f["unit"] == "s" else f"{v:.3g}")

            lines.append(f"| {f['name']} | {value(f['predicted'])} | {value(f['measured'])} | {f['verdict']} |")
    lines += ["", f"Llama-style model: {s['layers']} blocks, dim {s['dim']}, {s['heads']} heads, vocabulary "
              f"{s['vocab']}, batch {s['batch']} x {s['seq']}, {s['dtype']}, inner compiler {s['inner']}; "
              f"median of {s['timed']} forward+backward steps after {s['warmup']} warm-up steps. Budgets are "
              "fractions of the activation peak without offloading; fxoffload runs use strategy \"offload\" "
              "unless marked auto. Predicted step time of a run without offloading: the simulated step of the "
              "same graphs without copies. Held: device bytes allocated when the backward began (saved "
              "activations, the loss, copies in flight); saved: the baseline's held less the run's. Peak: "
              "`max_memory_allocated` over one forward and backward, above what was allocated before it "
              "(gradients included); predicted for a one-graph step only (the memory model's device peak). Pinned "
              "host at backward: the bytes CUDA's pinned host allocator had handed out when the backward began, "
              "above what it had out before the step (absent from runs before this column existed); predicted: "
              "the step's host copies in power-of-two pinned blocks.", "",
              "| setup | way | step time | predicted | forward | predicted | held at backward | saved | predicted | "
              "peak | predicted | pinned host at backward | predicted | copies |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    baselines = _baselines(session)
    lines += [_llama_row(session, r, baselines) for r in session["runs"]]
    notes = [f"{r['setup']} / {r['way']}: {n}" for r in session["runs"] for n in r["notes"] if _worth_noting(n)]
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    if session["skipped"]:
        lines += ["", "Skipped: " + "; ".join(session["skipped"])]
    lines += _ops_lines(session.get("ops") or {})
    found = misses(session)
    lines += ["", "Predictions more than 10% from their measurements:" if found else
              "Every prediction within 10% of its measurement."]
    lines += [f"- {m}" for m in found]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on this CPU, small sizes")
    parser.add_argument("--out", type=Path, help="folder for gpu_session.json and gpu_session.md")
    parser.add_argument("--deadline", type=float, default=500.0,
                        help="seconds after which the remaining Llama runs are skipped (default 500)")
    parser.add_argument("--skip", action="append", default=[], choices=("calibrate", "check", "llama", "ops"),
                        help="leave a step out (repeatable)")
    parser.add_argument("--from-json", type=Path, help="render a GPU run's gpu_session.json instead of running")
    parser.add_argument("--write", action="store_true", help="with --from-json: write its RESULTS.md section")
    parser.add_argument("--heading", default=HEADING, help=f"with --write: the section's heading (default {HEADING!r})")
    args = parser.parse_args(argv)
    from results import gpu_or_dry_run, show_measured

    if args.from_json:
        show_measured("gpu_session", args.heading, args.from_json, args.write, render)
        return 0
    cuda = gpu_or_dry_run("gpu_session", args.write, args.dry_run)
    start = time.monotonic()
    say = lambda line: print(f"[{time.monotonic() - start:6.1f} s] {line}", flush=True)  # noqa: E731
    session = Session(torch.cuda.get_device_name() if cuda else "cpu", torch.__version__, not cuda,
                      datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      Sizes.for_run(not cuda))
    profile = calibrate_step(session, cuda, say) if "calibrate" not in args.skip else \
        fxoffload.offload_backend().config.profile
    session.save(args.out)
    if "check" not in args.skip:
        check_step(session, cuda, say)
        session.save(args.out)
    if "llama" not in args.skip:
        llama_step(session, profile, cuda, start + args.deadline, say, args.out)
    if "ops" not in args.skip:
        try:
            ops_step(session, profile, cuda, say)
        except Exception as error:  # noqa: BLE001 -- a diagnostic: the figures above are kept
            session.ops = {"error": _one_line(error)}
            say(f"ops: FAILED {_one_line(error)}")
        session.save(args.out)
    session.seconds = time.monotonic() - start
    session.save(args.out)
    print(render(asdict(session)))
    failed = [r for r in session.runs if r.error and r.way != "PyTorch's offloading pass"]
    check_failed = bool(session.check) and not session.check["passed"]
    return 1 if failed or check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
