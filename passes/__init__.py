"""Graph passes of fxoffload over a partitioned forward/backward pair.

Stages, one module each: ``analysis`` (saved tensors, aliasing), ``planning``
(keep or offload -> Plan), ``scheduling`` (where each op goes -> Schedule),
``rewrite`` (insert the ops). :func:`offload_pair` runs them in order.
This package knows FX and PyTorch graphs, nothing of torch.compile or of the
copy engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.fx as fx

from passes.analysis import SavedActivation, saved_activations, saved_interface
from passes.planning import Decision, Plan, Transfer, plan_offloads
from passes.rewrite import rewrite_pair
from passes.scheduling import Placement, Schedule, schedule_transfers

__all__ = [
    "Decision",
    "Placement",
    "Plan",
    "PassResult",
    "SavedActivation",
    "Schedule",
    "Transfer",
    "offload_pair",
]


@dataclass(frozen=True)
class PassResult:
    plan: Plan
    schedule: Schedule
    seconds: tuple[tuple[str, float], ...]  # (stage name, wall time) in run order


def offload_pair(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    num_user_outputs: int,
    *,
    min_bytes: int,
    horizon: int,
) -> PassResult:
    """Analyse, plan, schedule and rewrite the pair in place; return what was decided."""
    times = []
    start = time.perf_counter()

    def stamp(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        times.append((name, now - start))
        start = now

    interface = saved_interface(fw_module.graph, bw_module.graph, num_user_outputs)
    activations = saved_activations(interface)
    stamp("analyse")
    plan = plan_offloads(interface, activations, min_bytes=min_bytes)
    stamp("plan")
    schedule = schedule_transfers(fw_module.graph, bw_module.graph, plan, activations, horizon=horizon)
    stamp("schedule")
    rewrite_pair(fw_module, bw_module, interface, activations, plan, schedule)
    stamp("rewrite")
    return PassResult(plan, schedule, tuple(times))
