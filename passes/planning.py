"""Planning: decide, for every saved activation, whether to keep, offload or recompute it.

Inputs: the saved activations, the ``Timeline``, each candidate's moves and costs
(``fxoffload.passes.candidates``), ``PlanOptions`` and the user's marks (``fxoffload.passes.policies``).
Outputs: a ``Plan``, an immutable value: one ``Decision`` per saved activation with its reason,
the transfers and recompute chains, the predicted peaks.

Algorithm. Saved tensors are grouped by the storage they live in (their
*base*, see ``fxoffload.passes.analysis``): a view is never moved on its own; its base
is offloaded (or recomputed) once and the view is rebuilt on the device after
it. :func:`why_kept` says why a group must stay (one rule per early return);
the rest are candidates. Graph inputs stay, but for those an earlier compiled
graph of the step made (``Timeline.input_activations``: the input of a layer
compiled on its own, all a checkpointed layer saves), which are candidates for
offloading like the graph's own activations (never recomputed: no chain makes them).

* Options per candidate (``strategy``): *offload* (device copy until its
  release, prefetched copy from its prefetch to its last use, at the positions
  the scheduler would give it) and *recompute* (freed at its last forward use;
  its chain of forward ops, found by ``fxoffload.passes.analysis.recompute_chain`` from
  saved values and graph inputs, runs again right before its first backward
  consumer, and the storage lives from there to its last use). A recomputed
  storage counts as activation memory from its rebuild on, like a prefetched
  copy; the chain's other outputs count towards the total only, and so do
  a staged offload's buffers (``PlanOptions.staging_devices``: the CUDA engine
  copies a non-contiguous tensor through a contiguous device buffer at each
  end, :func:`staging_bytes`), which a device budget prices.
* Without a budget, the budget is the smallest activation peak that acting
  on every candidate reaches (offloading it; under ``"recompute"``,
  recomputing every recomputable one), plus ``min_bytes``: the cheapest
  choice within a storage worth a copy of that peak. A tensor whose move
  cannot lower the peak (logits read as the backward starts) stays.
  ``all_eligible`` acts on every candidate instead, as naive offloading does
  (PREFER_SAVE ones stay).
* With a budget (bytes, or a fraction of the activation peak without
  offloading), the activation curve of ``fxoffload.passes.memory`` and each option's
  saving are handed to ``fxoffload.passes.solvers`` as plain intervals. The objective is
  predicted step time: a recomputation costs its chain's compute time (from
  ``fxoffload.passes.cost_model``); copies are work on the copy engines, priced by the
  solvers' queue lateness under horizon ``"auto"`` (where prefetches may start
  anywhere in the backward), else by the stall each copy alone would cause;
  plus a small weight on all copy time so that no copy is made for nothing.
  A transfer's op calls are work on one more queue, the host thread (half at
  its offload, half at its consumer, each due when the device gets there):
  they cost only where the host would fall behind the device, and the queue
  is left out where it cannot, even with every candidate offloaded.
  A recomputation reads saved values: those may not be recomputed too, nor
  offloaded unless they are waited for before it (conflicts for the solver).
* Selective-checkpoint marks (``fxoffload.passes.policies``): ``MUST_SAVE`` keeps a
  storage; ``MUST_CPU_OFFLOAD`` offloads it whatever the budget and
  ``min_bytes`` (its offloaded intervals are fixed memory for the solver);
  ``PREFER_CPU_OFFLOAD`` makes its offload cost nothing and its
  recomputation, like any option of a ``PREFER_SAVE`` one, dearer than any
  unmarked option, so the budget takes them first and last.
  Every reason names the mark it honours or overrides.
* Under symbolic sizes, a fractional budget is held at the plan's size and at
  the other sizes of ``fxoffload.passes.memory.held_sizes`` (the other end of the range
  the graph serves), each against the fraction of its own unoffloaded peak:
  the solver gets one timeline per size laid end to end, each size's fixed
  memory raised by the plan's budget less its own, so that one budget bounds
  them all (:func:`_stacked`). The plan records each size's budget and peaks
  (``Plan.sizes``); the scheduler keeps them too.
* A host budget (``PlanOptions.host_bytes``) bounds the pinned host bytes of
  the copies over the step's runs (each copy in its power-of-two block,
  :func:`pinned_block`): a knapsack row for the solvers, first fit in birth
  order under ``all_eligible``; without a memory budget, the smallest peak
  within it is greedy's lowest, found by bisection on the budget
  (:func:`_reachable`). MUST_CPU_OFFLOAD copies count first; a kept
  candidate that did not fit says so.
* If no choice meets the budget, ``on_infeasible`` decides: ``"error"``
  raises :class:`BudgetInfeasibleError` with the smallest achievable peak;
  ``"warn"`` plans the cheapest choice at that smallest peak and says so.

The result is an immutable :class:`Plan`; nothing here edits a graph.
Limits: queue lateness lets a prefetch start wherever compute allows,
ignoring the memory it then holds (the schedule's stall is the prediction);
chains with random ops are not recomputed (their generator state is not
saved); symbolic sizes are evaluated at the largest size the guards allow, or
the traced one (``fxoffload.passes.memory.concrete``), and offloaded when the backward can
compute them (:func:`backward_symbols`), never recomputed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence, get_args

import torch
import torch.fx as fx

from fxoffload.passes.analysis import (
    SavedActivation, SavedInterface, input_position, is_compute, is_rng_state, output_storages, storage_key,
    sym_exprs, symbol_sources, unbuildable,
)
from fxoffload.passes.candidates import RecomputeCost, TransferCost
from fxoffload.passes.memory import (
    Resident, Timeline, concrete, curve, held_sizes, intervals, peak, residents_at, staging_intervals, timeline_at,
)
from fxoffload.passes.policies import MUST_CPU_OFFLOAD, MUST_SAVE, PREFER_CPU_OFFLOAD, PREFER_SAVE
from fxoffload.passes.solvers import NODE_LIMIT, TIME_GUARD, Option, Queue, SolverName, curve_with, host_of, solve

__all__ = [
    "ADVICE_WARN", "Budget", "BudgetInfeasibleError", "BudgetInfeasibleWarning", "Decision", "Plan", "PlanOptions",
    "ON_INFEASIBLE", "OnInfeasible", "Recompute", "SizeBudget", "STRATEGIES", "Strategy", "Transfer", "group_by_base",
    "over_runs", "pinned_block", "plan_offloads", "recompute_moves", "recompute_temporaries", "staging_bytes",
    "step_peak", "Why", "why_kept",
]

OFFLOAD = "offload"
RECOMPUTE = "recompute"
KEEP = "keep"
AUTO_STRATEGY = "auto"  # keep, offload or recompute, per tensor (a horizon's "auto" is candidates.AUTO_HORIZON)
Strategy = Literal["auto", "offload", "recompute"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
OnInfeasible = Literal["error", "warn"]
ON_INFEASIBLE: tuple[str, ...] = get_args(OnInfeasible)
COPY_WEIGHT = 1e-3  # weight of hidden copy time next to stall time in the objective
PREFER_SAVE_PENALTY = 10.0  # a PREFER_SAVE candidate costs this many times the costliest other one more


ADVICE_WARN = "pass on_infeasible='warn'"


class BudgetInfeasibleError(ValueError):
    """The memory budget cannot be met even by offloading every eligible activation.

    ``reason``: what cannot be met, with its numbers; ``smallest``: the smallest achievable peak
    (bytes, of what the budget bounds); ``budget``: the bytes it bounds it to; ``advice``: what the
    caller may change, each a phrase (``ADVICE_WARN`` among them where it applies)."""

    def __init__(self, reason: str, smallest: int, budget: int, advice: Sequence[str] = ()) -> None:
        self.reason, self.smallest, self.budget, self.advice = reason, smallest, budget, tuple(advice)
        super().__init__(self.explained(self.advice))

    def explained(self, advice: Sequence[str]) -> str:
        """The reason, then ``advice`` as "; a, b, or c"."""
        if not advice:
            return self.reason
        listed = advice[0] if len(advice) == 1 else ", ".join(advice[:-1]) + ", or " + advice[-1]
        return f"{self.reason}; {listed}"

    def within(self, context: str) -> "BudgetInfeasibleError":
        """The same error, its reason prefixed by where it arose."""
        return BudgetInfeasibleError(f"{context}{self.reason}", self.smallest, self.budget, self.advice)


class BudgetInfeasibleWarning(UserWarning):
    """``on_infeasible="warn"``: the budget cannot be met; the plan is for the smallest achievable peak."""


@dataclass(frozen=True)
class Budget:
    """A bound on the activation peak: a fraction of the unoffloaded peak, or bytes.

    ``at_sizes``: under symbolic sizes, bytes at other sizes the plan must hold too ((symbol, size)
    pairs, bytes): strategy auto holds its alternatives to the first plan's budget at each size.
    """

    fraction: float | None = None
    nbytes: int | None = None
    at_sizes: tuple[tuple[tuple[tuple[Any, int], ...], int], ...] = ()

    def resolve(self, unoffloaded_peak: int) -> int:
        return self.nbytes if self.nbytes is not None else int(self.fraction * unoffloaded_peak)

    def __str__(self) -> str:
        return f"{self.fraction:g} of the activation peak" if self.nbytes is None else f"{self.nbytes} B"


@dataclass(frozen=True)
class PlanOptions:
    min_bytes: int = 0
    budget: Budget | None = None
    solver: SolverName = "auto"
    on_infeasible: OnInfeasible = "error"
    time_limit: float = TIME_GUARD  # seconds per program: a guard (see fxoffload.passes.solvers)
    node_limit: int = NODE_LIMIT  # branch-and-bound nodes per program: the deterministic bound
    strategy: Strategy = "auto"
    # A total peak (every tensor of the step, bytes) the copies' placement may not raise the total
    # above, when lower than the pair's own unoffloaded total: plain compile's, when the user's
    # CPU-offload marks made the partitioner save more than plain compile does.
    total_cap: int | None = None
    # Copies may cross the graph's boundaries (``fxoffload.passes.scheduling``): deferred releases at the
    # forward's end, and copies started ahead by the backward that runs before this one.
    cross_graphs: bool = True
    # How many times the graph runs in one training step (one compiled graph serving that many
    # layers). Above 1, the budget bounds the step: this graph's activation curve plus the bytes
    # every earlier run still holds for its backward, and a fraction is of the step's peak.
    runs: int = 1
    # A bound on the device peak instead of ``budget``: bytes for the graph's inputs and every
    # tensor the step creates (``device_budget`` less ``reserved``).
    device_bytes: int | None = None
    # Without a budget: act on every candidate, whether or not that lowers the peak (the naive
    # baseline), instead of the cheapest choice that reaches the smallest peak.
    all_eligible: bool = False
    # A bound on the host memory of the graph's copies over its runs, in CUDA's pinned blocks
    # (:func:`pinned_block`): what does not fit is kept or recomputed. None: unbounded.
    host_bytes: int | None = None
    # Device types whose copy engine stages a non-contiguous tensor through a contiguous device
    # buffer (the CUDA engine, ``fxoffload.runtime``): each such transfer holds one more block of its
    # size on the device from its offload to its release and from its prefetch to its wait
    # (:func:`staging_bytes`).
    staging_devices: frozenset[str] = frozenset()
    # A bound on what the graph's runs leave on the device for their backward (the activation curve at
    # the forward's end, over ``runs`` runs), below ``budget``: the later regions of a step run on top
    # of it (``fxoffload.passes.shares``). None: only the budget bounds it.
    held_cap: int | None = None
    # Whether the graph's user outputs count as activations until its forward returns (and the
    # activations it is handed do not): None, under a fraction for one run
    # (``fxoffload.passes.pipeline.counts_outputs``); set for a share of a step's fraction, planned in bytes.
    count_outputs: bool | None = None
    # Positions, among the compiled function's inputs, of activations handed in that the caller was seen
    # to keep after the graph returned (``fxoffload.callers``): counted, never moved (a copy frees nothing).
    kept_inputs: frozenset[int] = frozenset()


class Why(enum.Enum):
    """Why a decision is what it is, as data: code branches on this, never on ``Decision.reason``'s
    wording (which is for people)."""

    INELIGIBLE = "kept: it cannot move"  # too small, a user output, a graph input, a symbolic size, ...
    NOT_NEEDED = "kept: the goal holds without moving it"
    PREFER_SAVE = "kept: the user's PREFER_SAVE mark"
    HOST_BUDGET = "kept: its copy does not fit host_budget"
    OFFLOADED = "offloaded"
    RECOMPUTED = "recomputed"


@dataclass(frozen=True)
class Decision:
    """What happens to one saved activation, and why (``why``: as data; ``reason``: in words)."""

    index: int
    name: str
    shape: tuple[Any, ...]
    dtype: torch.dtype
    nbytes: Any  # int, or a sympy expression when sizes are symbolic
    action: str  # "offload", "recompute" or "keep"
    reason: str
    transfer: int | None  # index into Plan.transfers when offloaded
    recompute: int | None = None  # index into Plan.recomputes when recomputed
    why: Why = Why.INELIGIBLE


@dataclass(frozen=True)
class Transfer:
    """One storage copied to the host and back; its members are rebuilt from it."""

    base: fx.Node
    nbytes: int
    members: tuple[int, ...]  # indices of the saved activations that live in this storage
    lifetime: int  # its index in Timeline.lifetimes, fixed at plan time (the inner compiler may change the nodes)
    cost: TransferCost | None = None
    staging: int = 0  # bytes of the contiguous device buffer each of its copies goes through (staging_devices)

    @property
    def base_name(self) -> str:
        return self.base.name


@dataclass(frozen=True)
class Recompute:
    """One storage rebuilt in the backward from saved values instead of being saved."""

    base: fx.Node
    nbytes: int
    members: tuple[int, ...]  # indices of the saved activations that live in this storage
    lifetime: int  # its index in Timeline.lifetimes
    release: int  # timeline position of its last forward use (it is freed there)
    at: int  # timeline position it is rebuilt before
    cost: RecomputeCost

    @property
    def base_name(self) -> str:
        return self.base.name


@dataclass(frozen=True)
class SizeBudget:
    """The budget at one more size a plan of symbolic sizes holds it at, and the step's predicted
    activation peaks there (bytes)."""

    values: tuple[tuple[Any, int], ...]  # (symbol, size) pairs
    budget_bytes: int
    step_peak_before: int
    step_peak_after: int

    @property
    def label(self) -> str:
        return ", ".join(f"{symbol}={value}" for symbol, value in self.values)


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]
    transfers: tuple[Transfer, ...]
    min_bytes: int
    recomputes: tuple[Recompute, ...] = ()
    strategy: Strategy = "offload"
    partition: str = "min-cut"  # the partition planned: PyTorch's min-cut, or its recompute-only one at a budget
    budget: str = "none"  # as the user gave it
    budget_bytes: int | None = None
    activation_peak_before: int = 0  # predicted, bytes
    activation_peak_after: int = 0
    total_peak_before: int = 0
    total_peak_after: int = 0
    total_cap: int | None = None  # PlanOptions.total_cap
    runs: int = 1  # PlanOptions.runs: the graph's runs per step
    # The step's activation peak over ``runs`` runs (each run's curve on top of what the earlier
    # ones hold for their backward); equal to the activation peaks for one run. The budget bounds it.
    step_peak_before: int = 0
    step_peak_after: int = 0
    # Under a device budget (PlanOptions.device_bytes): the graph's input bytes, the budget, and the
    # predicted device peak: inputs plus the step's total peak (over ``runs`` runs).
    input_bytes: int = 0
    device_bytes: int | None = None
    device_peak_before: int = 0
    device_peak_after: int = 0
    solver: str = "none"
    optimal: bool = True
    gap: float = 0.0
    feasible: bool = True
    note: str = ""
    shortfall: tuple[int, int] | None = None  # when infeasible: (smallest achievable peak, budget), bytes
    # Under symbolic sizes and a fractional budget: the other sizes the plan holds the fraction at
    # (``fxoffload.passes.memory.held_sizes``), each with its budget and the predicted peaks there.
    sizes: tuple[SizeBudget, ...] = ()
    host_budget_bytes: int | None = None  # PlanOptions.host_bytes: the pinned host bytes the plan may take over its runs
    held_cap: int | None = None  # PlanOptions.held_cap
    # Predicted: what the runs leave for the backward (the activation curve at the forward's end, over the runs).
    held_before: int = 0
    held_after: int = 0

    @property
    def offloaded_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.transfers)

    @property
    def host_bytes(self) -> int:
        """Host memory one run holds when its forward ends: every host copy is alive then (a copy is
        dropped only once its prefetch has landed, in the backward)."""
        return self.offloaded_bytes

    @property
    def pinned_host_bytes(self) -> int:
        """The same in the pinned blocks PyTorch's caching host allocator hands out (:func:`pinned_block`),
        which it keeps for later steps."""
        return sum(pinned_block(int(t.nbytes)) for t in self.transfers)

    @property
    def recomputed_bytes(self) -> int:
        return sum(int(r.nbytes) for r in self.recomputes)

    @property
    def recompute_seconds(self) -> float:
        """Predicted compute time the recomputations add to the backward."""
        return sum(r.cost.seconds for r in self.recomputes)

    def recompute_moves(self) -> dict[int, tuple[int, int]]:
        return recompute_moves(self.recomputes)

    def recompute_temporaries(self) -> list[tuple[int, int, int]]:
        return recompute_temporaries(self.recomputes)

    @property
    def estimated_stall(self) -> float:
        """The planner's estimate (each copy alone on its link); ``Schedule.predicted_stall`` is the prediction."""
        return sum(t.cost.stall for t in self.transfers if t.cost is not None)


def staging_bytes(base: fx.Node, options: PlanOptions) -> int:
    """Bytes of the contiguous device buffer an engine that stages copies (its device type in
    ``options.staging_devices``) puts a non-contiguous base through, at the size the plan is made
    for; 0 for a contiguous base.
    A transposed, channels-last or padded source is made contiguous before its copy, and a strided
    destination lands in a contiguous buffer first: ``numel`` elements, whatever the storage's size."""
    val = base.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type not in options.staging_devices or val.is_contiguous():
        return 0
    return concrete(val.numel() * val.element_size(), val)


def recompute_moves(recomputes: Sequence[Recompute]) -> dict[int, tuple[int, int]]:
    """Lifetime index -> (release, rebuild) positions: recomputed storages' device intervals."""
    return {r.lifetime: (r.release, r.at) for r in recomputes}


def recompute_temporaries(recomputes: Sequence[Recompute]) -> list[tuple[int, int, int]]:
    """Device intervals of the recompute chains' other outputs (not activations)."""
    return [(r.at, r.at, r.cost.transient) for r in recomputes if r.cost.transient]


def group_by_base(activations: Sequence[SavedActivation]) -> dict[fx.Node, list[SavedActivation]]:
    groups: dict[fx.Node, list[SavedActivation]] = {}
    for act in activations:
        groups.setdefault(act.base, []).append(act)
    return groups


def replayable(act: SavedActivation) -> bool:
    previous = act.base
    for node in act.view_chain:
        if node.all_input_nodes != [previous]:
            return False
        previous = node
    return True


# What an offloaded input activation's reason starts with.
INPUT_ACTIVATION = "layer input (made by an earlier part of the step)"


def why_kept(
    group: Sequence[SavedActivation], user_storages: frozenset[int], min_bytes: int,
    marks: frozenset[str] = frozenset(), symbols: frozenset = frozenset(),
    input_activations: frozenset[fx.Node] = frozenset(), caller_kept: frozenset[fx.Node] = frozenset(),
) -> str | None:
    """Why this storage group must stay on the device, or None if it may be offloaded.

    ``marks`` are the group's selective-checkpoint marks (``fxoffload.passes.policies``); ``symbols`` the
    size symbols the backward finds in inputs it keeps whatever the plan (:func:`backward_symbols`);
    ``input_activations``: graph inputs that an earlier graph of the step made (``Timeline.input_activations``),
    candidates like the graph's own activations, but for ``caller_kept`` (inputs their caller keeps).
    Other inputs exist before the step and stay.
    """
    base = group[0].base
    val = base.meta.get("val")
    if base.op == "placeholder" and base not in input_activations:
        return "graph input (parameter or user input), or a view of one"
    if base in caller_kept:
        return "layer input its caller keeps after the graph returns (seen at run time): a copy would free nothing"
    if MUST_SAVE in marks:
        return "selective checkpoint policy MUST_SAVE"
    if not isinstance(val, torch.Tensor):
        return "base is not a single tensor"
    if any(is_rng_state(a.fw_node) for a in group):
        return "random-number generator state for a recomputed random op"
    if storage_key(base) in user_storages:
        return "shares storage with a model output"
    if val.device.type not in ("cpu", "cuda"):
        return f"on device {val.device.type!r}; supported: cpu, cuda"
    symbolic = not isinstance(group[0].base_nbytes, int)
    if symbolic and (missing := _unbuildable_sizes(group, symbols)):
        return f"symbolic size the backward cannot compute: {'; '.join(missing)}"
    nbytes = concrete(group[0].base_nbytes, val)  # at the size the plan is made for
    if nbytes == 0:
        return "empty tensor"
    if any(a.fw_node.meta.get("saved_tensor_with_no_vc_check", False) for a in group):
        return "stashed on ctx without save_for_backward"
    if not symbolic and not all(replayable(a) for a in group):  # symbolic views are rebuilt by as_strided
        return "view chain takes other graph values as arguments; cannot rebuild it after prefetch"
    if not any(a.bw_node.users for a in group):
        return "not used by the backward graph"
    if nbytes < min_bytes and MUST_CPU_OFFLOAD not in marks:  # the user asked for this one
        return f"{nbytes} B < min_bytes={min_bytes}"
    return None


def _unbuildable_sizes(group: Sequence[SavedActivation], symbols: frozenset) -> list[str]:
    """What the backward could not compute of a symbolic group's sizes: the base's size and stride
    (for its prefetch) and each member's size, stride and offset (rebuilt from the prefetched base).
    The base's own dimensions are found on its host buffer."""
    base = group[0].base.meta["val"]
    exprs = sym_exprs(base) + [e for a in group for e in sym_exprs(a.val, offset=True)]
    own = {e for e in sym_exprs(base)[:base.dim()] if not isinstance(e, int) and e.is_Symbol}
    return unbuildable(exprs, symbols | own)


def backward_symbols(interface: SavedInterface, groups: Mapping[fx.Node, Sequence[SavedActivation]],
                     input_activations: frozenset[fx.Node] = frozenset()) -> frozenset:
    """Size symbols the backward finds in inputs no plan removes: symints, tangents, and saved graph
    inputs other than ``input_activations`` (never offloaded). A saved activation's input may be
    replaced by a host buffer."""
    if not interface.bw_saved:
        return frozenset()
    movable = {a.bw_node for base, g in groups.items() if base.op != "placeholder" or base in input_activations
               for a in g}
    inputs = [n for n in interface.bw_saved[0].graph.find_nodes(op="placeholder") if n not in movable]
    return frozenset(symbol_sources(inputs))


def _group_marks(group: Sequence[SavedActivation], policies: Mapping[str, str]) -> frozenset[str]:
    """The selective-checkpoint marks on a storage's base and on the aliases saved from it."""
    names = [group[0].base.name] + [n.name for a in group for n in a.view_chain]
    return frozenset(policies[n] for n in names if n in policies)


_EVERY_ELIGIBLE = "offloaded (all_eligible, >= min_bytes)"
_VIEW_WORDING = {_EVERY_ELIGIBLE: "offloaded through its base",
                 "chosen to meet the budget": "base chosen to meet the budget",
                 "chosen to reach the smallest peak": "base chosen to reach the smallest peak"}


def _offload_reason(act: SavedActivation, why: str) -> str:
    if not act.view_chain:
        return why
    return f"view of {act.base.name}; {_VIEW_WORDING.get(why, f'base offloaded ({why})')}, rebuilt after prefetch"


@dataclass(frozen=True)
class _Choice:
    offloaded: tuple[fx.Node, ...]
    recomputed: tuple[fx.Node, ...] = ()
    solver: str = "none"
    optimal: bool = True
    gap: float = 0.0
    feasible: bool = True
    note: str = ""
    shortfall: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Problem:
    """What the planner knows about the candidates, in timeline positions."""

    timeline: Timeline
    moves: Mapping[fx.Node, tuple[int, int]]  # offloaded: (release, prefetch)
    costs: Mapping[fx.Node, TransferCost]
    recomputes: Mapping[fx.Node, RecomputeCost]  # the recomputable candidates
    first_use: Mapping[fx.Node, int]  # first backward consumer of each group
    marks: Mapping[fx.Node, frozenset[str]]
    options: PlanOptions
    queued: bool  # model the copy engines as queues (prefetches placed freely, horizon "auto")
    kept: Mapping[int, str] = dataclasses.field(default_factory=dict)  # lifetime index -> why it cannot move

    def lifetime(self, base: fx.Node):
        return self.timeline.forward_lifetime(base)

    def host(self, base: fx.Node) -> int:
        """Pinned host bytes offloading ``base`` takes over the step's runs."""
        return pinned_block(self.lifetime(base).nbytes) * self.options.runs

    def host_left(self, forced: Sequence[fx.Node]) -> int | None:
        """Pinned host bytes the free candidates may take: the host budget less the forced copies'."""
        cap = self.options.host_bytes
        return None if cap is None else max(cap - sum(self.host(b) for b in forced), 0)

    def rebuilt_at(self, base: fx.Node) -> int:
        return self.timeline.positions[self.recomputes[base].consumer]

    def moved(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> dict[int, tuple[int, int]]:
        out = {self.lifetime(b).index: self.moves[b] for b in offloaded}
        out.update({self.lifetime(b).index: (self.moves[b][0], self.rebuilt_at(b)) for b in recomputed})
        return out

    def peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node], residual_only: bool) -> int:
        return peak(self.curve(offloaded, recomputed, residual_only))

    def curve(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node], residual_only: bool) -> list[int]:
        temporaries = [(self.rebuilt_at(b), self.rebuilt_at(b), self.recomputes[b].transient) for b in recomputed]
        spans = intervals(self.timeline, self.moved(offloaded, recomputed), residual_only, temporaries)
        return curve(self.timeline.length, spans)

    @property
    def device(self) -> bool:
        """Whether the budget bounds the device peak (every tensor) rather than saved activations."""
        return self.options.device_bytes is not None

    def device_peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """The step's total peak over its runs (each run on top of what earlier runs hold), inputs excluded."""
        held = self.curve(offloaded, recomputed, True)[len(self.timeline.fw_nodes) - 1]
        return peak(self.curve(offloaded, recomputed, False)) + (self.options.runs - 1) * held

    def held(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """What the step's ``runs`` runs leave on the device for their backward."""
        activations = self.curve(offloaded, recomputed, True)
        return self.options.runs * activations[len(self.timeline.fw_nodes) - 1] if activations else 0

    def bounded_peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """The peak the budget bounds: the device peak's step tensors, or the step's activation peak."""
        return self.device_peak(offloaded, recomputed) if self.device else self.step_peak(offloaded, recomputed)

    def step_peak(self, offloaded: Sequence[fx.Node], recomputed: Sequence[fx.Node]) -> int:
        """Activation peak of the step's ``runs`` runs: the last run's curve on top of what the
        earlier runs hold for their backward (the curve at the forward's end, each)."""
        activations = self.curve(offloaded, recomputed, True)
        return step_peak(activations, len(self.timeline.fw_nodes), self.options.runs)


def graph_input_bytes(timeline: Timeline) -> int:
    """Bytes of the forward graph's tensor inputs (parameters, buffers, batch): resident all step.
    Inputs that are an earlier graph's activations, saved here, have lifetimes instead."""
    from fxoffload.passes.analysis import tensor_nbytes
    from fxoffload.passes.memory import concrete

    held = set(timeline.input_activations)
    vals = [n.meta.get("val") for n in timeline.fw_nodes if n.op == "placeholder" and n not in held]
    return sum(concrete(tensor_nbytes(v), v) for v in vals if isinstance(v, torch.Tensor))


def step_peak(activations: Sequence[int], forward: int, runs: int) -> int:
    """The step's activation peak when a graph with this activation curve runs ``runs`` times."""
    if not activations:
        return 0
    return max(activations) + (runs - 1) * activations[forward - 1]


def over_runs(spans: Sequence[tuple[int, int, int]], forward: int, length: int,
              runs: int) -> list[tuple[int, int, int]]:
    """Intervals whose curve is the step's for ``runs`` runs: each interval alive at the forward's
    end (what a run leaves for its backward) also counts ``runs - 1`` times at every position."""
    if runs == 1:
        return list(spans)
    held = [(0, length - 1, (runs - 1) * b) for start, end, b in spans if start <= forward - 1 <= end]
    return list(spans) + held


def _saving(release: int, until: int, nbytes: int) -> tuple[tuple[int, int, int], ...]:
    return ((release + 1, until - 1, -nbytes),) if release + 1 <= until - 1 else ()


def _queues(problem: _Problem, offloadable: Sequence[fx.Node], forced: Sequence[fx.Node]):
    """Copy-engine slots of every offloadable base, and the engines' capacities net of forced copies.

    Offloads: slots from the forward's end backwards (latest born first), each with the compute
    after its birth. Prefetches: slots by consumer, each with the backward's compute before it.
    """
    costs, pos = problem.costs, problem.timeline.positions
    everything = list(offloadable) + list(forced)
    down = sorted(everything, key=lambda b: -pos[b])
    up = sorted(everything, key=lambda b: problem.first_use[b])
    slots = {b: (down.index(b), up.index(b)) for b in everything}
    capacity = []
    for order, window, seconds in ((down, "forward_window", "d2h"), (up, "backward_window", "h2d")):
        taken, caps = 0.0, []
        for b in order:
            taken += getattr(costs[b], seconds) if b in forced else 0.0
            caps.append(getattr(costs[b], window) - taken)
        capacity.append(Queue(tuple(caps)))
    return slots, capacity


def _host_queue(problem: _Problem, offloadable: Sequence[fx.Node], forced: Sequence[fx.Node]):
    """The host thread as one more queue: each transfer's op calls, half in the forward (at its offload)
    and half in the backward (at its consumer), must be issued before the device gets there, or the
    device waits. Slots by the device time they are needed at; capacity, that time less the forced
    transfers' calls up to it. None when op calls cost nothing, or are hidden whatever is chosen."""
    costs, everything, made = problem.costs, list(offloadable) + list(forced), set(forced)
    if not any(costs[b].host for b in everything):
        return {}, None
    calls = sorted((t, phase, k) for k, b in enumerate(everything)
                   for phase, t in enumerate((costs[b].issued_at, costs[b].needed_at)))
    slots: dict[tuple[fx.Node, int], int] = {}
    taken = every = late = 0.0
    caps = []
    for slot, (t, phase, k) in enumerate(calls):
        slots[everything[k], phase] = slot
        taken += costs[everything[k]].host / 2 if everything[k] in made else 0.0
        every += costs[everything[k]].host / 2
        caps.append(t - taken)
        late = max(late, every - t)
    # Hidden even with every candidate offloaded (a large model): no choice can make the host late,
    # and the queue would only slow the solver.
    return (slots, Queue(tuple(caps))) if late > 0 else ({}, None)


def _items(problem: _Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node]):
    """Solver items (offload listed first: it needs the least memory), their owners and conflicts."""
    strategy, costs, marks = problem.options.strategy, problem.costs, problem.marks
    offloadable = list(free) if strategy in (OFFLOAD, AUTO_STRATEGY) else []
    recomputable = [b for b in free if b in problem.recomputes] if strategy in (RECOMPUTE, AUTO_STRATEGY) else []
    slots, queues = _queues(problem, offloadable, forced) if problem.queued else ({}, [])
    host_slots, host_queue = _host_queue(problem, offloadable, forced)
    raw: dict[tuple[fx.Node, str], tuple[float, tuple]] = {}
    for b in offloadable:
        c = costs[b]
        stall = 0.0 if problem.queued else c.stall
        work = ((0, slots[b][0], c.d2h), (1, slots[b][1], c.h2d)) if problem.queued else ()
        if host_queue is not None:
            work += tuple((len(queues), host_slots[b, phase], c.host / 2) for phase in (0, 1))
        raw[b, OFFLOAD] = (stall + COPY_WEIGHT * (c.d2h + c.h2d), work)
    if host_queue is not None:
        queues = [*queues, host_queue]
    for b in recomputable:
        raw[b, RECOMPUTE] = (problem.recomputes[b].seconds, ())
    scale = max((cost + sum(w[2] for w in work) for cost, work in raw.values()), default=0.0) or 1e-6
    items, owners = [], []
    for b in free:
        kinds = [k for k in (OFFLOAD, RECOMPUTE) if (b, k) in raw]
        if not kinds:
            continue
        options = []
        for kind in kinds:
            cost, work = raw[b, kind]
            if kind == OFFLOAD and PREFER_CPU_OFFLOAD in marks[b]:
                cost = 0.0
            elif PREFER_SAVE in marks[b] or PREFER_CPU_OFFLOAD in marks[b]:  # recomputing overrides the hint
                cost += PREFER_SAVE_PENALTY * scale
            release, prefetch = problem.moves[b]
            until = prefetch if kind == OFFLOAD else problem.rebuilt_at(b)
            changes = _saving(release, until, problem.lifetime(b).nbytes)
            if kind == RECOMPUTE and problem.device and problem.recomputes[b].transient:
                at = problem.rebuilt_at(b)  # the chain's other outputs, alive while it runs
                changes += ((at, at, problem.recomputes[b].transient),)
            if kind == OFFLOAD and problem.device:  # a staging engine's contiguous buffers
                changes += tuple(_staging(problem, b))
            options.append(Option(changes, cost, work, problem.host(b) if kind == OFFLOAD else 0))
        items.append(tuple(options))
        owners.append((b, tuple(kinds)))
    return items, owners, queues, _conflicts(problem, owners)


def _staging(problem: _Problem, b: fx.Node) -> list[tuple[int, int, int]]:
    """The staging buffers of offloading ``b`` (:func:`staging_bytes`), at its candidate placement."""
    release, prefetch = problem.moves[b]
    return staging_intervals(problem.lifetime(b).birth, release, prefetch, problem.first_use[b],
                             staging_bytes(b, problem.options))


def _conflicts(problem: _Problem, owners) -> list:
    """A recomputation reads saved values: those may not be recomputed too, nor waited for after it."""
    where = {(b, kind): (i, o) for i, (b, kinds) in enumerate(owners) for o, kind in enumerate(kinds)}
    out = []
    for b, kinds in owners:
        if RECOMPUTE not in kinds:
            continue
        for g in problem.recomputes[b].read_bases:
            if (g, RECOMPUTE) in where and g is not b:
                out.append((where[b, RECOMPUTE], where[g, RECOMPUTE]))
            if (g, OFFLOAD) in where and problem.first_use[g] >= problem.rebuilt_at(b):
                out.append((where[b, RECOMPUTE], where[g, OFFLOAD]))
    return out


def _everything(items, conflicts) -> list[tuple[int, int]]:
    """Each item's first option that does not conflict with one already taken."""
    clash = {frozenset(c) for c in conflicts}
    taken: list[tuple[int, int]] = []
    for i, options in enumerate(items):
        for o in range(len(options)):
            if not any(frozenset(((i, o), t)) in clash for t in taken):
                taken.append((i, o))
                break
    return taken


_ALL = {OFFLOAD: "offloading every eligible activation", RECOMPUTE: "recomputing every recomputable activation",
        AUTO_STRATEGY: "offloading or recomputing every eligible activation"}


def _split(owners, chosen) -> tuple[tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    picked = [(owners[i][0], owners[i][1][o]) for i, o in chosen]
    return tuple(b for b, k in picked if k == OFFLOAD), tuple(b for b, k in picked if k == RECOMPUTE)


def _constraint(problem: _Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], items):
    """The solver's fixed intervals (``base``) and per-option changes, over the step's runs."""
    timeline, options = problem.timeline, problem.options
    planned = {problem.lifetime(b).index for b in (*free, *forced)}
    base = [(lt.birth, lt.death, lt.nbytes) for lt in timeline.lifetimes if lt.activation and lt.index not in planned]
    for b in forced:  # their offloaded intervals hold memory whatever is chosen
        lt, (release, prefetch) = problem.lifetime(b), problem.moves[b]
        base += [(lt.birth, release, lt.nbytes), (prefetch, lt.death, lt.nbytes)]
    base += [(problem.lifetime(b).birth, problem.lifetime(b).death, problem.lifetime(b).nbytes) for b in free]
    if options.runs > 1:  # bound the step: what the earlier runs hold is added at every position
        forward, length = len(timeline.fw_nodes), timeline.length
        base = over_runs(base, forward, length, options.runs)
        items = [tuple(dataclasses.replace(o, changes=tuple(over_runs(o.changes, forward, length, options.runs)))
                       for o in item) for item in items]
    # A device budget bounds every tensor the step creates, not only saved ones: also staged copies'
    # buffers (``PlanOptions.staging_devices``), at the candidates' placements.
    if problem.device:
        base += [(lt.birth, lt.death, lt.nbytes) for lt in timeline.lifetimes if not lt.activation]
        base += [interval for b in forced for interval in _staging(problem, b)]
    return base, items


def _stacked(length: int, parts) -> tuple[list, list]:
    """One solver problem for the same choice at several sizes (``parts``: fixed intervals, items and
    lift, one per size): part ``m``'s positions shift by ``m * length``, and its fixed intervals rise
    by its lift (the plan's budget less the part's own), so that one budget bounds every part."""
    base: list = []
    items: list | None = None
    for m, (part_base, part_items, lift) in enumerate(parts):
        offset = m * length

        def shift(spans):
            return tuple((a + offset, b + offset, n) for a, b, n in spans)

        base += shift(part_base)
        if lift:
            base.append((offset, offset + length - 1, lift))
        if items is None:
            items = [list(item) for item in part_items]
            continue
        for item, part_item in zip(items, part_items):
            item[:] = [dataclasses.replace(o, changes=o.changes + shift(p.changes)) for o, p in zip(item, part_item)]
    return base, [tuple(item) for item in items or ()]


def _choose(problem: _Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], budget: int,
            held: Sequence[tuple[dict, _Problem, int]] = ()) -> _Choice:
    """What to offload or recompute, on top of the ``forced`` offloads, so that the budget holds
    (at the plan's size, and at each of ``held``'s: sizes, the problem there, the budget there)."""
    options = problem.options
    items, owners, queues, conflicts = _items(problem, free, forced)
    parts = [(*_constraint(problem, free, forced, items), 0)]
    for _, at, limit in held:
        parts.append((*_constraint(at, free, forced, _items(at, free, forced)[0]), budget - limit))
    length = problem.timeline.length
    base, items = _stacked(length, parts)
    cap = options.held_cap
    if cap is not None and not problem.device and cap < budget:
        # The cap as the budget at one position: a fixed interval fills the difference at the forward's end.
        base.append((len(problem.timeline.fw_nodes) - 1, len(problem.timeline.fw_nodes) - 1, budget - cap))
    total = length * len(parts)
    host_left = problem.host_left(forced)
    result = solve(total, base, items, budget, queues, conflicts, solver=options.solver,
                   node_limit=options.node_limit, time_limit=options.time_limit, host_budget=host_left)
    if result.stopped == "time limit":
        warnings.warn(f"fxoffload: the exact solver stopped at solver_time_limit={options.time_limit:g} s before its "
                      f"node limit ({options.node_limit}): this plan depends on the machine's speed and load, and may "
                      "differ between runs and ranks; raise solver_time_limit or lower solver_node_limit", stacklevel=3)
    if result.feasible:
        offloaded, recomputed = _split(owners, result.chosen)
        return _Choice(tuple(forced) + offloaded, recomputed, result.solver, result.optimal, result.gap)
    everything = _reachable(problem, forced, total, base, items, queues, conflicts)
    if options.budget is None and not problem.device:
        # No budget (the smallest peak is the limit): a solver that misses it (greedy, under conflicts)
        # falls back on acting on every candidate, which reaches it by construction.
        offloaded, recomputed = _split(owners, everything)
        return _Choice(tuple(forced) + offloaded, recomputed, result.solver, False, math.nan)
    reached = curve_with(total, base, items, everything)
    smallest = int(reached.max(initial=0))
    worst = int(reached.argmax()) // length if total else 0  # the part (size) furthest over its budget
    runs = f" of the step ({options.runs} runs of this graph)" if options.runs > 1 else ""
    acting, smallest_words = _ALL[options.strategy], "smallest achievable"
    if host_left is not None and host_of(items, _everything(items, conflicts)) > host_left:
        acting = f"as far as host_budget's {options.host_bytes} B of pinned host memory allows"
        smallest_words = "lowest"  # greedy's, by bisection: the host bound makes it a knapsack
    if problem.device:
        inputs = options.device_bytes - budget
        message = (
            f"device_budget: the {smallest_words} device peak{runs} is {smallest + inputs} B "
            f"({(smallest + inputs) / 2**20:.1f} MiB: graph inputs {inputs} B + the step's tensors {smallest} B, "
            f"{acting}), {smallest - budget} B above the {options.device_bytes} B the budget "
            f"leaves after reserved"
        )
    else:
        given = "" if options.budget.nbytes is not None else f", {options.budget}"
        where, lift = "", parts[worst][2]
        if worst:
            where = f"at {', '.join(f'{s}={v}' for s, v in held[worst - 1][0].items())} (a size this graph serves), "
            given += " at that size"
        reach, limit = smallest - lift, budget - lift
        message = (
            f"memory_budget: {where}the {smallest_words} activation peak{runs} is {reach} B "
            f"({reach / 2**20:.1f} MiB, {acting}), above the budget of {limit} B "
            f"({limit / 2**20:.1f} MiB{given})"
        )
    shortfall = (smallest + inputs, options.device_bytes) if problem.device else (reach, limit)
    at = problem if not worst else held[worst - 1][1]  # the bytes at the size where the peak lies
    message += _floor(at, owners, forced, everything, int(reached.argmax()) % length if total else 0)
    if options.on_infeasible == "error":
        other = () if options.strategy == AUTO_STRATEGY else ("try strategy='auto'",)
        advice = ("raise the budget", "lower min_bytes", *other, ADVICE_WARN)
        raise BudgetInfeasibleError(message, *shortfall, advice)
    # The cheapest plan that reaches the smallest peak (not just "everything").
    lowest = solve(total, base, items, smallest, queues, conflicts, solver=options.solver,
                   node_limit=options.node_limit, time_limit=options.time_limit, host_budget=host_left)
    chosen = lowest.chosen if lowest.feasible else everything
    warnings.warn(BudgetInfeasibleWarning(message + "; planning for that peak instead"), stacklevel=2)
    offloaded, recomputed = _split(owners, chosen)
    return _Choice(tuple(forced) + offloaded, recomputed, lowest.solver, False, math.nan, False, message, shortfall)


FLOOR_NAMED = 4  # the largest tensors an infeasible budget's message names


def _kept_lifetimes(timeline: Timeline, reasons: Mapping[fx.Node, str | None]) -> dict[int, str]:
    """Why each saved storage that is not a candidate stays, by lifetime index (graph inputs have none)."""
    kept = {}
    for base, reason in reasons.items():
        try:
            index = timeline.forward_lifetime(base).index
        except KeyError:  # a graph input: not on the activation curve
            continue
        if reason is not None:
            kept[index] = reason
    return kept


def _floor(problem: _Problem, owners, forced: Sequence[fx.Node], chosen, position: int) -> str:
    """"; at <node>, that peak holds: ..." -- the largest activations on the device where the smallest
    achievable peak lies, each with why it is there: what sets the budget's floor."""
    offloaded, recomputed = _split(owners, chosen)
    moved = problem.moved((*forced, *offloaded), recomputed)
    residents = residents_at(problem.timeline, moved, position)
    if not residents:
        return ""
    timeline = problem.timeline
    phase = "forward" if position < len(timeline.fw_nodes) else "backward"
    named = ", ".join(f"{r.name} {r.nbytes} B ({_stays_why(problem, moved, r, position)})"
                      for r in residents[:FLOOR_NAMED])
    rest = residents[FLOOR_NAMED:]
    more = f", and {len(rest)} more ({sum(r.nbytes for r in rest)} B)" if rest else ""
    runs = problem.options.runs
    earlier = (f"; the {runs - 1} earlier runs each hold what they leave for their backward" if runs > 1 else "")
    # (A device peak also holds tensors that are not activations: only those are listed.)
    holds = "that peak's activations are" if problem.device else "that peak holds"
    return f"; at {phase} node {timeline.nodes[position].name}, {holds} {named}{more}{earlier}"


def _stays_why(problem: _Problem, moved: Mapping[int, tuple[int, int]], resident: Resident, position: int) -> str:
    """Why an activation is on the device at ``position`` when everything eligible is moved."""
    if (reason := problem.kept.get(resident.lifetime)) is not None:
        return reason
    lifetime = problem.timeline.lifetimes[resident.lifetime]
    if lifetime.handed_on and not lifetime.residual:
        return "an output the graph hands to the rest of the step"
    if resident.lifetime not in moved:
        return f"eligible, but strategy={problem.options.strategy!r} cannot move it"
    if position >= moved[resident.lifetime][1]:
        return "moved, and back on the device for its backward"
    if lifetime.name in {n.name for n in problem.timeline.input_activations}:
        return "an input an earlier graph made: on the device from the graph's start until its copy frees it"
    return "moved, but on the device until its copy frees it"


def _reachable(problem: _Problem, forced: Sequence[fx.Node], length: int, base, items, queues, conflicts):
    """A choice that reaches the smallest peak: each item's least-memory option (that does not conflict), or,
    where those copies would not fit the host budget, the lowest peak greedy meets within it, found by
    bisection on the budget to within 0.1% (not proven the lowest: the host bound makes it a knapsack)."""
    everything = _everything(items, conflicts)
    left = problem.host_left(forced)
    if left is None or host_of(items, everything) <= left:
        return everything
    best: list = []
    low = int(curve_with(length, base, items, everything).max(initial=0))
    high = int(curve_with(length, base, items, ()).max(initial=0))
    while high - low > max(1, high // 1000):
        middle = (low + high) // 2
        found = solve(length, base, items, middle, queues, conflicts, solver="greedy", host_budget=left)
        if found.feasible:
            high, best = found.peak, list(found.chosen)
        else:
            low = middle + 1
    return best


def _all_eligible(problem: _Problem, wanted: Sequence[fx.Node], forced: Sequence[fx.Node]) -> _Choice:
    """Offload (or, under strategy "recompute", recompute) every candidate in ``wanted``; under a host
    budget, those that fit it, in the order they are born."""
    if problem.options.strategy != RECOMPUTE:
        left = problem.host_left(forced)
        taken = []
        for b in sorted(wanted, key=lambda b: problem.lifetime(b).birth):
            if left is None or problem.host(b) <= left:
                taken.append(b)
                left = None if left is None else left - problem.host(b)
        return _Choice(tuple(forced) + tuple(taken))
    items, owners, _, conflicts = _items(problem, wanted, forced)
    return _Choice(tuple(forced), _split(owners, _everything(items, conflicts))[1])


def _smallest_peak(problem: _Problem, wanted: Sequence[fx.Node], forced: Sequence[fx.Node]) -> int:
    """The bounded activation peak with every candidate in ``wanted`` acted on (each item's first option)."""
    items, _, queues, conflicts = _items(problem, wanted, forced)
    base, spans = _constraint(problem, wanted, forced, items)
    length = problem.timeline.length
    chosen = _reachable(problem, forced, length, base, spans, queues, conflicts)
    return int(curve_with(length, base, spans, chosen).max(initial=0))


def _recomputable(
    timeline: Timeline, groups, recomputes: Mapping[fx.Node, RecomputeCost], candidates, forced, first_use,
) -> dict[fx.Node, RecomputeCost]:
    """The candidates whose chain reads only values alive where it runs (and not forced off the device then)."""
    base_of = {a.fw_node: a.base for g in groups.values() for a in g}
    pos = timeline.positions
    out = {}
    for b in candidates:
        cost = recomputes.get(b)
        if cost is None:
            continue
        at = pos[cost.consumer]
        # Graph inputs (and views of them) live through the step; anything else must outlive the chain.
        alive = all(base_of.get(r, r).op == "placeholder" or timeline.forward_lifetime(r).death >= at
                    for r in cost.reads)
        read_bases = tuple(dict.fromkeys(base_of[r] for r in cost.reads if r in base_of))  # saved ones
        forced_late = any(g in forced and first_use[g] >= at for g in read_bases)
        if alive and not forced_late:
            out[b] = dataclasses.replace(cost, read_bases=read_bases)
    return out


def plan_offloads(
    interface: SavedInterface,
    activations: Sequence[SavedActivation],
    timeline: Timeline,
    moves: Mapping[fx.Node, tuple[int, int]],
    costs: Mapping[fx.Node, TransferCost],
    options: PlanOptions,
    policies: Mapping[str, str] | None = None,
    recomputes: Mapping[fx.Node, RecomputeCost] | None = None,
    queued: bool = False,
) -> Plan:
    """Keep, offload or recompute every saved activation (see the module docstring).

    ``moves`` maps each candidate base to the (release, prefetch) timeline
    positions the scheduler gives it; ``costs`` to its predicted copy costs;
    ``recomputes`` to its recompute chain, where it has one; ``policies`` the
    user's selective-checkpoint marks by forward node name (``fxoffload.passes.policies``);
    ``queued``: price copies as queues on the copy engines (prefetches placed
    freely, horizon ``"auto"``) rather than each alone on its link.
    """
    user_storages = output_storages(interface.user_outputs)
    groups = group_by_base(activations)
    marks = {base: _group_marks(group, policies or {}) for base, group in groups.items()}
    handed_in = frozenset(timeline.input_activations)
    symbols = backward_symbols(interface, groups, handed_in)
    kept = frozenset(n for n in handed_in if input_position(n) in options.kept_inputs)
    reasons = {base: why_kept(group, user_storages, options.min_bytes, marks[base], symbols, handed_in, kept)
               for base, group in groups.items()}
    candidates = [base for base, reason in reasons.items() if reason is None]
    missing = [b.name for b in candidates if b not in moves or b not in costs]
    if missing:
        raise AssertionError(f"fxoffload: candidates without a placement: {missing}")
    forced = [b for b in candidates if MUST_CPU_OFFLOAD in marks[b]]
    free = [b for b in candidates if MUST_CPU_OFFLOAD not in marks[b]]
    _warn_unhonoured(reasons, marks)
    pos = timeline.positions
    first_use = {b: min(pos[u] for a in groups[b] for u in a.bw_node.users) for b in candidates}
    recomputable = _recomputable(timeline, groups, recomputes or {}, free, forced, first_use)
    problem = _Problem(timeline, moves, costs, recomputable, first_use, marks, options, queued,
                       _kept_lifetimes(timeline, reasons))
    _check_forced_host(problem, forced)

    act_before = problem.peak((), (), True)
    step_before = problem.step_peak((), ())
    inputs = graph_input_bytes(timeline)
    if problem.device:  # the bytes the step's own tensors may take
        limit = options.device_bytes - inputs
    else:
        limit = options.budget.resolve(step_before) if options.budget is not None else None
    held = _held(problem) if limit is not None else []
    choice, goal = _select(problem, free, forced, limit, held)
    transfers, rebuilt, decisions = _decide(problem, groups, reasons, choice, goal)
    decisions = _host_reasons(problem, decisions, groups, choice)
    budget_bytes = None if problem.device or options.budget is None else limit
    return Plan(
        decisions=decisions,
        transfers=transfers,
        min_bytes=options.min_bytes,
        recomputes=rebuilt,
        strategy=options.strategy,
        budget=str(options.budget) if options.budget is not None else "none",
        budget_bytes=budget_bytes,
        activation_peak_before=act_before,
        activation_peak_after=problem.peak(choice.offloaded, choice.recomputed, True),
        total_peak_before=problem.peak((), (), False),
        total_peak_after=problem.peak(choice.offloaded, choice.recomputed, False),
        total_cap=options.total_cap,
        runs=options.runs,
        step_peak_before=step_before,
        step_peak_after=problem.step_peak(choice.offloaded, choice.recomputed),
        input_bytes=inputs,
        device_bytes=options.device_bytes,
        device_peak_before=inputs + problem.device_peak((), ()),
        device_peak_after=inputs + problem.device_peak(choice.offloaded, choice.recomputed),
        solver=choice.solver,
        optimal=choice.optimal,
        gap=choice.gap,
        feasible=choice.feasible,
        note=choice.note,
        shortfall=choice.shortfall,
        sizes=tuple(SizeBudget(tuple(values.items()), n, at.step_peak((), ()),
                               at.step_peak(choice.offloaded, choice.recomputed)) for values, at, n in held),
        host_budget_bytes=options.host_bytes,
        held_cap=options.held_cap,
        held_before=problem.held((), ()),
        held_after=problem.held(choice.offloaded, choice.recomputed),
    )


def _check_forced_host(problem: _Problem, forced: Sequence[fx.Node]) -> None:
    """MUST_CPU_OFFLOAD copies are made whatever the host budget: say so when they alone exceed it."""
    cap = problem.options.host_bytes
    need = sum(problem.host(b) for b in forced)
    if cap is None or need <= cap:
        return
    message = (f"host_budget: the saved tensors marked MUST_CPU_OFFLOAD alone take {need} B of pinned host memory "
               f"({need / 2**20:.1f} MiB over {problem.options.runs} run(s)), above host_budget's {cap} B")
    if problem.options.on_infeasible == "error":
        raise BudgetInfeasibleError(message, need, cap, ("raise host_budget", "drop some MUST_CPU_OFFLOAD marks",
                                                         ADVICE_WARN))
    warnings.warn(BudgetInfeasibleWarning(message + "; offloading them anyway, and nothing else"), stacklevel=3)


def _host_reasons(problem: _Problem, decisions: tuple[Decision, ...], groups, choice: _Choice) -> tuple[Decision, ...]:
    """Under a host budget, a kept candidate whose copy would not fit what the plan's copies leave of it
    says so: the host budget, not the device budget, kept it."""
    cap = problem.options.host_bytes
    if cap is None:
        return decisions
    left = cap - sum(problem.host(b) for b in choice.offloaded)
    moved = set(choice.offloaded) | set(choice.recomputed)
    blocked = {a.index: problem.host(b) for b, group in groups.items() if b not in moved and b in problem.moves
               and problem.host(b) > left for a in group}
    return tuple(
        dataclasses.replace(d, why=Why.HOST_BUDGET,
                            reason=f"kept: its copy would take {blocked[d.index]} B of pinned host memory over the "
                                   f"step's runs; host_budget leaves {max(left, 0)} B")
        if d.index in blocked and d.why is Why.NOT_NEEDED else d
        for d in decisions)


def _select(problem: _Problem, free: Sequence[fx.Node], forced: Sequence[fx.Node], limit: int | None,
            held: Sequence[tuple[dict, _Problem, int]]) -> tuple[_Choice, str | None]:
    """The choice for a budget of ``limit`` bytes (None: no budget) at the plan's size and ``held``'s,
    and the goal its reasons name (None: every eligible candidate, ``all_eligible``)."""
    if limit is None:
        wanted = [b for b in free if PREFER_SAVE not in problem.marks[b]]  # without a budget, PREFER_SAVE holds
        if problem.options.all_eligible:
            return _all_eligible(problem, wanted, forced), None
        # The smallest peak is the budget: a move that cannot lower it is not made, nor one that lowers
        # it by less than min_bytes (a saving that small is not worth a copy, as a storage that small is not).
        limit = _smallest_peak(problem, wanted, forced) + problem.options.min_bytes
        free, goal = wanted, "reach the smallest peak"
    else:
        goal = "meet the budget"
    cap = problem.options.held_cap
    under_cap = cap is None or problem.device or problem.held(forced, ()) <= cap
    if problem.bounded_peak(forced, ()) <= limit and all(at.bounded_peak(forced, ()) <= n for _, at, n in held) \
            and under_cap:
        return _Choice(tuple(forced)), goal
    return _choose(problem, free, forced, limit, held), goal


def pinned_block(nbytes: int) -> int:
    """The pinned block PyTorch's CUDA caching host allocator gives a request of ``nbytes``: the next
    power of two (an 86 MiB activation takes 128 MiB), as ``ATen/core/CachingHostAllocator.h`` rounds
    every request by default (``pinned_max_round_threshold`` and ``pinned_max_cached_size`` unset in
    ``PYTORCH_CUDA_ALLOC_CONF``). The CPU engine allocates exactly ``nbytes``."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _held(problem: _Problem) -> list[tuple[dict, _Problem, int]]:
    """The other sizes the budget binds, each with the problem there and its budget in bytes.

    A fraction is the same fraction at every size of :func:`fxoffload.passes.memory.held_sizes`; a budget held
    to another plan's sizes (``Budget.at_sizes``) gives its bytes. A budget in bytes binds the plan's
    own size only: that is the largest the guards allow where they bound it, and every activation's
    bytes grow with every symbol (under an unbounded size the backend warns instead)."""
    budget = problem.options.budget
    if problem.device or budget is None:
        return []
    if budget.at_sizes:
        targets = [(dict(values), nbytes) for values, nbytes in budget.at_sizes]
    elif budget.fraction is not None:
        targets = [(values, None) for values in held_sizes(problem.timeline)]
    else:
        return []
    out = []
    for values, nbytes in targets:
        at = dataclasses.replace(problem, timeline=timeline_at(problem.timeline, values))
        out.append((values, at, nbytes if nbytes is not None else budget.resolve(at.step_peak((), ()))))
    return out


def _decide(problem: _Problem, groups, reasons, choice: _Choice, goal: str | None):
    """Transfers, recomputations and per-activation decisions of a choice made to reach ``goal``."""
    offloaded, recomputed = set(choice.offloaded), set(choice.recomputed)
    transfers: list[Transfer] = []
    rebuilt: list[Recompute] = []
    decisions: dict[int, Decision] = {}
    for base, group in groups.items():
        transfer = recompute = None
        members = tuple(a.index for a in group)
        lt = problem.lifetime(base) if base in offloaded or base in recomputed else None
        if base in offloaded:
            transfer = len(transfers)
            transfers.append(Transfer(base, lt.nbytes, members, lt.index, problem.costs.get(base),
                                      staging=staging_bytes(base, problem.options)))
        elif base in recomputed:
            recompute = len(rebuilt)
            rebuilt.append(Recompute(base, group[0].base_nbytes, members, lt.index, problem.moves[base][0],
                                     problem.rebuilt_at(base), problem.recomputes[base]))
        action = RECOMPUTE if recompute is not None else OFFLOAD if transfer is not None else KEEP
        why = _why(action, reasons[base], problem.marks[base], goal)
        for act in group:
            if recompute is not None:
                reason = _recompute_reason(act, problem.recomputes[base], goal, problem.marks[base])
            else:
                reason = _reason(act, reasons[base], why, goal, problem.marks[base])
            decisions[act.index] = Decision(
                index=act.index, name=act.name, shape=tuple(act.val.shape), dtype=act.val.dtype, nbytes=act.nbytes,
                action=action, reason=reason, transfer=transfer, recompute=recompute, why=why,
            )
    return tuple(transfers), tuple(rebuilt), tuple(decisions[i] for i in sorted(decisions))


def _why(action: str, kept_because: str | None, marks: frozenset[str], goal: str | None) -> Why:
    """The decision's ``Why``; :func:`_reason` words it."""
    if action == RECOMPUTE:
        return Why.RECOMPUTED
    if action == OFFLOAD:
        return Why.OFFLOADED
    if kept_because is not None:
        return Why.INELIGIBLE
    return Why.PREFER_SAVE if PREFER_SAVE in marks and goal != "meet the budget" else Why.NOT_NEEDED


def _recompute_reason(act: SavedActivation, cost: RecomputeCost, goal: str | None, marks: frozenset[str]) -> str:
    ops = sum(1 for n in cost.chain if is_compute(n))
    source = ", ".join(r.name for r in cost.reads) or "nothing saved"
    why = (f"recomputed before {cost.consumer.name} from {source} ({ops} ops, {cost.seconds * 1e6:.1f} us predicted)"
           + (f"; chosen to {goal}" if goal else "; all_eligible, strategy 'recompute'")
           + (", overriding PREFER_SAVE" if PREFER_SAVE in marks else ""))
    return why if not act.view_chain else f"view of {act.base.name}; base {why}; view rebuilt after it"


def _reason(act: SavedActivation, kept_because: str | None, why: Why, goal: str | None,
            marks: frozenset[str]) -> str:
    """``why`` in words for ``act`` (kept or offloaded), naming the selective-checkpoint mark it
    honours or overrides."""
    if why is Why.INELIGIBLE:
        return f"MUST_CPU_OFFLOAD not honoured: {kept_because}" if MUST_CPU_OFFLOAD in marks else kept_because
    if why is Why.OFFLOADED:
        if MUST_CPU_OFFLOAD in marks:
            return _offload_reason(act, "selective checkpoint policy MUST_CPU_OFFLOAD")
        if PREFER_SAVE in marks:
            return _offload_reason(act, f"chosen to {goal}, overriding PREFER_SAVE")
        chosen = f"chosen to {goal}" if goal else _EVERY_ELIGIBLE
        reason = _offload_reason(act, "PREFER_CPU_OFFLOAD, " + chosen if PREFER_CPU_OFFLOAD in marks else chosen)
        return f"{INPUT_ACTIVATION}: {reason}" if act.base.op == "placeholder" else reason
    if why is Why.PREFER_SAVE:
        return "kept: selective checkpoint policy PREFER_SAVE"
    holds = "the budget holds" if goal == "meet the budget" else "the smallest peak is reached"
    if PREFER_CPU_OFFLOAD in marks:
        return f"kept: {holds} without offloading it (overrides PREFER_CPU_OFFLOAD)"
    return f"kept: {holds} without offloading it"


def _warn_unhonoured(reasons: Mapping[fx.Node, str | None], marks: Mapping[fx.Node, frozenset[str]]) -> None:
    # A MUST mark the plan cannot follow is something the user must act on.
    for base, reason in reasons.items():
        if MUST_CPU_OFFLOAD in marks[base] and reason is not None:
            warnings.warn(f"fxoffload: {base.name} is marked MUST_CPU_OFFLOAD but stays on the device: {reason}",
                          stacklevel=3)
