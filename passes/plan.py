"""The plan and what it is planned for: the values the other stages read.

Inputs: none (the planner, ``fxoffload.passes.planning``, makes these values).
Outputs: ``PlanOptions`` (the budget and the planner's settings), ``Plan`` (one ``Decision`` per saved
activation, its ``Transfer``s and ``Recompute``s, the predicted peaks), ``BudgetInfeasibleError`` and
``BudgetInfeasibleWarning`` (a budget out of reach), and the small functions that read a plan
(``recompute_moves``, ``staging_bytes``, ``pinned_block``).

Every value here is frozen: the rewrite, the scheduler, the simulator and ``explain`` read a plan and
never change it. Limits: ``Decision.reason`` is words for people; code reads ``Decision.why`` and, for a
storage that cannot move, ``Decision.kept`` (an ``Ineligible``: a ``Kept`` code and the figures its words
cite). An offload's or a recomputation's reason is words only: its figures are in its ``Transfer`` or
``Recompute``.
"""

from __future__ import annotations

import enum
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

import torch
import torch.fx as fx

from .candidates import RecomputeCost, TransferCost
from .ops import one_block
from .sizes import concrete
from .solvers import NODE_LIMIT, TIME_GUARD, SolverName

__all__ = [
    "ADVICE_WARN", "AUTO_STRATEGY", "Budget", "BudgetInfeasibleError", "BudgetInfeasibleWarning", "Decision", "Goal",
    "Ineligible", "KEEP", "Kept", "OFFLOAD", "ON_INFEASIBLE", "OnInfeasible", "OverheadExceededError", "Plan",
    "PlanOptions", "RECOMPUTE",
    "Recompute", "SizeBudget", "STRATEGIES", "Strategy", "Transfer", "Why", "pinned_block", "recompute_moves",
    "readable_bytes", "recompute_temporaries", "staging_bytes", "warn_from_user",
]

OFFLOAD = "offload"
RECOMPUTE = "recompute"
KEEP = "keep"
AUTO_STRATEGY = "auto"  # keep, offload or recompute, per tensor (a horizon's "auto" is candidates.AUTO_HORIZON)
Strategy = Literal["auto", "offload", "recompute"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
OnInfeasible = Literal["error", "warn"]
ON_INFEASIBLE: tuple[str, ...] = get_args(OnInfeasible)


ADVICE_WARN = "pass on_infeasible='warn'"


def advice_min_bytes(options: "PlanOptions") -> tuple[str, ...]:
    """The advice to lower ``min_bytes``, where there is anything to lower (it was given at ``min_bytes=0``)."""
    return ("lower min_bytes",) if options.min_bytes > 0 else ()


class BudgetInfeasibleError(ValueError):
    """The memory budget cannot be met even by offloading every eligible activation.

    ``reason``: what cannot be met, with its numbers; ``smallest``: the smallest achievable peak
    (bytes, of what the budget bounds); ``budget``: the bytes it bounds it to; ``advice``: what the
    caller may change, each a phrase (``ADVICE_WARN`` among them where it applies); ``least_held``: what
    the runs leave for the backward with every candidate moved, the least any plan leaves (``Plan.held_least``;
    None where not planned)."""

    def __init__(self, reason: str, smallest: int, budget: int, advice: Sequence[str] = (), *,
                 least_held: int | None = None) -> None:
        self.reason, self.smallest, self.budget, self.advice = reason, smallest, budget, tuple(advice)
        self.least_held = least_held
        super().__init__(self.explained(self.advice))

    def explained(self, advice: Sequence[str]) -> str:
        """The reason, then ``advice`` as "; a, b, or c"."""
        if not advice:
            return self.reason
        listed = advice[0] if len(advice) == 1 else ", ".join(advice[:-1]) + ", or " + advice[-1]
        return f"{self.reason}; {listed}"

    def within(self, context: str) -> "BudgetInfeasibleError":
        """The same error, its reason prefixed by where it arose."""
        return BudgetInfeasibleError(f"{context}{self.reason}", self.smallest, self.budget, self.advice,
                                     least_held=self.least_held)


class OverheadExceededError(BudgetInfeasibleError):
    """The memory budget holds, but only with a predicted overhead above ``max_overhead``.

    ``smallest`` and ``budget`` are the bytes, as for :class:`BudgetInfeasibleError` (the budget holds:
    ``smallest <= budget``); ``seconds`` the plan's predicted overhead per run, ``bound`` max_overhead's."""

    def __init__(self, reason: str, smallest: int, budget: int, advice: Sequence[str] = (), *,
                 seconds: float = 0.0, bound: float = 0.0) -> None:
        super().__init__(reason, smallest, budget, advice)
        self.seconds, self.bound = seconds, bound

    def within(self, context: str) -> "OverheadExceededError":
        return OverheadExceededError(f"{context}{self.reason}", self.smallest, self.budget, self.advice,
                                     seconds=self.seconds, bound=self.bound)


class BudgetInfeasibleWarning(UserWarning):
    """``on_infeasible="warn"``: the budget cannot be met; the plan is for the smallest achievable peak."""


# Where the planner's own frames lie, fxoffload's (its sibling package), torch's and the standard library's
# (contextlib's decorators sit between torch's frames): a warning is told from the first frame outside them.
# In the checkout the passes lie beside fxoffload/; a wheel installs them as fxoffload/passes/.
_PASSES_DIR = os.path.dirname(os.path.abspath(__file__))
_ABOVE = os.path.dirname(_PASSES_DIR)
_FXOFFLOAD_DIR = _ABOVE if os.path.basename(_ABOVE) == "fxoffload" else os.path.join(_ABOVE, "fxoffload")
_INTERNAL_DIRS = tuple(os.path.join(path, "") for path in (
    _PASSES_DIR, _FXOFFLOAD_DIR, os.path.dirname(os.path.abspath(torch.__file__))))
# The standard library's, but for the installed packages some layouts keep under it (a Docker image's
# /usr/local/lib/python3.x/site-packages): a user's own package there is the user's line.
_STDLIB_DIR = os.path.join(sysconfig.get_paths()["stdlib"], "")
_INSTALLED = ("site-packages", "dist-packages")


def readable_bytes(n: Any) -> str:
    """Bytes in GiB, MiB or KiB to one decimal, or in B below a KiB (a tiny graph's budget read "0.1 MiB" for
    both figures it compared); a symbolic size as its expression."""
    if not isinstance(n, int):
        return str(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def warn_from_user(warning: Warning) -> None:
    """Warn, told from the user's line that ran or compiled the model (the first frame outside the planner,
    fxoffload and torch), not from the planner's own line, which Python would print as the warning's source
    (a trial, 2026-12-06: every warning echoed ``choice = _choose(problem, ...)``)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level)


def _internal(filename: str) -> bool:
    if filename.startswith(_INTERNAL_DIRS) or filename.startswith("<eval_with_key"):  # (FX's generated code)
        return True
    return filename.startswith(_STDLIB_DIR) and not any(part in _INSTALLED for part in filename.split(os.sep))


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
    # Forwards of the step run between its backwards (a pipeline stage under 1F1B or an interleaved
    # schedule): the copies a backward starts ahead for the next one are held through the forward that
    # runs between them, so they must fit over this graph's forward too, on top of what the other runs
    # hold, and the step's peak counts them there (``fxoffload.passes.scheduling``).
    interleaved: bool = False
    # A bound on the device peak instead of ``budget``: bytes for the graph's inputs and every
    # tensor the step creates (``device_budget`` less ``reserved``).
    device_bytes: int | None = None
    # Under ``device_bytes``: gradients on the device throughout this graph's backward that it does not
    # make (the later regions of a step ran their backwards first and left theirs in ``.grad``), and
    # what one run's backward leaves there: over ``runs`` runs, the first run's backward runs on top
    # of the other runs' gradients, as the last run's runs on top of what the others hold.
    backward_gradients: int = 0
    run_gradients: int = 0
    # Without a budget: act on every candidate, whether or not that lowers the peak (the naive
    # baseline), instead of the cheapest choice that reaches the smallest peak.
    all_eligible: bool = False
    # A bound on the host memory of the graph's copies over its runs, in CUDA's pinned blocks
    # (:func:`pinned_block`): what does not fit is kept or recomputed. None: unbounded.
    host_bytes: int | None = None
    # Device types whose copy engine stages a tensor that does not fill one block of memory (gaps or
    # overlaps: ``ops.one_block``) through a contiguous device buffer (the CUDA engine,
    # ``fxoffload.runtime``): each such transfer holds one more block of its
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
    # to keep after the graph returned (``fxoffload.backend.callers``): counted, never moved (a copy frees nothing).
    kept_inputs: frozenset[int] = frozenset()
    # A bound on the time a plan adds (stalls, recomputation), as a fraction of the graph's predicted
    # compute time without it, per run, as the simulator predicts both (``fxoffload.passes.pipeline``).
    # Without a budget, the plan reaches the smallest peak within it; with one, the budget is the limit
    # and this the preference: a plan that needs more says so (``OverheadExceededError``). None: unbounded.
    max_overhead: float | None = None
    # The inner compiler fuses pointwise chains into kernels (Inductor): the cost model prices them so
    # (``cost_model.fused_work``). False: op by op, as eager runs them.
    fused_kernels: bool = False


class Goal(enum.Enum):
    """What a plan's choice was made to do; the reasons name it (``value``: the words)."""

    MEET_BUDGET = "meet the budget"
    SMALLEST_PEAK = "reach the smallest peak"
    SMALLEST_PEAK_WITHIN = "reach the smallest peak within max_overhead"


class Why(enum.Enum):
    """Why a decision is what it is, as data: code branches on this, never on ``Decision.reason``'s
    wording (which is for people)."""

    INELIGIBLE = "kept: it cannot move"  # too small, a user output, a graph input, a symbolic size, ...
    NOT_NEEDED = "kept: the goal holds without moving it"
    PREFER_SAVE = "kept: the user's PREFER_SAVE mark"
    HOST_BUDGET = "kept: its copy does not fit host_budget"
    OVERHEAD = "kept: moving it would take the plan over max_overhead"
    OFFLOADED = "offloaded"
    RECOMPUTED = "recomputed"


class Kept(enum.Enum):
    """Why a storage group must stay on the device, one code per rule of ``eligibility.why_kept``
    (in its order). Code and tests branch on these; each value is the words, with the figures it
    cites as ``str.format`` fields (:attr:`Ineligible.words`)."""

    GRAPH_INPUT = "graph input (parameter or user input), or a view of one"
    CALLER_KEEPS = "layer input its caller keeps after the graph returns (seen at run time): a copy would free nothing"
    MUST_SAVE = "selective checkpoint policy MUST_SAVE"
    NOT_A_TENSOR = "base is not a single tensor"
    RNG_STATE = "random-number generator state for a recomputed random op"
    MODEL_OUTPUT = "shares storage with a model output"
    NO_ENGINE = "on device {device!r}; supported: cpu, cuda"
    SYMBOLIC_SIZE = "symbolic size the backward cannot compute: {missing}"
    EMPTY = "empty tensor"
    CTX_STASH = "stashed on ctx without save_for_backward"
    VIEW_CHAIN = "view chain takes other graph values as arguments; cannot rebuild it after prefetch"
    UNUSED = "not used by the backward graph"
    TOO_SMALL = "{nbytes} B < min_bytes={min_bytes}"


@dataclass(frozen=True)
class Ineligible:
    """Why one storage group stays: its code and the figures the words cite (by field name)."""

    code: Kept
    figures: tuple[tuple[str, Any], ...] = ()

    @property
    def words(self) -> str:
        return self.code.value.format(**dict(self.figures))

    def figure(self, name: str) -> Any:
        return dict(self.figures)[name]


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
    kept: Ineligible | None = None  # why it cannot move, as data (when ``why`` is INELIGIBLE)


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
    interleaved: bool = False  # PlanOptions.interleaved: forwards run between the step's backwards
    # The step's activation peak over ``runs`` runs (each run's curve on top of what the earlier
    # ones hold for their backward; the runs before the last with their releases deferred, where the
    # schedule defers them: ``Placement.deferred_before_last``); equal to the activation peaks for one
    # run. The budget bounds it.
    step_peak_before: int = 0
    step_peak_after: int = 0
    # Under a device budget (PlanOptions.device_bytes): the graph's input bytes, the budget, and the
    # predicted device peak: inputs plus the step's total peak (over ``runs`` runs).
    input_bytes: int = 0
    device_bytes: int | None = None
    backward_gradients: int = 0  # PlanOptions.backward_gradients: counted in the budget, not in the peaks
    run_gradients: int = 0  # PlanOptions.run_gradients
    device_peak_before: int = 0
    device_peak_after: int = 0
    solver: str = "none"
    optimal: bool = True
    gap: float = 0.0
    feasible: bool = True
    note: str = ""
    shortfall: tuple[int, int] | None = None  # when infeasible: (smallest achievable peak, budget), bytes
    # Under symbolic sizes and a fractional budget: the other sizes the plan holds the fraction at
    # (``fxoffload.passes.sizes.held_sizes``), each with its budget and the predicted peaks there.
    sizes: tuple[SizeBudget, ...] = ()
    # Under symbolic sizes, as they were when planned (a later compile's guards, Inductor's, may narrow
    # them): each symbol's size the plan was made for, (symbol, size, bounded: the largest its guards
    # allowed, else the traced one), and the range it holds a fraction over, (symbol, smallest, largest).
    planned_at: tuple[tuple[Any, int, bool], ...] = ()
    size_ranges: tuple[tuple[Any, int, int], ...] = ()
    # PlanOptions.host_bytes: the pinned host bytes the plan may take over its runs
    host_budget_bytes: int | None = None
    held_cap: int | None = None  # PlanOptions.held_cap
    # Predicted: what the runs leave for the backward (the activation curve at the forward's end, over the runs).
    held_before: int = 0
    held_after: int = 0
    # Infeasible plans only (else None): what the runs leave for the backward with every candidate moved, which
    # also reaches the smallest peak: the least any plan of the graph leaves (the cheapest may leave more).
    held_least: int | None = None
    # PlanOptions.max_overhead, and the seconds per run it allows (set by the driver, which knows the
    # graph's compute time: ``fxoffload.passes.pipeline``).
    max_overhead: float | None = None
    overhead_bound: float | None = None
    # Predicted compute seconds one run of this pair takes over the min-cut pair's, without offloading: the
    # recomputations inside PyTorch's recompute-only partition (strategy auto's ``partition`` of that name),
    # which no ``Recompute`` of this plan names; 0 for the min-cut pair. The simulators count it in the
    # overhead, which is over the min-cut pair's compute (what the graph computes without fxoffload).
    partition_seconds: float = 0.0

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

    def sizes_planned(self) -> dict[Any, tuple[int, bool]]:
        """Under symbolic sizes: symbol -> (size the plan was made for, bounded), as planned."""
        return {symbol: (value, bounded) for symbol, value, bounded in self.planned_at}

    def ranges_held(self) -> dict[Any, tuple[int, int]]:
        """Under symbolic sizes: symbol -> (smallest, largest) of the range it holds a fraction over, as planned."""
        return {symbol: (lo, hi) for symbol, lo, hi in self.size_ranges}

    def recompute_temporaries(self) -> list[tuple[int, int, int]]:
        return recompute_temporaries(self.recomputes)

    @property
    def estimated_stall(self) -> float:
        """The planner's estimate (each copy alone on its link); ``Schedule.predicted_stall`` is the prediction."""
        return sum(t.cost.stall for t in self.transfers if t.cost is not None)


def staging_bytes(base: fx.Node, options: PlanOptions) -> int:
    """Bytes of the contiguous device buffer an engine that stages copies (its device type in
    ``options.staging_devices``) puts a base through, at the size the plan is made for: one whose
    traced layout does not fill one block of memory (``ops.one_block``: a padded or sliced layout, gaps
    or overlaps); 0 for one that does (contiguous, transposed, channels-last: copied as its block).
    Such a source is made contiguous before its copy, and its destination lands in a contiguous buffer
    first: ``numel`` elements, whatever the storage's size."""
    val = base.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type not in options.staging_devices:
        return 0
    if one_block([concrete(s, val) for s in val.shape], [concrete(s, val) for s in val.stride()]):
        return 0
    return concrete(val.numel() * val.element_size(), val)


def recompute_moves(recomputes: Sequence[Recompute]) -> dict[int, tuple[int, int]]:
    """Lifetime index -> (release, rebuild) positions: recomputed storages' device intervals."""
    return {r.lifetime: (r.release, r.at) for r in recomputes}


def recompute_temporaries(recomputes: Sequence[Recompute]) -> list[tuple[int, int, int]]:
    """Device intervals of the recompute chains' temporaries (beyond their bases and consumers' outputs)."""
    return [(r.at, r.at, r.cost.transient) for r in recomputes if r.cost.transient]


def pinned_block(nbytes: int) -> int:
    """The pinned block PyTorch's CUDA caching host allocator gives a request of ``nbytes``: the next
    power of two (an 86 MiB activation takes 128 MiB), as ``ATen/core/CachingHostAllocator.h`` rounds
    every request by default (``pinned_max_round_threshold`` and ``pinned_max_cached_size`` unset in
    ``PYTORCH_CUDA_ALLOC_CONF``). The CPU engine allocates exactly ``nbytes``."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
