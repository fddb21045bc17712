"""``fxoffload check``: fxoffload on this machine, each figure measured beside its prediction.

Flow (:func:`run_check`):

1. The device. On CUDA, ``fxoffload.calibrate`` measures the link and the device first, so that
   the plan and its predictions are for this machine. Without CUDA the same flow runs on the CPU
   engine and says so: "device" memory is host memory there, and step times show what the
   protocol costs on this CPU, not a GPU's (their predictions are for the default profile).
2. A small GPT-style model built from :class:`CheckConfig` (plain PyTorch, random weights, fp32,
   TF32 off, calibration included), trained for ``steps`` SGD steps three times from the same
   weights and batches: compiled plainly (the same inner compiler and min-cut partition, no fxoffload:
   ``inductor``, or ``aot_eager_decomp_partition`` for the eager inner; plain ``aot_eager``'s default
   partition saves other tensors than the plan's prediction counts), compiled with
   fxoffload in debug mode (``debug=True``: NaN-filled destinations on CUDA, stall counts), for
   the numerics, and compiled with fxoffload without debug mode, for the times and memory (debug
   mode's NaN fills cost time of their own).
3. Numerics: every step's loss and the final weights, fxoffload against plain (relative 1e-4,
   absolute 1e-5); no transfer left pending. Debug mode also counts the copies the engine put
   through a staging buffer, against those the plans counted (reported, not failed: an unplanned
   one holds memory the model did not count).
4. Memory of one more step each: the peak of the tensors the step creates (CUDA: the caching
   allocator's ``max_memory_allocated`` above what was allocated before the step; CPU:
   ``fxoffload.measure_peak``, which also gives the activation peak and the host copies' peak),
   against the memory model's prediction.
5. Step time: the median of the timed steps (the first, which compiles, left out; with
   fxoffload, the run without debug mode), against the simulator's.

Verdicts. The numerics must match and no transfer may stay pending: ``passed`` is False otherwise
(the command exits 1). A memory figure is "ok" within 10% of its prediction, else "off" (reported,
not failed: allocator rounding and workspaces are not modelled). A time on CUDA is "ok" within 25%;
on a CPU it is "not comparable".
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

import fxoffload
from fxoffload import runtime
from fxoffload.passes import plan_digest, simulate
from fxoffload.tools.measure import measure_peak


__all__ = ["CheckConfig", "CheckReport", "Figure", "TinyGPT", "run_check"]

MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.25


@dataclass(frozen=True)
class CheckConfig:
    """The model and the run. ``None`` sizes take the device's default (small on a CPU)."""

    layers: int = 2
    hidden: int | None = None
    heads: int = 4
    vocab: int = 256
    seq: int | None = None
    batch: int = 4
    steps: int = 4
    memory_budget: Any = 0.5
    inner: str | None = None  # "eager" on a CPU, "inductor" on CUDA
    seed: int = 0

    def __post_init__(self) -> None:
        for name, least in (("layers", 1), ("heads", 1), ("vocab", 1), ("batch", 1), ("steps", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                why = " (the first step compiles)" if name == "steps" else ""
                raise ValueError(f"{name}: got {value!r}; accepted: an int >= {least}{why}")
        for name in ("hidden", "seq"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: got {value!r}; accepted: an int >= 1, or None (the device's default)")
        if self.hidden is not None and self.hidden % self.heads:
            raise ValueError(f"hidden: got {self.hidden}; accepted: a multiple of heads={self.heads}")
        if self.inner not in (None, "eager", "inductor"):
            raise ValueError(f"inner: got {self.inner!r}; accepted: 'eager', 'inductor', or None "
                             "(the device's default)")

    def on(self, cuda: bool) -> "CheckConfig":
        """This config with its defaults filled in for the device."""
        return dataclasses.replace(self, hidden=self.hidden or (512 if cuda else 64),
                                   seq=self.seq or (512 if cuda else 64),
                                   inner=self.inner or ("inductor" if cuda else "eager"))


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc, self.out = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """A GPT-style language model from a :class:`CheckConfig`; ``forward(ids)`` returns the next-token loss."""

    def __init__(self, config: CheckConfig) -> None:
        super().__init__()
        if config.hidden is None or config.seq is None:
            raise ValueError("TinyGPT needs a config with its sizes filled in (CheckConfig.on)")
        self.embed = torch.nn.Embedding(config.vocab, config.hidden)
        self.position = torch.nn.Embedding(config.seq, config.hidden)
        self.blocks = torch.nn.ModuleList(_Block(config.hidden, config.heads) for _ in range(config.layers))
        self.ln, self.head = torch.nn.LayerNorm(config.hidden), torch.nn.Linear(config.hidden, config.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@dataclass(frozen=True)
class Figure:
    """One row: what it is, its prediction and measurement (None where there is none), and the verdict."""

    name: str
    predicted: float | None
    measured: float | None
    unit: str  # "B", "s", "" (a count or a ratio)
    verdict: str  # "ok", "FAIL", "off (x1.23)", "not comparable", "info"


@dataclass
class CheckReport:
    device: str
    cuda: bool
    config: CheckConfig
    profile: str
    notes: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(f.verdict == "FAIL" for f in self.figures)

    def as_dict(self) -> dict:
        return {"device": self.device, "cuda": self.cuda, "config": asdict(self.config), "profile": self.profile,
                "notes": self.notes, "passed": self.passed, "figures": [asdict(f) for f in self.figures]}


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _train(model: torch.nn.Module, batches: list[torch.Tensor], cuda: bool) -> tuple[list[float], list[float]]:
    """SGD steps over ``batches``: each step's loss and measured seconds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, seconds = [], []
    for ids in batches:
        _sync(cuda)
        start = time.perf_counter()
        loss = model(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(cuda)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, seconds


def _step_memory(model: torch.nn.Module, ids: torch.Tensor, cuda: bool) -> dict[str, int]:
    """Peak bytes of the tensors one forward and backward creates (and, on a CPU, its activation and host peaks)."""
    def step() -> torch.Tensor:
        loss = model(ids)
        loss.backward()
        return loss

    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = {"total": torch.cuda.max_memory_allocated() - before}
    else:

        measured = measure_peak(step)
        peak = {"total": measured.total_peak, "activation": measured.activation_peak, "host": measured.host_peak}
    model.zero_grad(set_to_none=True)
    return peak


def _memory_figure(name: str, predicted: int, measured: int | None) -> Figure:
    if measured is None:
        return Figure(name, predicted, None, "B", "not measured")
    ratio = measured / predicted if predicted else (1.0 if not measured else float("inf"))
    verdict = "ok" if abs(ratio - 1) <= MEMORY_TOLERANCE else f"off (x{ratio:.2f})"
    return Figure(name, predicted, measured, "B", verdict)


def _time_figure(name: str, predicted: float, measured: float, cuda: bool) -> Figure:
    if not cuda:
        return Figure(name, predicted, measured, "s", "not comparable")
    ratio = measured / predicted if predicted else float("inf")
    return Figure(name, predicted, measured, "s", "ok" if abs(ratio - 1) <= TIME_TOLERANCE else f"off (x{ratio:.2f})")


def _numerics(plain: tuple, offloaded: tuple, models: tuple, staged_planned: int) -> list[Figure]:
    """Losses and final weights of the two runs, the transfers left pending, and what debug mode counted
    (``staged_planned``: the copies the plans put through a staging buffer over the run's steps)."""

    losses = torch.tensor(plain[0], dtype=torch.float64), torch.tensor(offloaded[0], dtype=torch.float64)
    weights = [(a.detach(), b.detach()) for a, b in zip(models[0].parameters(), models[1].parameters())]
    match = torch.allclose(losses[1], losses[0], rtol=1e-4, atol=1e-5) and all(
        torch.allclose(b, a, rtol=1e-4, atol=1e-5) for a, b in weights)
    worst = max(float(((b - a).abs() / (a.abs() + 1e-5)).max()) for a, b in weights)
    pending = runtime.pending_transfers()
    counts = runtime.debug_counts(reset=True)
    return [
        Figure(f"losses ({len(losses[0])} steps) and final weights, fxoffload vs plain: largest relative "
               "weight difference", None, worst, "", "ok" if match else "FAIL"),
        Figure("transfers left pending after the steps", 0, pending, "", "ok" if pending == 0 else "FAIL"),
        Figure(f"waits whose copy had not landed (debug mode, of {counts.waits})", None, counts.stalls, "", "info"),
        # A copy staged unplanned holds a buffer the memory model did not count (a layout the compiler chose).
        Figure("copies through a staging buffer (debug mode)", staged_planned, counts.staged, "",
               "ok" if counts.staged == staged_planned else "off"),
    ]


def _compiled(model: torch.nn.Module, inner: str, backend: Any = None) -> Callable:
    plain = "inductor" if inner == "inductor" else "aot_eager_decomp_partition"
    return torch.compile(model, backend=backend or plain)


def run_check(config: CheckConfig = CheckConfig(), progress: Callable[[str], None] = lambda _: None) -> CheckReport:
    """Run the check (see the module docstring) and return its report."""

    cuda = torch.cuda.is_available()
    config = config.on(cuda)
    # TF32 off before calibrate: it measures the FLOP rate of the fp32 matmuls the check's steps run.
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        report, device, profile = _on_this_device(config, cuda, progress)
        _run(report, config, device, profile, progress)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
        runtime.debug_counts(reset=True)
    return report


def _on_this_device(config: CheckConfig, cuda: bool, progress) -> tuple[CheckReport, torch.device, Any]:
    """The report begun, the device, and its profile (on CUDA, calibrated: ``fxoffload.calibrate``)."""

    if cuda:
        progress("calibrating the link and the device (fxoffload.calibrate)")
        profile = fxoffload.calibrate()
    else:
        profile = fxoffload.offload_backend().config.profile
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    report = CheckReport(torch.cuda.get_device_name(device) if cuda else "cpu", cuda, config, profile.name)
    if not cuda:
        report.notes.append("no CUDA device: the same flow runs on the CPU engine. Device memory is host memory "
                            "here, and step times show what the protocol costs on this CPU, not a GPU's; time "
                            f"predictions are for the {profile.name} profile.")
    else:
        report.notes.append(f"calibrated on this machine (measured): host-to-device {profile.h2d_bandwidth / 1e9:.1f} "
                            f"GB/s, device-to-host {profile.d2h_bandwidth / 1e9:.1f} GB/s")
    return report, device, profile


def _run(report: CheckReport, config: CheckConfig, device: torch.device, profile: Any, progress) -> None:
    cuda = report.cuda
    torch.manual_seed(config.seed)
    base = TinyGPT(config).to(device)
    batches = [torch.randint(0, config.vocab, (config.batch, config.seq), device=device) for _ in range(config.steps)]
    plain_model, offloaded_model, timed_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    options = dict(memory_budget=config.memory_budget, strategy="offload", inner=config.inner,
                   device_profile=profile, min_bytes=64 * 1024 if cuda else 0)
    backend, timed_backend = fxoffload.offload_backend(**options, debug=True), fxoffload.offload_backend(**options)
    plain, offloaded = _compiled(plain_model, config.inner), _compiled(offloaded_model, config.inner, backend)
    timed = _compiled(timed_model, config.inner, timed_backend)
    progress(f"training {config.steps} steps without fxoffload")
    plain_run = _train(plain, batches, cuda)
    progress(f"training {config.steps} steps with fxoffload (debug mode: its numerics and stall counts)")
    fxoffload.runtime.debug_counts(reset=True)
    offloaded_run = _train(offloaded, batches, cuda)
    staged = 2 * config.steps * sum(1 for r in backend.records for t in r.plan.transfers if t.staging)
    report.figures += _numerics(plain_run, offloaded_run, (plain_model, offloaded_model), staged)
    # Debug mode fills every destination with NaN before its copy (synchronously, on the host, for pinned
    # buffers): its steps are slower than fxoffload's. The timed steps run without it, on the same plan.
    progress(f"timing {config.steps} steps with fxoffload (debug mode off)")
    timed_run = _train(timed, batches, cuda)
    record = _one_record(backend, timed_backend)
    plan, sim = record.plan, simulate(record)
    report.notes.append(f"plan: {len(plan.transfers)} transfers ({plan.offloaded_bytes} B), memory_budget "
                        f"{config.memory_budget!r}, strategy 'offload', inner {config.inner!r}; step times "
                        "and memory with fxoffload measured without debug mode")
    progress("measuring one more step of each")
    without, with_ = _step_memory(plain, batches[0], cuda), _step_memory(timed, batches[0], cuda)
    report.figures += [
        _memory_figure("peak of the step's tensors, without fxoffload", plan.total_peak_before, without["total"]),
        _memory_figure("peak of the step's tensors, with fxoffload", plan.total_peak_after, with_["total"]),
        _memory_figure("activation peak, with fxoffload", plan.activation_peak_after, with_.get("activation")),
        _memory_figure("host copies alive at once", plan.host_bytes, with_.get("host")),
        _time_figure("step time, without fxoffload (median)", sim.compute_time,
                     statistics.median(plain_run[1][1:]), cuda),
        _time_figure("step time, with fxoffload (median)", sim.step_time, statistics.median(timed_run[1][1:]), cuda),
    ]


def _one_record(debug: Any, timed: Any) -> Any:
    """The one graph both runs compiled, planned alike (plans do not depend on debug mode)."""

    if len(debug.records) != 1 or len(timed.records) != 1:
        raise RuntimeError(f"fxoffload check: expected one compiled graph per run, got {len(debug.records)} and "
                           f"{len(timed.records)}")
    digests = {plan_digest(b.records[0].plan, b.records[0].schedule) for b in (debug, timed)}
    if len(digests) != 1:
        raise RuntimeError("fxoffload check: the debug and the timed runs planned the same graph differently")
    return debug.records[0]


def format_report(report: CheckReport) -> str:
    """The report as the command prints it: notes, then one row per figure, then the verdict."""
    def value(v: float | None, unit: str) -> str:
        if v is None:
            return "-"
        if unit == "B":
            return f"{int(v)} B"
        if unit == "s":
            return f"{v * 1e3:.3f} ms"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"fxoffload check on {report.device} (profile {report.profile})"]
    lines += [f"  {note}" for note in report.notes]
    width = max(len(f.name) for f in report.figures)
    lines.append(f"  {'figure':<{width}}  {'predicted':>14}  {'measured':>14}  verdict")
    for f in report.figures:
        lines.append(f"  {f.name:<{width}}  {value(f.predicted, f.unit):>14}  {value(f.measured, f.unit):>14}  "
                     f"{f.verdict}")
    lines.append("verdict: " + ("PASS" if report.passed else "FAIL") + " (numerics and pending transfers; memory and "
                 "time rows are reported, not failed)")
    return "\n".join(lines)
