"""Scheduling: where each chosen transfer's offload, release, prefetch and wait go, and what they cost.

Inputs: the :class:`~fxoffload.passes.plan.Plan`, the candidates' placements
(``fxoffload.passes.candidates``: where each copy could go alone), the ``Timeline``,
predicted op times and the device profile. Output: a :class:`Schedule` (each
transfer's final :class:`~fxoffload.passes.candidates.Placement`, the prefetch order,
the copies started ahead, predicted stalls), and the plan's predicted peaks
re-evaluated under it (:func:`with_scheduled_peaks`, :func:`activation_peaks_at`,
:func:`held_after_forward`, and one run's figures, :func:`run_peaks`). Their digest: ``fxoffload.passes.digest``.

Algorithm.
* Offload: right after its base is computed. Post-AOTAutograd graphs are
  functional: nothing writes the base afterwards, so the copy reads final
  values while compute goes on.
* Release (the offload ``wait``, which frees the device copy): never before
  the last forward use of any alias of the base. Device-to-host copies run in
  issue order on one engine (each starts when both its base exists and the
  previous copy ended); the release goes at the first node after that use where
  the copy is predicted done, so compute does not stall on it, but no later
  than the memory bound allows (holding the device copy longer raises the
  activation curve) and no later than the forward's end.
* Prefetch, ``horizon=int``: exactly that many compute ops before the first
  backward consumer, clamped to the start of the backward. Views, getitems,
  fxoffload ops, and ops of graph inputs only or of nothing (constants a
  compiler folds or hoists) do not count.
* Prefetch, ``horizon="auto"``: host-to-device copies are served in order on
  one engine, so walking the transfers from the last consumer back gives each
  copy its latest start (it must end before its consumer and before the next
  copy starts); the prefetch goes at the last node issued no later than that,
  from the predicted compute time of every backward node. If that would break
  the memory bound (a prefetched copy occupies the device from its prefetch),
  it starts as early as the bound allows and the stall is recorded.
* Wait: right before the first backward consumer.
* Across graph boundaries (``cross_graphs``, on by default). A release that
  would stall at the forward's end (the copy is predicted to land after the
  forward's last op, and the memory bound let it wait that long) is deferred
  instead: the graph returns with the copy in flight, and the runtime drops the
  device copy once it has landed, at the latest when a backward begins (so
  the memory model's curve, which holds it to the forward's end, stays true
  within the graph). Where one graph runs several times per step under a
  budget, every run but the step's last runs on top of one run's held bytes
  less: a release inside the forward defers in those runs
  (``Placement.deferred_before_last``; the runtime completes the copy at the
  latest when that forward returns) while its source, counted to the
  forward's end, fits that larger room; the last run waits where the bound
  put the release. Under ``horizon="auto"``, the transfers whose latest start
  lies before the backward's first op (their copies cannot be hidden inside
  this graph) are started ahead by the backward that runs before this one (the
  next layer's, when one graph serves every layer): one ``prefetch_ahead`` of
  their bytes goes at the node that gives the first of them the same lead
  before this graph's end, or later, as far as the memory bound over the rest
  of this backward requires. The graph's own prefetch of such a transfer then
  finds its copy in flight. In a smallest-peak plan (no budget) of a graph
  serving several layers, that bound is the total curve alone: the plan's own
  activation peak would hold the copy to this backward's last op, where it
  hides nothing (a layer that reads its input to its backward's end leaves no
  room for the next one's before then); the lead is then doubled
  (``AHEAD_MARGIN``: a compiler runs independent kernels around the op), and
  the plan's peaks count those bytes (:func:`started_ahead`). Where forwards
  run between the step's backwards (``Plan.interleaved``: a pipeline stage
  under 1F1B), the copies started ahead are held through the forward between
  the two backwards as well: they must also fit over this graph's forward,
  under the same bound (which leaves out what the other runs hold), the last
  of them dropped until they do; a smallest-peak plan bounds them by its own
  peak then, not by the total curve alone, and the re-evaluated step and device
  peaks count them over the forward.
* Recompute (priced for the planner by ``fxoffload.passes.candidates.recompute_costs``): the chain
  runs right before the first backward consumer, for the predicted compute
  time of its ops; its storage and the chain's temporaries are fixed memory
  for the moves above.

The memory bound is the plan's budget, or without a budget the plan's own
predicted activation peak (so scheduling never raises it); under a device
budget, the total curve is bounded instead, by what the budget leaves after the
graph's inputs. A plan that holds its budget at other sizes too (``Plan.sizes``:
a fraction under symbolic sizes) gives one curve and bound per size, and a
move goes where it fits at every one (``_Room``). Moves also keep the
predicted total peak (every tensor of the step) at or below the step's total
peak without offloading, or at or below a lower cap (``PlanOptions.total_cap``:
plain compile's total, when the user's CPU-offload marks made the partition
save more): a release held past its last use may not raise it where
temporaries or gradients pile up. A stricter bound (the total peak of the
least-memory placement, releases at last use and prefetches at their consumers)
would give up hiding a copy behind a long op whose output meets the prefetched
copy at the peak. A staged transfer (``Transfer.staging``: a tensor filling no
one block of memory, which an engine copies through a contiguous device buffer) holds its buffer
with its copy: a move holds both, on both curves (the activation bound so
conservatively), and the re-evaluated peaks count the buffers in the total
(:func:`staging_temporaries`). Stalls are
predicted by the simulator's replay (``fxoffload.passes.simulator``): each copy starts
when it is issued and its engine is free (one engine per direction), each
wait stalls compute until its copy is done, and a stall delays what follows.

The helpers over plain lists (:func:`latest_starts`, :func:`issue_index`,
:func:`bounded_start`, :func:`fifo_finish`) know nothing of FX. The result is
an immutable :class:`Schedule`; nothing here edits a graph.

Limits. Compute never overlaps compute; copies in the two directions are
modelled independently (see the simulator for a shared link); costs come from
the roofline cost model.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from .candidates import AUTO_HORIZON, Placement, prefix_sums
from .cost_model import DeviceProfile, transfer_time
from .memory import Timeline, curve, device_peak_of_runs, intervals, peak, staging_intervals, step_peak
from .sizes import sizes_between, timeline_at
from .plan import Plan
from .replay import Copy, replay

__all__ = ["Schedule", "activation_peaks_at", "bounded_start", "fifo_finish", "held_after_forward", "issue_index",
           "kept_in_last_run", "latest_starts", "peaks_over_range", "RunPeaks", "run_peaks", "schedule_transfers",
           "scheduled_moves", "staging_temporaries",
           "with_scheduled_peaks"]


@dataclass(frozen=True)
class Schedule:
    horizon: int | str
    placements: tuple[Placement, ...]  # aligned with Plan.transfers
    prefetch_order: tuple[int, ...] = ()  # transfer indices in the order their prefetches are issued
    # The copies the backward before this one should start ahead: the first ``ahead_bytes`` of this
    # graph's transfers in prefetch order (``ahead`` names them), issued before ``ahead_before``
    # (a backward node). The op starts them for whichever invocation runs its backward next.
    ahead_before: fx.Node | None = None
    ahead_bytes: int = 0
    ahead: tuple[int, ...] = ()

    @property
    def predicted_stall(self) -> float:
        return sum(p.forward_stall + p.backward_stall for p in self.placements)


# --------------------------------------------------------------------------- pure helpers


def latest_starts(deadlines: Sequence[float], durations: Sequence[float]) -> list[float]:
    """Latest start of each copy on one in-order engine, copies listed in service order.

    Copy ``k`` must end by ``deadlines[k]`` and before copy ``k + 1`` starts.
    """
    starts = [0.0] * len(deadlines)
    next_start = float("inf")
    for k in range(len(deadlines) - 1, -1, -1):
        starts[k] = min(deadlines[k], next_start) - durations[k]
        next_start = starts[k]
    return starts


def issue_index(start_times: Sequence[float], when: float, first: int, last: int) -> int:
    """The last index in ``[first, last]`` whose start time is at or before ``when`` (``first`` if none)."""
    index = bisect.bisect_right(start_times, when, first, last + 1) - 1
    return max(first, min(index, last))


def bounded_start(occupied: Sequence[int], desired: int, end: int, nbytes: int, bound: int) -> int:
    """Earliest index in ``[desired, end]`` from which ``nbytes`` more over ``[index, end)`` stays within ``bound``."""
    index = end
    while index > desired and occupied[index - 1] + nbytes <= bound:
        index -= 1
    return index


def fifo_finish(ready: Sequence[float], durations: Sequence[float]) -> list[float]:
    """Finish times of copies served in order on one engine, each ready at ``ready[k]``."""
    finish, engine_free = [], float("-inf")
    for r, d in zip(ready, durations):
        engine_free = max(r, engine_free) + d
        finish.append(engine_free)
    return finish


# --------------------------------------------------------------------------- final schedule (after planning)


# Copies started ahead in a smallest-peak plan are planned with twice the lead they need, a margin for
# where a compiler runs the kernels around the op. It was set when, on an H200, the copy started 0.6 ms
# of the planned 1.25 ms before the backward's end (benchmarks/measured/frontier-h200-run6.json), taken
# then for Inductor running the last weight-gradient matmuls after the op; the cause was Inductor
# dropping the op's ordering edges (the op sank to there whatever its lead: run 7), kept since
# (fxoffload.backend.compat). The margin stays until a GPU measures the lead without it. The total
# curve still bounds them.
AHEAD_MARGIN = 2.0


@dataclass
class _Room:
    """What a move's bytes must fit under: one curve and bound per size the plan holds its budget at
    (its own, then ``Plan.sizes``), with each transfer's bytes at that size. Moves go where they fit
    at every size. ``totals``: the total curves alone, on the same scale (``_occupied``), held beside
    ``curves``: what copies started ahead fit under in a smallest-peak plan (:meth:`for_ahead`)."""

    curves: list[list[int]]
    bounds: list[int]
    sizes: list[list[int]]  # per size: bytes of each transfer
    totals: list[list[int]] | None = None  # held only where copies started ahead fit under them
    lead_margin: float = 1.0  # the lead copies started ahead are planned with, in units of the lead they need

    def fits(self, index: int, k: int) -> bool:
        return all(c[index] + n[k] <= b for c, n, b in zip(self.curves, self.sizes, self.bounds))

    def fits_over(self, stop: int, transfers: Sequence[int]) -> bool:
        """Whether ``transfers`` together fit over positions ``[0, stop)``."""
        return all(max(c[:stop]) + sum(n[k] for k in transfers) <= b
                   for c, n, b in zip(self.curves, self.sizes, self.bounds))

    def hold(self, start: int, stop: int, transfers: Sequence[int]) -> None:
        """Add the bytes of ``transfers`` over positions ``[start, stop)``."""
        for curves in (self.curves, self.totals or []):
            for c, n in zip(curves, self.sizes):
                nbytes = sum(n[k] for k in transfers)
                for i in range(start, stop):
                    c[i] += nbytes

    def start(self, desired: int, end: int, transfers: Sequence[int]) -> int:
        """The earliest index in ``[desired, end]`` from which ``transfers`` fit over ``[index, end)``."""
        return max(bounded_start(c, desired, end, sum(n[k] for k in transfers), b)
                   for c, n, b in zip(self.curves, self.sizes, self.bounds))

    def for_ahead(self) -> "_Room":
        """Where copies started ahead must fit: this room, or where it holds ``totals`` (a smallest-peak
        plan) the same room bounded by the total curves alone (the activation curves left out), planned
        with ``AHEAD_MARGIN``."""
        if self.totals is None:
            return self
        return _Room(self.totals, self.bounds, self.sizes, lead_margin=AHEAD_MARGIN)


@dataclass(frozen=True)
class _Size:
    """One size a plan holds its budget at: the timeline there, its bounds, its transfers' bytes."""

    timeline: Timeline
    bound: int
    total_bound: int
    sizes: list[int]


def _occupied(timeline: Timeline, moves: Mapping[int, tuple[int, int]], bound: int, total_bound: int,
              temporaries: Sequence[tuple[int, int, int]] = ()) -> tuple[list[int], list[int]]:
    """One curve that a move's bytes must fit under ``bound``: the activation curve, or the total
    curve shifted so that ``total_bound`` lands on ``bound``, whichever is closer to its limit; and that
    shifted total curve alone.

    Both curves rise by the same bytes when a copy is held longer, so one curve states both limits.
    """
    saved = curve(timeline.length, intervals(timeline, moves, residual_only=True))
    total = curve(timeline.length, intervals(timeline, moves, residual_only=False, temporaries=temporaries))
    shifted = [t - total_bound + bound for t in total]
    return [max(s, t) for s, t in zip(saved, shifted)], shifted


def _room(held: Sequence[_Size], moves: Mapping[int, tuple[int, int]], temporaries,
          ahead_by_totals: bool = False) -> _Room:
    both = [_occupied(h.timeline, moves, h.bound, h.total_bound, temporaries) for h in held]
    totals = [t for _, t in both] if ahead_by_totals else None  # held only where copies ahead use them
    return _Room([c for c, _ in both], [h.bound for h in held], [h.sizes for h in held], totals)


def schedule_transfers(
    plan: Plan,
    placements: Mapping[fx.Node, Placement],
    horizon: int | str,
    *,
    timeline: Timeline,
    times: Sequence[float],
    profile: DeviceProfile,
    cross_graphs: bool = True,
) -> Schedule:
    """Final placements of the transfers the plan chose (see the module docstring)."""
    chosen = [dataclasses.replace(placements[t.base], transfer=k) for k, t in enumerate(plan.transfers)]
    if not chosen:
        return Schedule(horizon, ())
    starts = prefix_sums(times)  # predicted start time of each timeline position, before stalls
    pos = timeline.positions
    sizes = [int(t.nbytes) for t in plan.transfers]
    lives = [t.lifetime for t in plan.transfers]
    d2h = [transfer_time(s, profile.d2h_bandwidth, profile.copy_latency) for s in sizes]
    h2d = [transfer_time(s, profile.h2d_bandwidth, profile.copy_latency) for s in sizes]

    moves = plan.recompute_moves()  # recomputed storages stay where the plan put them
    moves.update({lives[k]: (pos[p.free_after], pos[p.prefetch_before]) for k, p in enumerate(chosen)})
    held = _held_sizes(plan, timeline, moves)
    # A smallest-peak plan's bound is its own activation peak; in a graph serving several layers, a copy
    # started ahead for the next layer's backward would raise it by that copy's bytes (two layers' inputs
    # on the device at the handover, not one), and be held back to the end of this backward, where it
    # can hide nothing: such copies fit under the total curve alone.
    # Not where forwards run between the backwards: there the copies are held through the next forward too,
    # which the total curve alone does not bound (the plan's own peak does).
    ahead_by_totals = (plan.budget_bytes is None and plan.device_bytes is None and plan.runs > 1
                       and not plan.interleaved)

    def room() -> _Room:  # the curves at the moves so far, staging buffers included
        staged = [interval for k, p in enumerate(chosen) for interval in staging_intervals(
            pos[p.offload_after], *moves[lives[k]], pos[p.wait_before], plan.transfers[k].staging)]
        return _room(held, moves, plan.recompute_temporaries() + staged, ahead_by_totals=ahead_by_totals)

    releases, late = _place_releases(timeline, chosen, room(), d2h, starts, pos)
    for k, r in enumerate(releases):
        moves[lives[k]] = (r, moves[lives[k]][1])
    spilled = room()  # the rest of the forward, with deferred sources held into it
    deferred = _deferrable(late, plan.runs, sizes, starts, len(timeline.fw_nodes), spilled) if cross_graphs else set()
    # Under a held cap (a share of a step of several graphs), a deferred source stays on into the next
    # graph's forward, and copies started ahead land during the next graph's backward: each on top of
    # what this graph holds, so each within what the cap leaves of it (smallest deferrals first).
    spill = None if plan.held_cap is None else max(plan.held_cap - plan.held_after, 0)
    if spill is not None:
        deferred = _fitting(sorted(deferred, key=lambda k: (sizes[k], k)), sizes, spill)
    deferred = [k in deferred for k in range(len(chosen))]
    early = _deferred_before_last(plan, timeline, moves, releases, deferred, spilled) if cross_graphs else set()
    ahead: tuple[int, int, list[int]] | None = None
    if horizon == AUTO_HORIZON:
        for k, p in enumerate(chosen):  # start from the least memory: every prefetch at its consumer
            moves[lives[k]] = (moves[lives[k]][0], pos[p.wait_before])
        forward = len(timeline.fw_nodes) if plan.interleaved else 0
        prefetches, ahead = _place_prefetches(timeline, chosen, room(), h2d, starts, cross_graphs,
                                              _AheadRoom(spill, forward))
    else:
        prefetches = [pos[p.prefetch_before] for p in chosen]
    placed = [_Placed(releases[k], deferred[k], prefetches[k], d2h[k], h2d[k], k in early) for k in range(len(chosen))]
    schedule = _with_stalls(timeline, chosen, placed, times, horizon, op_seconds=profile.op_seconds)
    if ahead is None:
        return schedule
    at, _, which = ahead
    # The bytes the copies move (what the runtime and the step simulator spend the budget on); the
    # room checked them with their staging buffers.
    nbytes = sum(sizes[k] for k in which)
    return dataclasses.replace(schedule, ahead_before=timeline.nodes[at], ahead_bytes=nbytes, ahead=tuple(which))


def _held_sizes(plan: Plan, timeline: Timeline, moves: Mapping[int, tuple[int, int]]) -> list[_Size]:
    """The plan's own size, then each other size it holds its budget at (``Plan.sizes``)."""
    lives = [t.lifetime for t in plan.transfers]
    bound, total_bound = _bounds(plan, timeline, moves)
    # Holding a staged transfer's copy longer holds its staging buffer too (``Transfer.staging``).
    out = [_Size(timeline, bound, total_bound, [int(t.nbytes) + t.staging for t in plan.transfers])]
    for size in plan.sizes:
        at = timeline_at(timeline, dict(size.values))
        total = peak(curve(at.length, intervals(at, {}, residual_only=False)))
        out.append(_Size(at, size.budget_bytes - _earlier(plan, at, moves), total,
                         # a buffer at that size: its storage's bytes there (numel x itemsize or more)
                         [at.lifetimes[i].nbytes * (2 if t.staging else 1) for i, t in zip(lives, plan.transfers)]))
    return out


def _earlier(plan: Plan, timeline: Timeline, moves: Mapping[int, tuple[int, int]]) -> int:
    """What the step's earlier runs of the graph hold for their backward (nothing for one run)."""
    if plan.runs == 1:
        return 0
    held = curve(timeline.length, intervals(timeline, moves, residual_only=True))[len(timeline.fw_nodes) - 1]
    return (plan.runs - 1) * held


def _bounds(plan: Plan, timeline: Timeline, moves: Mapping[int, tuple[int, int]]) -> tuple[int, int]:
    """The bounds on this graph's own activation and total curves that moves must keep.

    Activations: the plan's budget, less what the step's earlier runs hold for their backward when
    the graph runs several times; without a budget, the plan's own predicted peak (so that
    scheduling never raises it). Total: the step's total peak without offloading (or a lower cap):
    the least-memory placement's own total is never above it (its device intervals lie inside each
    storage's unoffloaded lifetime; where a cap is below even that, copies stay at their
    least-memory placement), except for staged transfers' buffers, which lie outside those
    lifetimes: where they reach the total peak, copies stay at their least-memory placement and
    the re-evaluated total peak (``Plan.total_peak_after``) shows the buffers above it. Under a
    device budget the total is bounded by what the budget leaves after the graph's inputs and the
    earlier runs, and it is the one curve that counts."""
    earlier = _earlier(plan, timeline, moves)
    total_bound = min(plan.total_peak_before, plan.total_cap or plan.total_peak_before)
    if plan.device_bytes is not None:  # then max(saved, total - total_bound + bound) is the total curve
        # Everywhere, what the backwards hold on top of it (``memory.device_peak_of_runs``): at most the
        # other runs' activations or their gradients, and the gradients other graphs left.
        under = max(earlier, (plan.runs - 1) * plan.run_gradients) + plan.backward_gradients
        total_bound = min(total_bound, plan.device_bytes - plan.input_bytes - under)
        return total_bound, total_bound
    if plan.budget_bytes is None:
        return plan.activation_peak_after, total_bound
    return plan.budget_bytes - earlier, total_bound


def _fitting(order: Sequence[int], sizes: Sequence[int], room: int) -> set[int]:
    """The first transfers of ``order`` whose bytes together fit ``room``."""
    chosen, left = set(), room
    for k in order:
        if sizes[k] > left:
            break
        chosen.add(k)
        left -= sizes[k]
    return chosen


def _deferrable(late, runs, sizes, starts, forward, room: _Room) -> set[int]:
    """The late releases that may cross the forward's end (``late``: transfer -> seconds its copy is
    predicted to run past the forward's last op). When the graph runs several times per step, a
    deferred source lives on into the next run's forward until its copy lands: it must fit under
    the bound there, on top of that forward's own curve (smallest first)."""
    if runs == 1 or not late:
        return set(late)
    chosen = set()
    for k in sorted(late, key=lambda k: sizes[k]):
        # The next run's forward positions that start before this copy has landed.
        until = min(forward, bisect.bisect_left(starts, late[k], 0, forward) + 1)
        if room.fits_over(until, [k]):
            chosen.add(k)
            room.hold(0, until, [k])
    return chosen


def _deferred_before_last(plan: Plan, timeline: Timeline, moves: Mapping[int, tuple[int, int]],
                          releases: Sequence[int], deferred: Sequence[bool], room: _Room) -> set[int]:
    """The releases inside the forward (not ``deferred`` at its end already) that may defer in every run
    but the step's last (one graph serving several layers under a budget). Run ``j`` runs on top of what
    ``j`` earlier runs hold, so every run before the last has one run's ``held`` more room than the last,
    whose bound ``room`` holds. The runtime completes such a copy at the latest when its forward returns,
    so each source is counted to the forward's end, on top of ``room`` (which holds the sources deferred
    from the run before), while it fits that looser bound: the largest first, then by release. Every
    release inside the forward is a candidate, not only those the bound held back before their copy
    lands: the others keep the runs before the last from stalling on a copy slower than predicted.
    None without a budget, under a device budget, at several sizes, or where forwards run between
    backwards (``Plan.interleaved``: the run order is a pipeline's)."""
    if (plan.runs < 2 or plan.budget_bytes is None or plan.device_bytes is not None or plan.sizes
            or plan.interleaved):
        return set()
    held = _earlier(plan, timeline, moves) // (plan.runs - 1)
    loose = dataclasses.replace(room, bounds=[b + held for b in room.bounds])
    forward_end = len(timeline.fw_nodes) - 2  # the last node before the output
    inside = [k for k, r in enumerate(releases) if r < forward_end and not deferred[k]]
    chosen = set()
    for k in sorted(inside, key=lambda k: (-room.sizes[0][k], releases[k], k)):
        span = range(releases[k] + 1, forward_end + 1)
        if all(loose.fits(i, k) for i in span):
            loose.hold(span.start, span.stop, [k])
            chosen.add(k)
    return chosen


def _place_releases(timeline, chosen, room: _Room, d2h, starts, pos) -> tuple[list[int], dict[int, float]]:
    """Each release's position, and the transfers released at the forward's end before their copy
    is predicted to land (not held there by the memory bound): those a graph boundary may cross,
    with the seconds their copy runs past the forward's last op."""
    forward_end = len(timeline.fw_nodes) - 2  # the last node before the output
    order = sorted(range(len(chosen)), key=lambda k: pos[chosen[k].offload_after])
    ready = [starts[pos[chosen[k].offload_after] + 1] for k in order]
    done = dict(zip(order, fifo_finish(ready, [d2h[k] for k in order])))
    releases = [0] * len(chosen)
    late = {}
    for k in order:
        earliest = pos[chosen[k].free_after]
        wanted = max(earliest, min(forward_end, issue_index(starts, done[k], earliest, forward_end)))
        # Holding the device copy from ``earliest`` to ``wanted`` adds its bytes there.
        index = earliest
        while index < wanted and room.fits(index + 1, k):
            index += 1
        room.hold(earliest + 1, index + 1, [k])
        releases[k] = index
        if index == forward_end and done[k] > starts[forward_end + 1]:
            late[k] = done[k] - starts[forward_end + 1]
    return releases, late


@dataclass(frozen=True)
class _AheadRoom:
    """What copies started ahead must fit besides the rest of the backward that starts them: at most
    ``nbytes`` (None: as the bound allows), and, where a forward runs between two backwards
    (``Plan.interleaved``), the positions ``[0, forward)`` of this graph's forward, which holds them
    too (0: none)."""

    nbytes: int | None = None
    forward: int = 0


def _place_prefetches(timeline, chosen, room: _Room, h2d, starts, cross_graphs,
                      ahead_room: _AheadRoom = _AheadRoom()) -> tuple[list[int], tuple[int, int, list[int]] | None]:
    """Each prefetch's position, and the copies to start ahead in the backward before this one:
    (position, bytes, transfers), or None. ``room`` starts from every prefetch at its consumer
    (the least memory); ``ahead_room``: what else the copies started ahead must fit (:class:`_AheadRoom`)."""
    pos = timeline.positions
    first = len(timeline.fw_nodes) + next(i for i, n in enumerate(timeline.bw_nodes) if n.op != "placeholder")
    order = sorted(range(len(chosen)), key=lambda k: pos[chosen[k].wait_before])
    consumers = [pos[chosen[k].wait_before] for k in order]
    latest = latest_starts([starts[c] for c in consumers], [h2d[k] for k in order])
    prefetches = [0] * len(chosen)
    for j in range(len(order) - 1, -1, -1):
        k, consumer = order[j], consumers[j]
        desired = issue_index(starts, latest[j], first, consumer)
        start = room.start(desired, consumer, [k])
        room.hold(start, consumer, [k])
        prefetches[k] = start
    if not cross_graphs:
        return prefetches, None
    # The copies that cannot be hidden in this backward: their latest start lies before its first op,
    # and the bound let their prefetch start there (one it held back stays held back). A prefix of
    # the issue order: latest starts ascend with the consumers.
    early = []
    for j, k in enumerate(order):
        if latest[j] >= starts[first] or prefetches[k] != first:
            break
        early.append(k)
    while ahead_room.nbytes is not None and early and sum(room.sizes[0][k] for k in early) > ahead_room.nbytes:
        early = early[:-1]
    ahead = room.for_ahead()
    while early and ahead_room.forward and not ahead.fits_over(ahead_room.forward, early):
        early = early[:-1]  # held through the forward between two backwards: it must fit there too
    return prefetches, _place_ahead(ahead, starts, first, latest, early)


def _place_ahead(room: _Room, starts, first, latest, early) -> tuple[int, int, list[int]] | None:
    """Where the backward before this one starts the copies of ``early`` (transfers in prefetch
    order, each with a latest start before this backward's first op): the node giving the first of
    them the same lead before the end of this backward, or later as the bound requires. Copies that
    do not fit are dropped from the end of the list."""
    end = len(room.curves[0]) - 1  # the backward's output node
    lead = (starts[first] - latest[0]) * room.lead_margin if early else 0.0
    while early:
        desired = issue_index(starts, starts[end] - lead, first, end)
        at = room.start(desired, end, early)
        if at < end:
            return at, sum(room.sizes[0][k] for k in early), early
        early = early[:-1]
    return None


@dataclass(frozen=True)
class _Placed:
    """Where the schedule puts one transfer: the position its source is freed after, whether that source
    stays on into the next run's forward (deferred), the prefetch's position; and the predicted copy
    seconds each way."""

    release: int
    deferred: bool
    prefetch: int
    d2h: float
    h2d: float
    before_last: bool = False  # deferred in every run but the step's last (``Placement.deferred_before_last``)


def _with_stalls(timeline, chosen, placed: Sequence[_Placed], times, horizon, *, op_seconds: float) -> Schedule:
    """Predict each wait's stall with the simulator's replay (one engine per direction, the host's op
    calls on its own clock)."""
    nodes, pos = timeline.nodes, timeline.positions
    # Prefetches issued at the same node go in the order of their consumers.
    order = sorted(range(len(chosen)), key=lambda k: (placed[k].prefetch, pos[chosen[k].wait_before], k))
    backward = len(timeline.fw_nodes)  # a deferred copy is waited for when the backward begins, at the latest
    copies = [Copy(pos[p.offload_after] + 1, backward if placed[k].deferred else placed[k].release + 1,
                   placed[k].d2h, "d2h") for k, p in enumerate(chosen)]
    copies += [Copy(placed[k].prefetch, pos[chosen[k].wait_before], placed[k].h2d, "h2d") for k in order]
    run = replay(times, copies, op_seconds)
    backward_stall = {k: run.stalls[len(chosen) + j] for j, k in enumerate(order)}
    compute = timeline.anchored
    result = []
    for k, p in enumerate(chosen):
        consumer = pos[p.wait_before]
        result.append(dataclasses.replace(
            p,
            free_after=nodes[placed[k].release],
            prefetch_before=nodes[placed[k].prefetch],
            ops_ahead=sum(compute[placed[k].prefetch:consumer]),
            d2h_seconds=placed[k].d2h,
            h2d_seconds=placed[k].h2d,
            forward_stall=run.stalls[k],
            backward_stall=backward_stall[k],
            deferred=placed[k].deferred,
            deferred_before_last=placed[k].before_last,
        ))
    return Schedule(horizon, tuple(result), tuple(order))


# --------------------------------------------------------------------------- the plan under its schedule


def scheduled_moves(plan: Plan, timeline: Timeline, schedule: Schedule) -> dict[int, tuple[int, int]]:
    """Each moved storage's lifetime index -> (release, return) positions at the schedule's placements
    (recomputed storages: release and rebuild), as ``fxoffload.passes.memory.intervals`` reads it."""
    pos = timeline.positions
    moved = plan.recompute_moves()
    moved.update({
        plan.transfers[p.transfer].lifetime: (pos[p.free_after], pos[p.prefetch_before])
        for p in schedule.placements
    })
    return moved


def staging_temporaries(plan: Plan, timeline: Timeline, schedule: Schedule) -> list[tuple[int, int, int]]:
    """Device intervals of the staged transfers' contiguous buffers (``Transfer.staging``) at the
    schedule's placements. Not activations: they count in the total and device peaks."""
    pos = timeline.positions
    return [interval for p in schedule.placements
            for interval in staging_intervals(pos[p.offload_after], pos[p.free_after], pos[p.prefetch_before],
                                              pos[p.wait_before], plan.transfers[p.transfer].staging)]


def started_ahead(timeline: Timeline, schedule: Schedule) -> list[tuple[int, int, int]]:
    """The device interval of the copies this backward starts ahead for the next one (``prefetch_ahead``):
    from its node to the backward's end, where the next backward takes them over. Counted in a plan's
    peaks when the graph runs several times a step (the next backward is its own next run); one run's
    next backward is another graph's or none, which the step's simulation counts
    (``fxoffload.passes.step``). At the plan's own size only: its peaks at other sizes (``Plan.sizes``)
    leave them out (each still fits under the budget there, ``_Room``)."""
    if not schedule.ahead_bytes:
        return []
    return [(timeline.positions[schedule.ahead_before], timeline.length - 1, schedule.ahead_bytes)]


def kept_in_last_run(plan: Plan, schedule: Schedule) -> tuple[int, ...]:
    """The transfers whose source the step's last run of the graph keeps on the device for its backward
    (``wait(..., keep_last=True)``): graph inputs among those started ahead (``Schedule.ahead``), in a
    smallest-peak plan (no budget) of a graph that runs several times a step with no forward between its
    backwards (not ``Plan.interleaved``), released by a wait (not deferred). In a stack of layers the last
    run's backward is the step's first: no backward runs before it to start its copies ahead, so each
    would wait for its whole copy back (a layer input under checkpointing, the seed's configuration: 4.9 ms
    of a 5.2 s step at 32 Llama-3-8B layers x 32768 tokens, predicted). The last run still copies it to the
    host (the keep may be dropped at any time, and the prefetch then copies from there) and holds it from
    its release to its backward, where the prefetch takes a device copy of it (``fxoffload.runtime``): the
    step holds one such input more between its last forward and its first backward (where a loss's logits
    usually make the step's peak), and the two side by side at that prefetch, as at the handover of a copy
    started ahead. A budget is a bound this does not check, so budgeted plans keep nothing. A function of
    the plan and schedule: digests do not change."""
    if plan.runs < 2 or plan.interleaved or plan.budget_bytes is not None or plan.device_bytes is not None:
        return ()
    return tuple(k for k in schedule.ahead if plan.transfers[k].base.op == "placeholder"
                 and not schedule.placements[k].deferred)


@dataclass(frozen=True)
class RunPeaks:
    """One run of a planned graph at the schedule's placements (predicted bytes of every tensor the run
    creates): the largest over its forward and over its backward, and what it leaves on the device for
    its backward (the activation curve at its forward's end). A step that runs the graph beside eager
    code adds the run's curve to what that code holds at each run (``fxoffload.tools.layer_step``)."""

    forward: int
    backward: int
    held: int


def run_peaks(plan: Plan, timeline: Timeline, schedule: Schedule) -> RunPeaks:
    """:class:`RunPeaks` of one run of ``plan`` (the curves :func:`with_scheduled_peaks` reads)."""
    activations, totals = _run_curves(plan, timeline, schedule)
    forward = len(timeline.fw_nodes)
    return RunPeaks(peak(totals[:forward]), peak(totals[forward:]),
                    activations[forward - 1] if activations and forward else 0)


def _run_curves(plan: Plan, timeline: Timeline, schedule: Schedule,
                before_last: bool = False) -> tuple[list[int], list[int]]:
    """One run's activation curve and total curve (every tensor it creates) at the schedule's placements;
    with ``before_last``, of a run before the step's last (``Placement.deferred_before_last``: those
    sources, and a staged one's buffer, held to the forward's end)."""
    if before_last:
        end = timeline.nodes[len(timeline.fw_nodes) - 2]  # the last node before the output
        schedule = dataclasses.replace(schedule, placements=tuple(
            dataclasses.replace(p, free_after=end) if p.deferred_before_last else p for p in schedule.placements))
    moved = scheduled_moves(plan, timeline, schedule)
    ahead = started_ahead(timeline, schedule) if plan.runs > 1 else []  # one run: the next backward is another graph's
    activations = curve(timeline.length, intervals(timeline, moved, True) + ahead)
    temporaries = plan.recompute_temporaries() + staging_temporaries(plan, timeline, schedule) + ahead
    return activations, curve(timeline.length, intervals(timeline, moved, False, temporaries))


def with_scheduled_peaks(plan: Plan, timeline: Timeline, schedule: Schedule) -> Plan:
    """The plan with its predicted peaks re-evaluated at the schedule's final placements."""
    if not schedule.placements:
        return plan
    activations, totals = _run_curves(plan, timeline, schedule)
    ahead = started_ahead(timeline, schedule) if plan.runs > 1 else []
    total = peak(totals)
    forward = len(timeline.fw_nodes)
    held = activations[forward - 1] if activations else 0
    sizes = tuple(dataclasses.replace(size, step_peak_after=activation_peaks_at(plan, timeline, schedule,
                                                                              dict(size.values))[1])
                  for size in plan.sizes)
    through = _held_through_forward(plan, ahead, forward, held)
    step, device = _before_last_peaks(plan, timeline, schedule, held)
    return dataclasses.replace(
        plan,
        sizes=sizes,
        activation_peak_after=peak(activations),
        step_peak_after=max(step_peak(activations, forward, plan.runs), through(activations), step),
        device_peak_after=plan.input_bytes + max(
            device_peak_of_runs(totals, forward, held, plan.runs, plan.run_gradients), through(totals), device),
        total_peak_after=total,
    )


def _before_last_peaks(plan: Plan, timeline: Timeline, schedule: Schedule, held: int) -> tuple[int, int]:
    """The step's activation and device peaks (less the inputs) over the runs before its last, where
    releases deferred before the last run hold their sources to the forward's end (0, 0 where none
    does): the run before the last, on top of what the others before it hold, is the highest of them."""
    if not any(p.deferred_before_last for p in schedule.placements):
        return 0, 0
    activations, totals = _run_curves(plan, timeline, schedule, before_last=True)
    forward = len(timeline.fw_nodes)
    return (peak(activations) + (plan.runs - 2) * held,
            device_peak_of_runs(totals, forward, held, plan.runs - 1, plan.run_gradients))


def _held_through_forward(plan: Plan, ahead: Sequence[tuple[int, int, int]], forward: int,
                          held: int) -> Callable[[Sequence[int]], int]:
    """The step's peak over a forward that runs between two backwards (``Plan.interleaved``), given one
    run's curve: the copies the backward before it started ahead are held through it, on top of its own
    curve and what the step's other runs hold for their backward (0 where no forward runs so)."""
    nbytes = sum(n for _, _, n in ahead) if plan.interleaved else 0
    others = (plan.runs - 1) * held
    return lambda one_run: max(one_run[:forward], default=0) + nbytes + others if nbytes else 0


def activation_peaks_at(plan: Plan, timeline: Timeline, schedule: Schedule,
                        values: Mapping[Any, int]) -> tuple[int, int]:
    """The step's activation peak without and with the plan, its symbolic sizes at ``values``."""
    at = timeline_at(timeline, dict(values))
    before = curve(at.length, intervals(at, {}, True))
    after = curve(at.length, intervals(at, scheduled_moves(plan, at, schedule), True))
    forward = len(at.fw_nodes)
    return step_peak(before, forward, plan.runs), step_peak(after, forward, plan.runs)


def peaks_over_range(plan: Plan, timeline: Timeline, schedule: Schedule) -> list[tuple[dict, int, int]]:
    """The step's activation peaks without and with the plan, at sizes across the range the plan
    holds a fraction over as planned (``Plan.ranges_held``; ``fxoffload.passes.sizes.sizes_between``): (sizes,
    before, after) each."""
    return [(values, *activation_peaks_at(plan, timeline, schedule, values))
            for values in sizes_between(plan.ranges_held())]


def held_after_forward(plan: Plan, timeline: Timeline, schedule: Schedule) -> int:
    """Predicted activation bytes the pair's forward leaves on the device for its backward."""
    activations = curve(timeline.length, intervals(timeline, scheduled_moves(plan, timeline, schedule), True))
    return activations[len(timeline.fw_nodes) - 1] if activations else 0

