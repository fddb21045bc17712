"""``plot(record, path)``: a picture of one planned step, as the simulator predicts it;
``plot_step(invocations, path)``: the same for a step of several compiled-graph runs.

Top panel: saved-activation bytes on the device over the step, without
offloading (on its own, stall-free clock) and under the plan, with the budget
as a line; thin lines show all device tensors. Bottom panel: the compute lane
(stalls in red) and one lane per copy engine, each copy a bar. Everything drawn
is a prediction (``fxoffload.passes.simulator`` on a device profile), and the figure says
so. Matplotlib is used through its object interface (no pyplot), so plotting
touches no global state and needs no display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from fxoffload.explain import format_bytes, format_seconds
from fxoffload.passes import DeviceProfile, Simulation, of_pytorch_partition, simulate, simulate_step
from fxoffload.profiles import resolve_profile
from fxoffload.tools.fit import chooses_checkpointing


__all__ = ["format_seconds", "plot", "plot_fit", "plot_step"]

FORMATS = (".png", ".svg", ".pdf")
COLORS = {"compute": "#4c72b0", "stall": "#d62728", "forward": "#55a868", "backward": "#8172b2",
          "baseline": "#7f7f7f", "plan": "#1f77b4", "budget": "#d62728"}


def plot(record: Any, path: "str | Path", profile: "DeviceProfile | str | None" = None,
         title: str | None = None) -> Simulation:
    """Simulate ``record`` on ``profile`` (default: its own; a name as ``device_profile`` takes) and draw it to
    ``path`` (.png, .svg or .pdf)."""
    path = _image_path(path)
    profile = None if profile is None else resolve_profile(profile)  # a name was an AttributeError deep inside
    from matplotlib.figure import Figure

    sim = simulate(record, profile)
    profile = profile or record.profile
    figure = Figure(figsize=(11, 6.5), layout="constrained")
    memory_ax, lanes_ax = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1.6))
    unit, scale = _unit(max(sim.peak, max((b for _, b in sim.baseline_memory), default=0)))
    clock = (1e3, "ms") if sim.step_time >= 1e-3 else (1e6, "us")
    # A plan of PyTorch's recompute-only pair is drawn over that pair without copies (its own graphs), whose saved
    # activations may lie near nothing: said, lest that line read as plain compile's, missing.
    without = "PyTorch's recompute-only partition, no offload" if of_pytorch_partition(record.plan) else "no offload"
    _draw_memory(memory_ax, sim, record.plan.budget_bytes, (unit, scale), clock[0], without)
    _note_host(memory_ax, record.plan.host_bytes, record.plan.pinned_host_bytes)
    _draw_lanes(lanes_ax, sim, profile.duplex, clock[0])
    figure.suptitle(title or f"graph {record.index}: predicted on {profile.name} (simulated, not measured)")
    lanes_ax.set_xlabel(
        f"time ({clock[1]}): step {format_seconds(sim.step_time)}, without offload "
        f"{format_seconds(sim.compute_time)} (+{sim.overhead:.1%}), floor of this plan "
        f"{format_seconds(sim.floor)} ({sim.bound}-bound)"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return sim


def plot_step(invocations: Sequence[Any], path: "str | Path", profile: "DeviceProfile | str | None" = None,
              title: str | None = None, budget: int | None = None) -> Any:
    """Replay a step of several compiled-graph runs (``fxoffload.passes.step.simulate_step``: records in the
    order they ran) and draw it to ``path``: every run, copies crossing run boundaries included. ``profile``:
    as for :func:`plot`."""

    path = _image_path(path)
    profile = None if profile is None else resolve_profile(profile)
    from matplotlib.figure import Figure

    sim = simulate_step(invocations, profile)
    profile = profile or invocations[0].profile
    figure = Figure(figsize=(13, 6.5), layout="constrained")
    memory_ax, lanes_ax = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1.6))
    unit, scale = _unit(max(sim.activation_peak_before, sim.activation_peak))
    clock = (1e3, "ms") if sim.step_time >= 1e-3 else (1e6, "us")
    _draw_memory(memory_ax, sim, budget, (unit, scale), clock[0])
    for at in sim.boundaries:  # where each run's forward or backward graph begins
        memory_ax.axvline(at * clock[0], color="black", linewidth=0.3, alpha=0.25)
    _note_host(memory_ax, sim.host_bytes, sim.pinned_host_bytes)
    _draw_lanes(lanes_ax, sim, profile.duplex, clock[0])
    figure.suptitle(title or f"step of {sim.invocations} graph runs: predicted on {profile.name} "
                             "(simulated, not measured)")
    lanes_ax.set_xlabel(
        f"time ({clock[1]}): step {format_seconds(sim.step_time)}, without offload "
        f"{format_seconds(sim.compute_time)} ({sim.overhead:+.1%}); {sim.crossing} copies crossed a run "
        "boundary (thin lines: each run's forward and backward)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return sim


def plot_fit(rows: Sequence[Any], memory: int, path: "str | Path", size_label: str, title: str) -> None:
    """``fxoffload fit``'s rows (``fxoffload.tools.fit.Row``) as device peak against size: every size each row
    planned, its answer starred, and the device's memory as a line. Every peak is a prediction."""
    path = _image_path(path)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5), layout="constrained")
    ax = figure.subplots()
    scale = 1e9  # GB, as the command prints them
    for row in rows:
        label = f"{row.name}: {row.size}"
        if chooses_checkpointing(row.name) and row.checkpointing != "none":
            label += ", checkpointing"
        if row.name == "fxoffload":  # its probes plan the smallest peak; its answer, under the device budget
            label += " (dots: the smallest peak it reaches; star: its plan at the answer)"
        line, = ax.plot([p.size for p in row.probes], [p.device_peak / scale for p in row.probes], marker="o",
                        markersize=3, linewidth=1, label=label)
        if row.fit is not None:
            ax.plot([row.fit.size], [row.fit.device_peak / scale], marker="*", markersize=12, color=line.get_color())
    ax.axhline(memory / scale, color=COLORS["budget"], linewidth=1, linestyle="--", label="device memory")
    ax.set_xlabel(size_label)
    ax.set_ylabel("device peak (GB), predicted")
    ax.legend(fontsize=8, loc="lower right")
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _image_path(path: "str | Path") -> Path:
    """``path`` as a Path, refused (naming the accepted endings) where its ending names no image format."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"plot: cannot tell the image format of {str(path)!r}; accepted endings: {', '.join(FORMATS)}")
    return path


def _note_host(ax: Any, host: int, pinned: int) -> None:
    """The host memory the copies hold when the (last) forward ends, and in CUDA's pinned blocks."""
    ax.text(0.99, 0.98, f"host memory when the forward ends: {format_bytes(host)} "
            f"({format_bytes(pinned)} pinned on CUDA)", transform=ax.transAxes, ha="right", va="top", fontsize=8)


def _unit(nbytes: int) -> tuple[str, float]:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return unit, float(size)
    return "B", 1.0


def _steps(points: Sequence[tuple[float, int]], end: float, scale: float, ticks: float):
    times = [t * ticks for t, _ in points] + [end * ticks]
    values = [b / scale for _, b in points]
    return times, values + values[-1:]


def _draw_memory(ax: Any, sim: Any, budget: int | None, units: tuple[str, float], ticks: float,
                 without: str = "no offload") -> None:
    unit, scale = units
    for points, end, color, label, width in (
        (sim.baseline_activations, sim.baseline_time, COLORS["baseline"], f"saved activations, {without}", 1.8),
        (sim.activations, sim.step_time, COLORS["plan"], "saved activations, this plan", 1.8),
        (sim.baseline_memory, sim.baseline_time, COLORS["baseline"], f"all device tensors, {without}", 0.7),
        (sim.memory, sim.step_time, COLORS["plan"], "all device tensors, this plan", 0.7),
    ):
        if points:
            ax.step(*_steps(points, end, scale, ticks), where="post", color=color, linewidth=width, label=label,
                    linestyle="-" if width > 1 else ":")
    if budget is not None:
        ax.axhline(budget / scale, color=COLORS["budget"], linestyle="--", linewidth=1.2,
                   label=f"budget {format_bytes(budget)}")
    ax.axvline(sim.backward_start * ticks, color="black", linewidth=0.6, alpha=0.5)
    ax.text(sim.backward_start * ticks, 0, " backward", va="bottom", fontsize=8, alpha=0.7)
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)


def _draw_lanes(ax: Any, sim: Any, duplex: bool, ticks: float) -> None:
    lanes = ["compute", "device to host", "host to device"] if duplex else ["compute", "link (shared)"]
    row = {"d2h": 1, "h2d": 2, "link": 1}
    ax.broken_barh(_merged(sim.ops, ticks), (-0.4, 0.8), color=COLORS["compute"])
    stalls = [(c.waited_at * ticks, c.stall * ticks) for c in sim.copies if c.stall > 0]
    ax.broken_barh(stalls, (-0.45, 0.9), color=COLORS["stall"])
    for phase in ("forward", "backward"):
        for engine in ("d2h", "h2d", "link"):
            bars = [(c.start * ticks, (c.end - c.start) * ticks) for c in sim.copies
                    if c.phase == phase and c.engine == engine]
            if bars:
                ax.broken_barh(bars, (row[engine] - 0.35, 0.7), facecolor=COLORS[phase], edgecolor="white",
                               linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    total_stall = sum(c.stall for c in sim.copies)
    ax.set_title(f"compute (stalls in red: {format_seconds(total_stall)} in {len(stalls)} waits); "
                 "copies: green offload, purple prefetch", fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _merged(ops: Sequence[tuple[float, float]], ticks: float) -> list[tuple[float, float]]:
    """Back-to-back ops as one bar (thousands of bars draw slowly and look the same)."""
    bars: list[list[float]] = []
    for start, seconds in ops:
        if seconds <= 0:
            continue
        if bars and abs(bars[-1][0] + bars[-1][1] - start * ticks) < 1e-9 * ticks:
            bars[-1][1] += seconds * ticks
        else:
            bars.append([start * ticks, seconds * ticks])
    return [tuple(b) for b in bars]
