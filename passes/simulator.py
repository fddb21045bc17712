"""Simulator: a discrete-event replay of a planned step on a device profile.

Inputs: a graph record (``Plan``, ``Schedule``, ``Timeline``, each node's ``Work``) and a
``DeviceProfile``. Output: a ``Simulation`` (predicted step time, copies, stalls, memory).

Algorithm. One compute stream runs the nodes of the forward, then the
backward, in order, each for its predicted time (``fxoffload.passes.cost_model``).
Copies run on copy engines: one per direction, or one shared engine when the
profile's link is not full duplex; an engine serves copies in the order they
are issued, each starting when it is issued and the engine is free. A wait
stalls the compute stream until its copy has ended, and a stall delays
everything after it. The host issues every op: compute ops cost it nothing,
each copy's issue and each wait cost it the profile's ``op_seconds``
(``fxoffload.passes.cost_model``), and the device never runs ahead of the host (where
the host falls behind, the device waits: ``host_wait``). A plan's recompute
chains run on the compute stream right before their consumers; a staged
transfer's two device copies (``cost_model.staging_seconds``) run on it too,
one right before its device-to-host copy is issued, one right after its
host-to-device copy lands (``staging_time``). Device
memory follows the memory model's intervals (``fxoffload.passes.memory``) under the
plan, placed on the simulated clock, so the simulated peak is the planner's
predicted total peak. A plan of PyTorch's recompute-only pair runs that pair's ops, its
recomputations among them; its overhead is over the min-cut pair's compute, what the graph computes
without fxoffload (``Plan.partition_seconds``: that pair's compute over the min-cut pair's).

The floor of a plan is what no schedule can beat: in each pass, the larger of
its compute time and the time its copies need on the link.

:func:`~fxoffload.passes.replay.replay` (``fxoffload.passes.replay``, which the scheduler uses
too) is the core over plain lists (positions, durations); it knows nothing of
FX. :func:`simulate` reads a graph record (plan, schedule,
timeline). Every figure is a prediction.

Limits. Compute never overlaps compute; compute kernels' launches cost the
host nothing; a shared engine serves both
directions in issue order (no bandwidth splitting); allocator effects are not
modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from .cost_model import DeviceProfile, roofline, staging_seconds
from .memory import curve, intervals, staging_intervals
from .plan import recompute_moves, recompute_temporaries
from .replay import Copy, Replay, op_starts, replay

__all__ = ["Copy", "Movement", "Replay", "SimulatedCopy", "Simulation", "op_starts", "replay", "simulate",
           "simulate_movements"]


@dataclass(frozen=True)
class SimulatedCopy:
    name: str  # the offloaded storage's base node
    phase: str  # "forward" (device to host) or "backward" (host to device)
    engine: str  # "d2h", "h2d", or "link" when the link is not full duplex
    start: float  # seconds from the step's start
    end: float
    waited_at: float  # when compute reached the copy's wait
    stall: float  # compute stalled this long at the wait


@dataclass(frozen=True)
class Simulation:
    """A predicted step; times in seconds from its start, memory in bytes."""

    step_time: float  # forward + backward
    # The min-cut pair's step without offloading or recomputing, and without stalls: what the graph computes
    # without fxoffload. A plan of PyTorch's recompute-only pair adds its recomputations (``partition_time``).
    compute_time: float
    floor: float  # the least any schedule of this plan could take
    backward_start: float  # when the backward's first op starts
    ops: tuple[tuple[float, float], ...]  # (start, seconds) per op, forward then backward
    copies: tuple[SimulatedCopy, ...]  # forward copies in issue order, then backward ones
    memory: tuple[tuple[float, int], ...]  # (time, device bytes) at each op's start, under the plan
    activations: tuple[tuple[float, int], ...]  # the same, saved activations only (what the budget bounds)
    baseline_memory: tuple[tuple[float, int], ...]  # no offload, on its own (stall-free) clock
    baseline_activations: tuple[tuple[float, int], ...]
    peak: int  # device bytes under the plan
    activation_peak: int
    recompute_time: float = 0.0  # compute the plan's recomputations add
    host_wait: float = 0.0  # device time idle while the host issued fxoffload ops
    staging_time: float = 0.0  # compute the staged transfers' device copies add (``cost_model.staging_seconds``)
    partition_time: float = 0.0  # compute the planned pair adds over the min-cut pair's (``Plan.partition_seconds``)

    @property
    def overhead(self) -> float:
        """Step time over the min-cut pair's without offloading or recomputing, minus one."""
        return self.step_time / self.compute_time - 1.0 if self.compute_time else 0.0

    @property
    def baseline_time(self) -> float:
        """The planned pair's step without offloading, on its own clock (the baseline curves' end): the
        min-cut pair's compute and what the planned partition adds."""
        return self.compute_time + self.partition_time

    @property
    def stalls(self) -> tuple[tuple[str, str, float], ...]:
        return tuple((c.name, c.phase, c.stall) for c in self.copies)

    @property
    def bound(self) -> str:
        """What limits this plan's floor: "compute" or "link"."""
        compute = self.compute_time + self.partition_time + self.recompute_time + self.staging_time
        return "compute" if self.floor <= compute * (1 + 1e-9) else "link"  # sums in another order


@dataclass(frozen=True)
class Movement:
    """One storage's round trip, in timeline positions (a copy "at" p is issued or waited right before p)."""

    name: str
    lifetime: int  # index into Timeline.lifetimes
    offload_at: int  # the device-to-host copy is issued here
    offload_wait_at: int  # compute waits for that copy here
    free_at: int  # the device copy is freed here (it occupies memory up to free_at - 1); fxoffload frees at its wait
    prefetch_at: int  # the host-to-device copy is issued here; the device copy occupies memory from here
    wait_at: int  # its wait, before the first consumer
    d2h_seconds: float
    h2d_seconds: float
    staging: int = 0  # bytes of the contiguous device buffer each copy goes through (``Transfer.staging``)


def simulate(record: Any, profile: DeviceProfile | None = None) -> Simulation:
    """Replay a graph record's plan and schedule on ``profile`` (default: the one it was planned for). The
    compute a plan's partition adds over the min-cut pair's (``Plan.partition_seconds``) is the planning
    profile's prediction, on any profile."""
    profile = profile or record.profile
    timeline, plan, schedule = record.timeline, record.plan, record.schedule
    pos = timeline.positions
    backward = len(timeline.fw_nodes)  # a deferred offload is waited for when the backward begins
    movements = [
        Movement(plan.transfers[p.transfer].base_name, plan.transfers[p.transfer].lifetime,
                 pos[p.offload_after] + 1, backward if p.deferred else pos[p.free_after] + 1,
                 pos[p.free_after] + 1, pos[p.prefetch_before], pos[p.wait_before],
                 p.d2h_seconds, p.h2d_seconds, staging=plan.transfers[p.transfer].staging)
        for p in schedule.placements
    ]
    sim = simulate_movements(timeline, record.work, profile, movements, schedule.prefetch_order or None,
                             recomputes=plan.recomputes)
    if not plan.partition_seconds:
        return sim
    return dataclasses.replace(sim, compute_time=sim.compute_time - plan.partition_seconds,
                               partition_time=plan.partition_seconds)


def simulate_movements(
    timeline: Any,
    work: Sequence[Any],
    profile: DeviceProfile,
    movements: Sequence[Movement],
    prefetch_order: Sequence[int] | None = None,
    recomputes: Sequence[Any] = (),
) -> Simulation:
    """Replay ``movements`` on the timeline: any strategy's copies, not only a plan's.

    ``work`` is each timeline node's (FLOPs, bytes, dtype) from the cost model;
    prefetches issued at the same position go in ``prefetch_order`` (default:
    the order of ``movements``). ``recomputes`` (``fxoffload.passes.plan.Recompute``)
    run their chains right before their rebuild position: the op before it
    takes their time (profile-independent: the planner's prediction).
    """
    base_times = [roofline(w, profile) for w in work]
    times = list(base_times)
    for r in recomputes:
        times[r.at - 1] += r.cost.seconds
    recomputed = sum(times) - sum(base_times)
    for m in movements:  # a staged copy's device copies: before its offload, after its landing
        times[m.offload_at - 1] += staging_seconds(m.staging, profile)
        times[m.wait_at] += staging_seconds(m.staging, profile)
    engines = ("d2h", "h2d") if profile.duplex else ("link", "link")
    down = [Copy(m.offload_at, m.offload_wait_at, m.d2h_seconds, engines[0]) for m in movements]
    order = list(prefetch_order) if prefetch_order is not None else range(len(movements))
    up = [Copy(movements[k].prefetch_at, movements[k].wait_at, movements[k].h2d_seconds, engines[1]) for k in order]
    names = [(m.name, "forward") for m in movements] + [(movements[k].name, "backward") for k in order]
    moved = recompute_moves(recomputes)
    moved.update({m.lifetime: (m.free_at - 1, m.prefetch_at) for m in movements})
    temporaries = recompute_temporaries(recomputes) + [
        interval for m in movements
        for interval in staging_intervals(m.offload_at - 1, m.free_at - 1, m.prefetch_at, m.wait_at, m.staging)]
    run = replay(times, down + up, profile.op_seconds)
    forward = len(timeline.fw_nodes)
    plan_clock, free_clock = run.starts[:-1], op_starts(base_times)
    plan_total, plan_saved, base_total, base_saved = (
        curve(timeline.length, intervals(timeline, m, residual_only=r, temporaries=t))
        for m, r, t in ((moved, False, temporaries), (moved, True, ()), ({}, False, ()), ({}, True, ()))
    )
    return Simulation(
        step_time=run.step_time,
        compute_time=sum(base_times),
        recompute_time=recomputed,
        staging_time=sum(times) - sum(base_times) - recomputed,
        host_wait=run.host_wait,
        floor=_floor(times[:forward], times[forward:], down, up),
        backward_start=run.starts[forward],
        ops=tuple(zip(plan_clock, times)),
        copies=tuple(
            SimulatedCopy(name, phase, c.engine, end - c.seconds, end, at, stall)
            for (name, phase), c, end, at, stall in zip(names, down + up, run.finishes, run.waited_at, run.stalls)
        ),
        memory=tuple(zip(plan_clock, plan_total)),
        activations=tuple(zip(plan_clock, plan_saved)),
        baseline_memory=tuple(zip(free_clock, base_total)),
        baseline_activations=tuple(zip(free_clock, base_saved)),
        peak=max(plan_total, default=0),
        activation_peak=max(plan_saved, default=0),
    )


def _floor(forward: Sequence[float], backward: Sequence[float], down: Sequence[Copy], up: Sequence[Copy]) -> float:
    """Per pass, the larger of its compute time and its copies' time: no schedule of these copies beats it.

    A forward copy is issued and waited for (released) inside the forward, a
    prefetch inside the backward, and an engine moves one copy at a time, so
    each pass lasts at least as long as its copies' total time, and at least
    its compute. Each pass moves data one way only, so a shared (not full
    duplex) link gives the same bound.
    """
    return max(sum(forward), sum(c.seconds for c in down)) + max(sum(backward), sum(c.seconds for c in up))
