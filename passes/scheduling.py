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

:func:`prefetch_index` and :func:`free_index` are pure functions over lists,
free of FX, so they can be tested on plain values. The result is an
immutable :class:`Schedule`; nothing here edits a graph.

Limits. No cost model yet: the horizon is a count of ops, not a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx

from passes.analysis import SavedActivation, is_compute, last_storage_use, storage_key
from passes.planning import Plan

__all__ = ["Placement", "Schedule", "schedule_transfers", "prefetch_index", "free_index"]


@dataclass(frozen=True)
class Placement:
    """Where the four ops of one transfer go (nodes of the forward/backward graphs)."""

    transfer: int
    offload_after: fx.Node  # forward: offload right after this node
    free_after: fx.Node  # forward: offload wait right after this node
    prefetch_before: fx.Node  # backward: prefetch right before this node
    wait_before: fx.Node  # backward: wait right before this node (first consumer)
    ops_ahead: int  # compute ops between the prefetch and the wait


@dataclass(frozen=True)
class Schedule:
    horizon: int
    placements: tuple[Placement, ...]


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


def _ops_between(compute: Sequence[bool], start: int, end: int) -> int:
    return sum(compute[start:end])


def schedule_transfers(
    fw: fx.Graph,
    bw: fx.Graph,
    plan: Plan,
    activations: Sequence[SavedActivation],
    *,
    horizon: int,
) -> Schedule:
    fw_nodes = list(fw.nodes)
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    last_use = last_storage_use(fw)
    bw_nodes = list(bw.nodes)
    bw_pos = {n: i for i, n in enumerate(bw_nodes)}
    compute = [is_compute(n) for n in bw_nodes]
    first = next(i for i, n in enumerate(bw_nodes) if n.op != "placeholder")

    placements = []
    for k, transfer in enumerate(plan.transfers):
        birth = fw_pos[transfer.base]
        free = free_index(birth, last_use.get(storage_key(transfer.base), birth))
        members = [activations[i].bw_node for i in transfer.members]
        consumer = min(bw_pos[u] for m in members for u in m.users)
        start = prefetch_index(compute, consumer, horizon, first)
        placements.append(
            Placement(
                transfer=k,
                offload_after=transfer.base,
                free_after=fw_nodes[free],
                prefetch_before=bw_nodes[start],
                wait_before=bw_nodes[consumer],
                ops_ahead=_ops_between(compute, start, consumer),
            )
        )
    return Schedule(horizon, tuple(placements))
