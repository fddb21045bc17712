"""Scheduling: where each offload, offload wait, prefetch and wait goes.

Algorithm (fixed horizon).
* Forward: the offload is issued right after its base is computed. That is
  correct because post-AOTAutograd graphs are functional: nothing writes to the
  base afterwards, so the copy reads final values while compute goes on. The
  offload ``wait`` (which releases the device copy) goes right after the last
  forward use of any alias of the base, so no view outlives its storage.
* Backward: the ``wait`` goes right before the first backward consumer of any
  tensor rebuilt from the base; the prefetch goes ``horizon`` compute ops
  earlier (views, getitems and fxoffload ops do not count), clamped to the
  start of the backward graph.

:func:`place_candidates` places every candidate before planning (the planner
needs the positions to predict memory); :func:`schedule_transfers` keeps the
placements of the transfers the plan chose. :func:`prefetch_index` and
:func:`free_index` are pure functions over lists, free of FX. The result is an
immutable :class:`Schedule`; nothing here edits a graph.

Limits. The horizon is a count of ops, not a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch.fx as fx

from passes.analysis import SavedActivation, is_compute, last_storage_use, storage_key
from passes.cost_model import DeviceProfile, transfer_time
from passes.memory import Timeline
from passes.planning import Plan, TransferCost

__all__ = ["Placement", "Schedule", "place_candidates", "schedule_transfers", "prefetch_index", "free_index"]


@dataclass(frozen=True)
class Placement:
    """Where the four ops of one transfer go (nodes of the forward/backward graphs)."""

    transfer: int  # index into Plan.transfers (-1 for an unchosen candidate)
    offload_after: fx.Node  # forward: offload right after this node
    free_after: fx.Node  # forward: offload wait right after this node
    prefetch_before: fx.Node  # backward: prefetch right before this node
    wait_before: fx.Node  # backward: wait right before this node (first consumer)
    ops_ahead: int  # compute ops between the prefetch and the wait


@dataclass(frozen=True)
class Schedule:
    horizon: int
    placements: tuple[Placement, ...]  # aligned with Plan.transfers


def prefetch_index(compute: Sequence[bool], consumer: int, horizon: int, first: int) -> int:
    """Index of the node to put a prefetch before: ``horizon`` compute ops ahead of ``consumer``.

    ``compute[i]`` says whether node ``i`` counts; ``first`` is the earliest
    allowed index (the first node after the graph's inputs).
    """
    if horizon < 0 or not first <= consumer < len(compute):
        raise ValueError(f"bad prefetch query: horizon={horizon}, first={first}, consumer={consumer}")
    index, seen = consumer, 0
    while seen < horizon and index > first:
        index -= 1
        seen += compute[index]
    return index


def free_index(birth: int, last_use: int) -> int:
    """Index of the node after which the device copy is released."""
    return max(birth, last_use)


def place_candidates(
    fw: fx.Graph,
    bw: fx.Graph,
    groups: Mapping[fx.Node, Sequence[SavedActivation]],
    *,
    horizon: int,
) -> dict[fx.Node, Placement]:
    """A placement for every candidate base, as if each were offloaded."""
    fw_nodes = list(fw.nodes)
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    last_use = last_storage_use(fw)
    bw_nodes = list(bw.nodes)
    bw_pos = {n: i for i, n in enumerate(bw_nodes)}
    compute = [is_compute(n) for n in bw_nodes]
    first = next(i for i, n in enumerate(bw_nodes) if n.op != "placeholder")
    placements = {}
    for base, members in groups.items():
        birth = fw_pos[base]
        free = free_index(birth, last_use.get(storage_key(base), birth))
        consumer = min(bw_pos[u] for m in members for u in m.bw_node.users)
        start = prefetch_index(compute, consumer, horizon, first)
        placements[base] = Placement(
            transfer=-1,
            offload_after=base,
            free_after=fw_nodes[free],
            prefetch_before=bw_nodes[start],
            wait_before=bw_nodes[consumer],
            ops_ahead=sum(compute[start:consumer]),
        )
    return placements


def timeline_moves(timeline: Timeline, placements: Mapping[fx.Node, Placement]) -> dict[fx.Node, tuple[int, int]]:
    """(release, prefetch) timeline positions of each placement, for the memory model."""
    return {
        base: (timeline.fw_position(p.free_after), timeline.bw_position(p.prefetch_before))
        for base, p in placements.items()
    }


def transfer_costs(
    timeline: Timeline,
    placements: Mapping[fx.Node, Placement],
    times: Sequence[float],
    nbytes: Mapping[fx.Node, int],
    profile: DeviceProfile,
) -> dict[fx.Node, TransferCost]:
    """Predicted copy times and the compute time between each op pair that could hide them."""
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    window = lambda a, b: prefix[b] - prefix[a]  # compute time of positions a .. b-1
    costs = {}
    for base, p in placements.items():
        birth, release = timeline.fw_position(base), timeline.fw_position(p.free_after)
        start, consumer = timeline.bw_position(p.prefetch_before), timeline.bw_position(p.wait_before)
        costs[base] = TransferCost(
            d2h=transfer_time(nbytes[base], profile.d2h_bandwidth, profile.copy_latency),
            h2d=transfer_time(nbytes[base], profile.h2d_bandwidth, profile.copy_latency),
            forward_window=window(birth + 1, release + 1),
            backward_window=window(start, consumer),
        )
    return costs


def schedule_transfers(plan: Plan, placements: Mapping[fx.Node, Placement], horizon: int) -> Schedule:
    """The placements of the transfers the plan chose, in plan order."""
    chosen = tuple(dataclasses.replace(placements[t.base], transfer=k) for k, t in enumerate(plan.transfers))
    return Schedule(horizon, chosen)
