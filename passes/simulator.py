"""Simulator: a discrete-event replay of a planned step on a device profile.

Algorithm. One compute stream runs the nodes of the forward, then the
backward, in order, each for its predicted time (``passes.cost_model``).
Copies run on copy engines: one per direction, or one shared engine when the
profile's link is not full duplex; an engine serves copies in the order they
are issued, each starting when it is issued and the engine is free. A wait
stalls the compute stream until its copy has ended, and a stall delays
everything after it. Device memory follows the memory model's intervals
(``passes.memory``) under the plan, placed on the simulated clock, so the
simulated peak is the planner's predicted total peak.

The floor of a plan is what no schedule can beat: in each pass, the larger of
its compute time and the time its copies need on the link.

:func:`replay` is the core over plain lists (positions, durations); it knows
nothing of FX. :func:`simulate` reads a graph record (plan, schedule,
timeline). Every figure is a prediction.

Limits. Compute never overlaps compute; a shared engine serves both
directions in issue order (no bandwidth splitting); allocator effects are not
modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from passes.cost_model import DeviceProfile, roofline
from passes.memory import curve, intervals

__all__ = ["Copy", "Replay", "Simulation", "replay", "simulate"]


@dataclass(frozen=True)
class Copy:
    """A copy issued right before position ``issue`` and waited for right before position ``wait``."""

    issue: int
    wait: int
    seconds: float
    engine: str  # "d2h" or "h2d" (or any name: copies on one name share an engine)


@dataclass(frozen=True)
class Replay:
    step_time: float
    starts: tuple[float, ...]  # start time of each position's op (len = positions + 1: the end)
    stalls: tuple[float, ...]  # per copy, the stall at its wait
    finishes: tuple[float, ...]  # per copy, when it ended


def replay(times: Sequence[float], copies: Sequence[Copy]) -> Replay:
    """Run ops of ``times`` in order; copies on in-order engines; waits stall compute."""
    issued: dict[int, list[int]] = {}
    waited: dict[int, list[int]] = {}
    for k, c in enumerate(copies):
        if not 0 <= c.issue <= c.wait <= len(times):
            raise ValueError(f"copy {k}: need 0 <= issue ({c.issue}) <= wait ({c.wait}) <= {len(times)}")
        issued.setdefault(c.issue, []).append(k)
        waited.setdefault(c.wait, []).append(k)
    now, engines = 0.0, {}
    finish = [0.0] * len(copies)
    stalls = [0.0] * len(copies)
    starts = []
    for i in range(len(times) + 1):
        for k in issued.get(i, ()):
            engine = copies[k].engine
            engines[engine] = max(now, engines.get(engine, 0.0)) + copies[k].seconds
            finish[k] = engines[engine]
        for k in waited.get(i, ()):
            stalls[k] = max(0.0, finish[k] - now)
            now += stalls[k]
        starts.append(now)
        if i < len(times):
            now += times[i]
    return Replay(now, tuple(starts), tuple(stalls), tuple(finish))


@dataclass(frozen=True)
class Simulation:
    step_time: float  # predicted seconds for forward + backward
    compute_time: float  # the same without any stall
    floor: float  # the least any schedule of this plan could take
    stalls: tuple[tuple[str, str, float], ...]  # (transfer, "forward"/"backward", seconds)
    memory: tuple[tuple[float, int], ...]  # (time, device bytes) after each op starts
    peak: int  # device bytes

    @property
    def overhead(self) -> float:
        return self.step_time / self.compute_time - 1.0 if self.compute_time else 0.0


def simulate(record: Any, profile: DeviceProfile) -> Simulation:
    """Replay a graph record's plan and schedule on ``profile`` (see the module docstring)."""
    timeline, plan, schedule = record.timeline, record.plan, record.schedule
    pos = timeline.positions
    times = [roofline(w, profile) for w in record.work]  # work from before the rewrite changed the edges
    engines = ("d2h", "h2d") if profile.duplex else ("link", "link")
    copies, names, moved = [], [], {}
    for p in schedule.placements:
        transfer = plan.transfers[p.transfer]
        # Offload issued after its base (before the next position); released after free_after.
        copies.append(Copy(pos[p.offload_after] + 1, pos[p.free_after] + 1, p.d2h_seconds, engines[0]))
        names.append((transfer.base_name, "forward"))
        moved[timeline.forward_lifetime(transfer.base).index] = (pos[p.free_after], pos[p.prefetch_before])
    offloads = len(copies)
    for k in schedule.prefetch_order or range(len(schedule.placements)):  # the rewrite's issue order
        p = schedule.placements[k]
        copies.append(Copy(pos[p.prefetch_before], pos[p.wait_before], p.h2d_seconds, engines[1]))
        names.append((plan.transfers[p.transfer].base_name, "backward"))
    run = replay(times, copies)
    bytes_at = curve(timeline.length, intervals(timeline, moved, residual_only=False))
    forward = len(timeline.fw_nodes)
    d2h = sum(c.seconds for c in copies[:offloads])
    h2d = sum(c.seconds for c in copies[offloads:])
    fw_compute, bw_compute = sum(times[:forward]), sum(times[forward:])
    floor = max(fw_compute, d2h) + max(bw_compute, h2d)  # forward copies go down, backward ones up
    return Simulation(
        step_time=run.step_time,
        compute_time=fw_compute + bw_compute,
        floor=floor,
        stalls=tuple((name, phase, s) for (name, phase), s in zip(names, run.stalls)),
        memory=tuple(zip(run.starts[:-1], bytes_at)),
        peak=max(bytes_at, default=0),
    )
