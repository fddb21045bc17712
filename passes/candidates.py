"""Cost candidates: before planning, where each candidate's copy could go and what it costs.

Algorithm. Every candidate storage (a saved base the planner may move) is
placed as if it were offloaded alone (:func:`place_candidates`): its offload
right after its base (a graph input's: after the last placeholder), its release
at the last forward use of any alias, its prefetch ``horizon`` compute ops
before its first backward consumer (under ``"auto"``: at the consumer). That
is the least memory each transfer can take, so the planner's feasibility is
exact; the scheduler (``fxoffload.passes.scheduling``) later moves the chosen ones to
hide their copies. :func:`transfer_costs` prices each candidate's copies on a
device profile (``fxoffload.passes.cost_model``) with the compute that could hide them
and the device times its host op calls are due at; :func:`recompute_costs`
finds each candidate's recompute chain (``fxoffload.passes.analysis.recompute_chain``)
and prices it.

Inputs: the partitioned forward and backward graphs, their saved activations
grouped by base, the ``Timeline`` (``fxoffload.passes.memory``), predicted op times.
Outputs: :class:`Placement` per candidate, :class:`TransferCost` and
:class:`RecomputeCost` per candidate, which the planner (``fxoffload.passes.planning``)
reads.

The helpers over plain lists (:func:`prefetch_index`, :func:`free_index`) know
nothing of FX.

Limits. Each candidate is priced alone on its link (the planner's queues
model contention); the forward window assumes its release may wait to the
forward's end; costs are the roofline cost model's predictions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.fx as fx

from .analysis import (
    SavedActivation, is_anchored_compute, is_compute, last_storage_use, reads_size_only, recompute_chain,
    storage_key,
)
from .cost_model import OPS_PER_TRANSFER, DeviceProfile, transfer_time, value_nbytes
from .memory import Timeline

__all__ = [
    "AUTO_HORIZON", "Placement", "RecomputeCost", "TransferCost", "free_index", "place_candidates",
    "prefetch_index", "prefix_sums", "recompute_costs", "timeline_moves", "transfer_costs",
]

AUTO_HORIZON = "auto"


@dataclass(frozen=True)
class Placement:
    """Where the four ops of one transfer go (nodes of the forward/backward graphs), and their predicted times."""

    transfer: int  # index into Plan.transfers (-1 for an unchosen candidate)
    offload_after: fx.Node  # forward: offload right after this node
    free_after: fx.Node  # forward: offload wait (release) right after this node
    prefetch_before: fx.Node  # backward: prefetch right before this node
    wait_before: fx.Node  # backward: wait right before this node (first consumer)
    ops_ahead: int  # compute ops between the prefetch and the wait
    d2h_seconds: float = 0.0  # predicted copy times
    h2d_seconds: float = 0.0
    forward_stall: float = 0.0  # predicted compute stall at the release
    backward_stall: float = 0.0  # predicted compute stall at the wait
    deferred: bool = False  # the release does not wait: the graph returns with the copy in flight
    # In every run of the graph but the step's last, the release does not wait either: the source stays
    # until its copy lands (held to the forward's end in the plan's curves of those runs)
    deferred_before_last: bool = False


@dataclass(frozen=True)
class TransferCost:
    """Predicted seconds for one candidate's copies and the compute that can hide them."""

    d2h: float
    h2d: float
    forward_window: float  # compute after the offload that may hide it (to the forward's end)
    backward_window: float  # compute between the prefetch and its wait
    # Host seconds of its op calls (``fxoffload.passes.cost_model.OPS_PER_TRANSFER``), and the predicted device
    # times from the step's start at which the forward's half (offload, release) and the backward's
    # half (prefetch, wait) are needed: a host that has not issued them by then makes the device wait.
    host: float = 0.0
    issued_at: float = 0.0
    needed_at: float = 0.0
    # Compute-stream seconds of a staged transfer's two device copies (``cost_model.staging_seconds``):
    # priced when the plan knows its engine stages (``fxoffload.passes.pipeline.priced_staging``).
    staging: float = 0.0

    @property
    def stall(self) -> float:
        return max(0.0, self.d2h - self.forward_window) + max(0.0, self.h2d - self.backward_window)


@dataclass(frozen=True)
class RecomputeCost:
    """How one storage would be recomputed in the backward, and what that costs (predicted)."""

    chain: tuple[fx.Node, ...]  # forward ops, in order, ending at the storage's base
    reads: tuple[fx.Node, ...]  # saved forward values the chain reads
    consumer: fx.Node  # backward node the chain runs right before (the first consumer)
    seconds: float  # compute time of the chain
    # bytes the chain holds at its peak beyond its rebuilt base and its consumer's outputs (see
    # ``recompute_costs``): what the device curve adds at the consumer
    transient: int
    read_bases: tuple[fx.Node, ...] = ()  # bases of the storages of ``reads`` (set by the planner)
    sizes: tuple[fx.Node, ...] = ()  # forward symbolic sizes the chain reads (the backward builds them)


# --------------------------------------------------------------------------- pure helpers


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
    """Index of the node after which the device copy may first be released."""
    return max(birth, last_use)


# --------------------------------------------------------------------------- candidates


def place_candidates(
    fw: fx.Graph,
    bw: fx.Graph,
    groups: Mapping[fx.Node, Sequence[SavedActivation]],
    *,
    horizon: int | str,
) -> dict[fx.Node, Placement]:
    """A placement for every candidate base, as if each were offloaded alone.

    The release is at the last forward use; under ``"auto"`` the prefetch is at
    its consumer. That is the least memory each transfer can take, so the
    planner's feasibility is exact: a budget is met whenever some placement
    meets it. Scheduling then moves prefetches earlier to hide copies, and
    releases later, as far as the plan's bound allows.
    """
    fw_nodes = list(fw.nodes)
    fw_pos = {n: i for i, n in enumerate(fw_nodes)}
    last_use = last_storage_use(fw)
    bw_nodes = list(bw.nodes)
    bw_pos = {n: i for i, n in enumerate(bw_nodes)}
    compute = [is_anchored_compute(n) for n in bw_nodes]
    first = next(i for i, n in enumerate(bw_nodes) if n.op != "placeholder")
    # An input's copy starts after the last placeholder: the graph's inputs stay one block.
    last_input = fw_nodes[next(i for i, n in enumerate(fw_nodes) if n.op != "placeholder") - 1]
    placements = {}
    for base, members in groups.items():
        birth = fw_pos[base]
        free = free_index(birth, last_use.get(storage_key(base), birth))
        consumer = _first_data_use(members, bw_pos)
        start = consumer if horizon == AUTO_HORIZON else prefetch_index(compute, consumer, horizon, first)
        placements[base] = Placement(
            transfer=-1,
            offload_after=last_input if base.op == "placeholder" else base,
            free_after=fw_nodes[free],
            prefetch_before=bw_nodes[start],
            wait_before=bw_nodes[consumer],
            ops_ahead=sum(compute[start:consumer]),
        )
    return placements


def _first_data_use(members: Sequence[Any], bw_pos: dict) -> int:
    """The first backward node that reads a member's data (a size read does not: ``reads_size_only``)."""
    users = [u for m in members for u in m.bw_node.users]
    return min(bw_pos[u] for u in ([u for u in users if not reads_size_only(u)] or users))


def timeline_moves(timeline: Timeline, placements: Mapping[fx.Node, Placement]) -> dict[fx.Node, tuple[int, int]]:
    """(release, prefetch) timeline positions of each placement, for the memory model."""
    return {
        base: (timeline.positions[p.free_after], timeline.positions[p.prefetch_before])
        for base, p in placements.items()
    }


def prefix_sums(times: Sequence[float]) -> list[float]:
    """``out[i]``: the sum of ``times[:i]`` (the predicted start of position ``i``, before stalls)."""
    out = [0.0]
    for t in times:
        out.append(out[-1] + t)
    return out


def transfer_costs(
    timeline: Timeline,
    placements: Mapping[fx.Node, Placement],
    times: Sequence[float],
    nbytes: Mapping[fx.Node, int],
    profile: DeviceProfile,
    *,
    hide_backward: bool = False,
) -> dict[fx.Node, TransferCost]:
    """Each candidate's predicted copy times and the compute that could hide them, alone on its link.

    ``hide_backward`` (``"auto"``): the prefetch may start anywhere in the backward, so its
    window is all compute from the backward's start to the consumer.
    """
    prefix = prefix_sums(times)

    def window(a, b):
        return prefix[b] - prefix[a]  # compute time of positions a .. b-1

    costs = {}
    for base, p in placements.items():
        pos = timeline.positions
        birth, start, consumer = pos[p.offload_after], pos[p.prefetch_before], pos[p.wait_before]
        costs[base] = TransferCost(
            d2h=transfer_time(nbytes[base], profile.d2h_bandwidth, profile.copy_latency),
            h2d=transfer_time(nbytes[base], profile.h2d_bandwidth, profile.copy_latency),
            # The scheduler delays a release until its copy is done when the bound
            # allows, so the planner prices the whole rest of the forward as cover
            # (optimistic when memory is tight; the schedule's stall is the real one).
            forward_window=window(birth + 1, len(timeline.fw_nodes)),
            backward_window=window(len(timeline.fw_nodes) if hide_backward else start, consumer),
            host=OPS_PER_TRANSFER * profile.op_seconds,
            issued_at=prefix[birth + 1],
            needed_at=prefix[consumer],
        )
    return costs


def _chain_peak(chain: Sequence[fx.Node], base: fx.Node) -> int:
    """Most bytes a chain's outputs hold at once, ``base``'s among them (kept to the chain's end), each other
    freed after its last use within the chain."""
    owner: dict[fx.Node, fx.Node] = {}
    for node in chain:  # views and getitems live in their source's storage
        source = node.all_input_nodes[0] if not is_compute(node) and node.all_input_nodes else None
        owner[node] = owner.get(source, node) if source in owner else node
    last = {}
    for i, node in enumerate(chain):
        for arg in node.all_input_nodes:
            if arg in owner:
                last[owner[arg]] = i
    live = top = 0
    sizes = {}
    for i, node in enumerate(chain):
        if is_compute(node):
            sizes[node] = value_nbytes(node.meta.get("val"))
            live += sizes[node]
        top = max(top, live)
        for arg in set(node.all_input_nodes):
            if arg in sizes and last.get(arg) == i and arg is not owner.get(base):
                live -= sizes[arg]
    return max(top, 0)


def recompute_costs(
    timeline: Timeline,
    bases: Sequence[fx.Node],
    placements: Mapping[fx.Node, Placement],
    available: Sequence[fx.Node],
    times: Sequence[float],
    symbols: frozenset = frozenset(),
) -> dict[fx.Node, RecomputeCost]:
    """Each base's recompute chain from the ``available`` (saved) values and the backward's size
    ``symbols``, run right before its first consumer, with the chain's predicted compute time and its
    ``transient`` bytes: what the chain holds at its peak beyond what the timeline counts at the consumer
    under the plan, the rebuilt base and the consumer's own outputs (born there), which the chain's
    temporaries never meet (freed within the chain, before the consumer runs); bases without a chain
    are left out."""
    pos = timeline.positions
    saved = set(available)
    born: dict[int, int] = {}  # position -> bytes of the storages born there
    for lt in timeline.lifetimes:
        born[lt.birth] = born.get(lt.birth, 0) + lt.nbytes
    out = {}
    for base in bases:
        found = recompute_chain(base, saved, pos, symbols=symbols)
        if isinstance(found, str):
            continue
        seconds = sum(times[pos[n]] for n in found.ops)
        consumer = placements[base].wait_before
        held = timeline.forward_lifetime(base).nbytes + born.get(pos[consumer], 0)
        out[base] = RecomputeCost(found.ops, found.reads, consumer, seconds,
                                  max(0, _chain_peak(found.ops, base) - held), sizes=found.sizes)
    return out
