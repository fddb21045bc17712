"""Step simulator: a training step made of several compiled-graph invocations, replayed as one.

Inputs: the records of a step's compiled-graph invocations, in run order, and a
``DeviceProfile``. Output: a ``StepSimulation`` (predicted step time and activation peak).

With per-layer compile (FSDP2, torchtitan) one compiled graph runs once per
layer: the step is k forward invocations, then their backwards in reverse
order. :func:`simulate_step` replays such a step from the graphs' records,
in the order the invocations ran:

* Compute: one stream runs every invocation's forward nodes, then every
  backward, last invocation first, each node for its predicted time (the
  roofline cost model, recompute chains and staged transfers' device copies
  included).
* Copies: the copy engines carry over from one invocation to the next (one per
  direction, or one shared engine when the link is not full duplex), so a
  deferred device-to-host copy (``Placement.deferred``) runs under the next
  invocation's forward. The runtime completes it when the forward after
  next begins, or the first backward (whichever comes first): compute waits
  there for a copy still in flight. A release deferred before the last run
  (``Placement.deferred_before_last``) defers in every run of its graph but
  the step's last (the last invocation of its record) and waits there; the
  runtime completes such a copy at its own forward's end.
  Host-to-device copies start at their own prefetch, except those a
  backward starts ahead for the backward that runs after it
  (``Schedule.ahead_bytes``): the runtime starts the next invocation's
  first transfers, in prefetch order, while they fit in those bytes; and
  those the step's last run of a graph keeps on the device instead
  (``fxoffload.passes.scheduling.kept_in_last_run``): no copy back, a
  device copy of the source at the prefetch (its bytes read and written at
  the profile's memory bandwidth).
* Memory (saved activations, what a budget bounds): each invocation's own
  curve under its plan, plus the bytes every earlier invocation still holds
  for its backward (``fxoffload.passes.scheduling.held_after_forward``), plus copies
  started ahead (from their start to the end of the backward that started
  them), plus deferred sources until their copy has landed on the simulated
  clock, plus sources kept in a graph's last run (from their release to
  their prefetch, whose device copy replaces them: both are on the device
  only inside that op, as ``fxoffload.tools.measure`` counts too), plus
  offloaded graph inputs their caller still held when the backward began
  (``caller_kept``, as the backend saw them: from the release to the step's
  end). The baseline is the same step without offloading or
  recomputing.

Every figure is a prediction. Limits: compute outside the compiled graphs
(embeddings, the loss) is not in the records and not simulated; an
activation one invocation hands to the next is counted in the curve of the
graph that saves it (``Timeline.input_activations``); total memory (gradients, temporaries) is left to the
per-graph simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .cost_model import DeviceProfile, roofline, staging_seconds
from .memory import curve, intervals
from .plan import recompute_moves
from .replay import Copy, op_starts, replay
from .scheduling import held_after_forward, kept_in_last_run
from .simulator import SimulatedCopy

__all__ = ["KeptSource", "StepSimulation", "simulate_runs", "simulate_step"]


@dataclass(frozen=True)
class KeptSource:
    """A transfer whose source, an input of its graph, the caller kept after the graph returned."""

    transfer: int  # index into the invocation's Plan.transfers
    into_backward: bool  # still held when the step's backward began (else dropped during the forward)


@dataclass(frozen=True)
class StepSimulation:
    """A predicted step of several invocations; times in seconds, memory in bytes."""

    invocations: int
    step_time: float
    # the same invocations without offloading or recomputing, without stalls, each of the min-cut pair
    # (a plan of PyTorch's recompute-only pair: less what that partition adds, ``Plan.partition_seconds``)
    compute_time: float
    backward_start: float
    activation_peak: int  # saved activations over the whole step, under the plans
    activation_peak_before: int  # the same without offloading or recomputing
    activations: tuple[tuple[float, int], ...]  # (time, bytes) at each op's start, under the plans
    baseline_activations: tuple[tuple[float, int], ...]  # the same on the baseline's own clock
    stall: float  # compute stalled on copies, over the step
    crossing: int  # copies that ran across an invocation boundary (deferred or started ahead)
    ops: tuple[tuple[float, float], ...] = ()  # (start, seconds) per op, every run's forward then backward
    copies: tuple[SimulatedCopy, ...] = ()  # in issue order; ``name`` is "run j"
    boundaries: tuple[float, ...] = ()  # when each run's forward and each run's backward begins
    # Host memory when the last forward ends, every run's copies alive then (``Plan.host_bytes``), and
    # the same in CUDA's pinned power-of-two blocks (``Plan.pinned_host_bytes``).
    host_bytes: int = 0
    pinned_host_bytes: int = 0
    host_wait: float = 0.0  # device time idle while the host issued fxoffload ops (``fxoffload.passes.simulator``)
    # compute the planned partitions add over the min-cut pairs' (``Plan.partition_seconds``, each the
    # planning profile's prediction, on any profile)
    partition_time: float = 0.0

    @property
    def baseline_time(self) -> float:
        """The planned pairs' step without offloading, on its own clock (the baseline curve's end)."""
        return self.compute_time + self.partition_time

    @property
    def overhead(self) -> float:
        return self.step_time / self.compute_time - 1.0 if self.compute_time else 0.0

    @property
    def memory(self) -> tuple:
        return ()  # the step is replayed for saved activations only (see the module docstring)

    baseline_memory = memory


@dataclass(frozen=True)
class _Move:
    """One transfer of a graph, in its timeline positions (a copy "at" p is issued or waited before p)."""

    offload: int
    release: int
    prefetch: int
    wait: int
    nbytes: int
    d2h: float  # seconds
    h2d: float
    deferred: bool
    transfer: int = -1  # index into Plan.transfers
    death: int = 0  # the source's last use (timeline position), where the graph's own hold ends
    before_last: bool = False  # deferred in every run of the graph but the step's last (at ``release``)


@dataclass(frozen=True)
class _Graph:
    """What the step needs of one record, computed once however many times it runs."""

    forward: int  # timeline positions of the forward
    times: list[float]  # per position, under the plan (recompute chains included)
    base_times: list[float]
    own: list[int]  # saved-activation curve under the plan
    base: list[int]  # the same without offloading
    held: int  # saved bytes left for the backward after the forward, under the plan
    base_held: int
    transfers: list[_Move]  # in prefetch order
    ahead_at: int | None  # backward position of prefetch_ahead
    ahead_bytes: int
    kept: frozenset[int] = frozenset()  # transfers (Plan.transfers indices) its last run of the step keeps


def _graph(record: Any, profile: DeviceProfile) -> _Graph:
    timeline, plan, schedule = record.timeline, record.plan, record.schedule
    pos, forward = timeline.positions, len(timeline.fw_nodes)
    base_times = [roofline(w, profile) for w in record.work]
    times = list(base_times)
    for r in plan.recomputes:
        times[r.at - 1] += r.cost.seconds
    for p in schedule.placements:  # a staged copy's device copies: before its offload, after its landing
        staged = staging_seconds(plan.transfers[p.transfer].staging, profile)
        times[pos[p.offload_after]] += staged
        times[pos[p.wait_before]] += staged
    order = schedule.prefetch_order or tuple(range(len(schedule.placements)))
    transfers = []
    for k in order:
        p = schedule.placements[k]
        transfers.append(_Move(pos[p.offload_after] + 1, pos[p.free_after] + 1, pos[p.prefetch_before],
                               pos[p.wait_before], int(plan.transfers[k].nbytes), p.d2h_seconds, p.h2d_seconds,
                               p.deferred, p.transfer, timeline.lifetimes[plan.transfers[k].lifetime].death,
                               p.deferred_before_last and not p.deferred))
    moved = recompute_moves(plan.recomputes)
    moved.update({plan.transfers[p.transfer].lifetime: (pos[p.free_after], pos[p.prefetch_before])
                  for p in schedule.placements})
    own = curve(timeline.length, intervals(timeline, moved, residual_only=True))
    base = curve(timeline.length, intervals(timeline, {}, residual_only=True))
    return _Graph(
        forward, times, base_times, own, base, held_after_forward(plan, timeline, schedule),
        base[forward - 1] if base else 0, transfers,
        pos[schedule.ahead_before] if schedule.ahead_bytes else None, schedule.ahead_bytes,
        frozenset(kept_in_last_run(plan, schedule)),
    )


def _ahead_of(graph: _Graph, nbytes: int) -> list[int]:
    """The transfers (indices into ``graph.transfers``) a ``prefetch_ahead`` of ``nbytes`` starts."""
    chosen, left = [], nbytes
    for i, move in enumerate(graph.transfers):
        if move.nbytes > left:
            break
        left -= move.nbytes
        chosen.append(i)
    return chosen


@dataclass(frozen=True)
class _Issued:
    copy: Copy
    rank: int  # issue order at one position: 0 offload, 1 own prefetch, 2 started ahead
    invocation: int
    nbytes: int
    deferred: bool = False
    transfer: int = -1  # index into the invocation's Plan.transfers
    held_from: int = 0  # a deferred copy: the step position from which the step's curve holds its source
    within: bool = False  # deferred before the last run: completed at its own forward's end (crosses nothing)


def simulate_step(invocations: Sequence[Any], profile: DeviceProfile | None = None,
                  caller_kept: Sequence[Any] | None = None) -> StepSimulation:
    """Replay a step whose compiled-graph invocations ran in the order of ``invocations`` (records;
    a record appears once per run: ``[record] * 32`` for one graph serving 32 layers).

    ``caller_kept``: per invocation, the :class:`KeptSource` transfers whose source, an input of the
    graph, the caller kept after the graph returned (``fxoffload.backend.callers``; the backend's
    ``step_caller_kept()``): the copy freed nothing, so a source still held when the backward began
    counts from its release to the step's end, and in the baseline from its last use on. One the
    caller dropped before the backward is not an activation (``fxoffload.tools.measure``: saved tensors
    are those alive when the backward starts), like any temporary of the forward. ``compute_time`` is of the
    min-cut pairs: a plan of PyTorch's recompute-only pair adds the compute that pair adds
    (``Plan.partition_seconds``, the planning profile's prediction on any ``profile``) to the overhead."""
    if not invocations:
        raise ValueError("simulate_step: no invocations")
    profile = profile or invocations[0].profile
    cache: dict[int, _Graph] = {}
    for r in invocations:
        if id(r) not in cache:
            cache[id(r)] = _graph(r, profile)
    graphs = [cache[id(r)] for r in invocations]
    fw_off, bw_off, length = _offsets(graphs)
    first_backward = bw_off[-1]
    times, base_times = _step_times(graphs, fw_off, bw_off, length)
    kept = _kept_in_last_runs(graphs, fw_off, bw_off)
    for keep in kept:  # the device copy its prefetch makes
        times[keep.claim] += 2 * keep.nbytes / profile.memory_bandwidth
    issued = _copies(graphs, fw_off, bw_off, first_backward, profile, {(k.invocation, k.transfer) for k in kept})
    run = replay(times, [c.copy for c in issued], profile.op_seconds)
    act, base = _activations(graphs, fw_off, bw_off, length)
    by_caller = caller_kept or [()] * len(graphs)
    _add_caller_kept(act, base, graphs, by_caller, fw_off, bw_off)
    held_anyway = {(j, k.transfer) for j, sources in enumerate(by_caller) for k in sources if k.into_backward}
    for keep in kept:
        if (keep.invocation, keep.transfer) not in held_anyway:
            for q in range(keep.release, keep.claim):  # the prefetch's copy replaces it there
                act[q] += keep.nbytes
    for c, finish in zip(issued, run.finishes):
        if c.rank == 2:  # started ahead: held from its start until its own backward's first op
            for q in range(c.copy.issue, bw_off[c.invocation]):
                act[q] += c.nbytes
        elif c.deferred and (c.invocation, c.transfer) not in held_anyway:
            # The own curve holds it to its release (the forward's end, or where the step's last run releases
            # it); then until it lands (a kept source: counted above).
            q = c.held_from
            while q < c.copy.wait and run.starts[q] < finish:
                act[q] += c.nbytes
                q += 1
    partitions = sum(r.plan.partition_seconds for r in invocations)  # PyTorch's pairs' own recomputations
    return StepSimulation(
        invocations=len(graphs),
        step_time=run.step_time,
        compute_time=sum(base_times) - partitions,
        partition_time=partitions,
        backward_start=run.starts[first_backward],
        activation_peak=max(act, default=0),
        activation_peak_before=max(base, default=0),
        activations=tuple(zip(run.starts[:-1], act)),
        baseline_activations=tuple(zip(op_starts(base_times), base)),
        stall=sum(run.stalls),
        crossing=sum(1 for c in issued if c.rank == 2 or (c.deferred and not c.within)),
        ops=tuple(zip(run.starts[:-1], times)),
        copies=tuple(
            SimulatedCopy(f"run {c.invocation}", "forward" if c.rank == 0 else "backward", c.copy.engine,
                          end - c.copy.seconds, end, at, stall)
            for c, end, at, stall in zip(issued, run.finishes, run.waited_at, run.stalls)),
        boundaries=tuple(sorted(run.starts[q] for q in (*fw_off, *bw_off))),
        host_bytes=sum(r.plan.host_bytes for r in invocations),
        pinned_host_bytes=sum(r.plan.pinned_host_bytes for r in invocations),
        host_wait=run.host_wait,
    )


def simulate_runs(record: Any, profile: DeviceProfile | None = None) -> StepSimulation | None:
    """The step of ``record``'s graph alone, run as many times as its plan counts (``Plan.runs``): its runs
    differ (copies cross from one run to the next, releases deferred before the last run stall only in
    the last), so this, per run, is its prediction rather than the graph replayed once. None for a graph
    that runs once, or whose forwards run between the step's backwards (``Plan.interleaved``: a pipeline's
    order, which this replay does not follow)."""
    plan = record.plan
    if plan.runs < 2 or plan.interleaved:
        return None
    return simulate_step([record] * plan.runs, profile)


def _offsets(graphs: Sequence[_Graph]) -> tuple[list[int], list[int], int]:
    """Global position of each invocation's forward and backward: forwards in order, then
    backwards last invocation first; and the step's length."""
    fw_off, at = [], 0
    for g in graphs:
        fw_off.append(at)
        at += g.forward
    bw_off = [0] * len(graphs)
    for j in range(len(graphs) - 1, -1, -1):
        bw_off[j] = at
        at += len(graphs[j].times) - graphs[j].forward
    return fw_off, bw_off, at


def _step_times(graphs, fw_off, bw_off, length) -> tuple[list[float], list[float]]:
    times, base_times = [0.0] * length, [0.0] * length
    for j, g in enumerate(graphs):
        f, b = fw_off[j], bw_off[j]
        times[f:f + g.forward], base_times[f:f + g.forward] = g.times[:g.forward], g.base_times[:g.forward]
        end = b + len(g.times) - g.forward
        times[b:end], base_times[b:end] = g.times[g.forward:], g.base_times[g.forward:]
    return times, base_times


@dataclass(frozen=True)
class _KeptLast:
    """A source a graph's last run of the step keeps for its backward, in step positions."""

    invocation: int
    transfer: int  # index into the invocation's Plan.transfers
    nbytes: int
    release: int  # where the forward releases it (the own curve counts it before)
    claim: int  # its prefetch in the backward: the device copy made there replaces it (the own curve's)


def _last_runs(graphs) -> dict[int, int]:
    """Each graph's last run of the step, by the graph's id (runs of one graph share its ``_Graph``)."""
    return {id(g): j for j, g in enumerate(graphs)}


def _kept_in_last_runs(graphs, fw_off, bw_off) -> list[_KeptLast]:
    last_run = _last_runs(graphs)
    return [_KeptLast(j, m.transfer, m.nbytes, fw_off[j] + m.release, bw_off[j] + m.prefetch - g.forward)
            for j, g in enumerate(graphs) if last_run[id(g)] == j for m in g.transfers if m.transfer in g.kept]


def _copies(graphs, fw_off, bw_off, first_backward, profile, kept: set[tuple[int, int]]) -> list[_Issued]:
    """Every copy of the step, in issue order (at one position: offloads, own prefetches, then
    copies started ahead, as the rewritten graphs issue them); ``kept``: (invocation, transfer) pairs that
    copy nothing back (their source was kept)."""
    engines = ("d2h", "h2d") if profile.duplex else ("link", "link")

    def bw(j: int, p: int) -> int:
        return bw_off[j] + p - graphs[j].forward

    ahead = {}  # (invocation, transfer position) -> where the backward before it starts the copy
    for j in range(len(graphs) - 1):
        later = graphs[j + 1]
        if later.ahead_at is not None:
            for i in _ahead_of(graphs[j], later.ahead_bytes):
                ahead[(j, i)] = bw(j + 1, later.ahead_at)
    issued = []
    last_run = _last_runs(graphs)
    for j, g in enumerate(graphs):
        # A deferred copy is completed when the forward after next begins, or the first backward.
        deadline = fw_off[j + 2] if j + 2 < len(graphs) else first_backward
        for m in sorted(g.transfers, key=lambda m: m.offload):
            early = m.before_last and last_run[id(g)] != j  # completed at its own forward's end
            deferred = m.deferred or early
            release = fw_off[j] + g.forward if early else deadline if deferred else fw_off[j] + m.release
            held_from = fw_off[j] + (m.release if early else g.forward)
            issued.append(_Issued(Copy(fw_off[j] + m.offload, release, m.d2h, engines[0]), 0, j, m.nbytes, deferred,
                                  m.transfer, held_from, early))
        for i, m in enumerate(g.transfers):
            if (j, m.transfer) in kept:
                continue
            start = ahead.get((j, i), bw(j, m.prefetch))
            rank = 2 if (j, i) in ahead else 1
            issued.append(_Issued(Copy(start, bw(j, m.wait), m.h2d, engines[1]), rank, j, m.nbytes))
    issued.sort(key=lambda c: (c.copy.issue, c.rank))
    return issued


def _add_caller_kept(act: list[int], base: list[int], graphs, kept: Sequence[Sequence[KeptSource]], fw_off,
                     bw_off) -> None:
    """Count, in place, each source its caller still held when the backward began (see :func:`simulate_step`)."""
    if len(kept) != len(graphs):
        raise ValueError(f"simulate_step: caller_kept has {len(kept)} entries for {len(graphs)} invocations")
    for j, g in enumerate(graphs):
        moves = {m.transfer: m for m in g.transfers}
        for move in (moves[source.transfer] for source in kept[j] if source.into_backward):
            for q in range(fw_off[j] + move.release, len(act)):
                act[q] += move.nbytes
            last_use = fw_off[j] + move.death if move.death < g.forward else bw_off[j] + move.death - g.forward
            for q in range(last_use + 1, len(base)):
                base[q] += move.nbytes


def _activations(graphs, fw_off, bw_off, length) -> tuple[list[int], list[int]]:
    """Saved activations per position, under the plans and without offloading: each invocation's
    own curve plus what the invocations before it hold for their backward."""
    act, base = [0] * length, [0] * length
    held = base_held = 0
    for j, g in enumerate(graphs):
        for p in range(g.forward):
            act[fw_off[j] + p], base[fw_off[j] + p] = g.own[p] + held, g.base[p] + base_held
        held, base_held = held + g.held, base_held + g.base_held
    for j in range(len(graphs) - 1, -1, -1):
        g = graphs[j]
        held, base_held = held - g.held, base_held - g.base_held
        for p in range(g.forward, len(g.times)):
            q = bw_off[j] + p - g.forward
            act[q], base[q] = g.own[p] + held, g.base[p] + base_held
    return act, base
