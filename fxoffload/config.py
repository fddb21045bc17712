"""Configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args

from fxoffload.errors import OptionError
from fxoffload.passes import (
    AUTO_HORIZON, NODE_LIMIT, ON_INFEASIBLE, SOLVERS, STRATEGIES, TIME_GUARD, Budget, DeviceProfile, OnInfeasible,
    PlanOptions, SolverName, Strategy,
)
from fxoffload.profiles import resolve_profile

__all__ = ["OffloadConfig", "OptionError", "config_from_options", "parse_budget", "parse_overhead"]

InnerCompiler = Literal["inductor", "eager"]
INNER_COMPILERS: tuple[str, ...] = get_args(InnerCompiler)
Select = Literal["predicted", "measured"]
SELECTS: tuple[str, ...] = get_args(Select)
SELECT_STEPS = 3  # select_steps' default
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)\s*$", re.IGNORECASE)
BUDGET_FORMS = (
    "None, a fraction in (0, 1] of the activation peak without offloading, "
    "an int number of bytes >= 2, or a string such as '6GiB', '512MB', '1B' (KB/MB/GB are powers of 10, KiB/MiB/GiB "
    "of 2)"
)


def parse_budget(value: Any) -> Budget | None:
    """The budget a ``memory_budget`` value stands for; :class:`OptionError` naming the accepted forms. The
    int 1 is refused: one byte is no budget, and its writer meant the whole peak (``fxoffload plan --budget 1``
    planned for one byte before 2026-12-06); ``"1B"`` still says one byte."""
    if type(value) is int and value == 1:
        raise OptionError("memory_budget", f"got {value!r}, an int: bytes, and one byte is no budget; the whole "
                                           f"activation peak is the float 1.0; accepted: {BUDGET_FORMS}")
    return _budget_of(value)


def _budget_of(value: Any) -> Budget | None:
    """``value`` as a budget in any form ``memory_budget`` takes, the int 1 (one byte) too."""
    bad = OptionError("memory_budget", f"got {value!r}; accepted: {BUDGET_FORMS}")
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value <= 0:
            raise bad
        return Budget(nbytes=value)
    if isinstance(value, float):
        if not (0.0 < value <= 1.0) or math.isnan(value):
            raise bad
        return Budget(fraction=value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or not unit:
            raise bad
        nbytes = int(float(match.group(1)) * unit)
        if nbytes <= 0:
            raise bad
        return Budget(nbytes=nbytes)
    raise bad


OVERHEAD_FORMS = ("None, a fraction in [0, 1) of each compiled graph's predicted time without offloading (0.01), or a "
                  "percentage string ('1%', '0.5%', '150%')")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_overhead(value: Any) -> float | None:
    """The fraction a ``max_overhead`` value stands for; :class:`OptionError` naming the accepted forms.
    An int but 0, or a float of 1 or more, is refused: ``1`` would read as 100%, and a user who writes it
    most likely means 1%; a bound of 100% or more is written as a percentage, which says what it means."""
    bad = OptionError("max_overhead", f"got {value!r}; accepted: {OVERHEAD_FORMS}")
    if value is None:
        return None
    if isinstance(value, str):
        match = _PERCENT.match(value)
        if not match:
            raise bad
        return float(match.group(1)) / 100
    if type(value) is int and value == 0:  # no overhead: no other reading (0.0 and "0%" were accepted, 0 refused)
        return 0.0
    if not isinstance(value, float) or not 0.0 <= value < 1.0:  # (NaN fails this too)
        raise bad
    return value


@dataclass(frozen=True)
class OffloadConfig:
    """fxoffload's options, one frozen value, validated when made (``offload_backend(**options)`` and
    ``options=`` by name build it through :func:`config_from_options`: an unknown option or a bad value
    raises ``OptionError`` naming what is accepted). Each field is documented where it is declared
    (``fxoffload/config.py``), and the README's options table gives every field with its default."""

    memory_budget: Any = None
    """Bound on the peak of activation memory (saved tensors on the device): a fraction per compiled
    graph, bytes for the whole step (later graphs get what earlier ones leave). None: the smallest
    peak the strategy can reach (to within ``min_bytes``), at the least predicted cost: a tensor
    whose move cannot lower the peak, such as logits read as the backward starts, stays. See
    ``BUDGET_FORMS`` for the accepted values."""

    min_bytes: int = 64 * 1024
    """Smallest storage (bytes) worth a transfer; smaller saved tensors stay on the device.
    Copies below ~64 KiB are dominated by launch and link latency."""

    horizon: int | Literal["auto"] = AUTO_HORIZON
    """Where prefetches start: ``"auto"`` (from predicted op and copy times, as late as hides the
    copy, as early as the memory bound allows), or an int: exactly that many compute ops before
    the first backward consumer (views, getitems and fxoffload ops do not count), clamped to the
    backward's start."""

    inner: InnerCompiler = "inductor"
    """Compiler for the rewritten graphs: ``"inductor"`` or ``"eager"`` (run the FX graphs as they are)."""

    strategy: Strategy = "auto"
    """What the planner may do to a saved tensor that does not fit the budget: ``"auto"`` (keep,
    offload or recompute, whichever is predicted fastest), ``"offload"`` (keep or offload only) or
    ``"recompute"`` (keep, or rebuild it in the backward from other saved tensors). Without a
    budget, the same choices reach the smallest peak the strategy can (``all_eligible``: every
    eligible tensor offloaded, or under ``"recompute"`` every recomputable one recomputed)."""

    solver: SolverName = "auto"
    """``"auto"`` (greedy, or when greedy is more than 1% above the LP bound, the exact MILP within
    1% of its bound; never worse than greedy), ``"milp"`` (the exact MILP within 0.01%) or ``"greedy"``."""

    solver_node_limit: int = NODE_LIMIT
    """Branch-and-bound nodes the exact solver may explore per program: the normal bound on its
    work, counted the same on every machine and under any load, so a plan does not depend on the
    clock."""

    solver_time_limit: float = TIME_GUARD
    """Seconds the exact solver may take per program: a guard against a pathological program, not
    the normal exit. A plan stopped by it may differ between runs and ranks (fxoffload warns)."""

    on_infeasible: OnInfeasible = "error"
    """When no plan meets the budget: ``"error"`` raises, ``"warn"`` warns and plans for the smallest
    achievable activation peak instead (at least cost)."""

    device_profile: Any = "auto"
    """The GPU the cost model predicts for: a name from ``fxoffload.PROFILES``, ``"auto"`` (the current
    CUDA device, else the default profile), or a ``DeviceProfile``."""

    cross_graphs: bool = True
    """Let copies cross compiled-graph boundaries (one graph per layer, graph breaks): a forward may
    return with device-to-host copies in flight (the device copy is freed once the copy has landed,
    at the latest when a backward begins), and a backward starts the first host-to-device copies of
    the backward that runs after it. ``False`` waits for every copy inside its own graph."""

    device_budget: Any = None
    """Bound on the step's predicted device peak: the graph's inputs (parameters, buffers, batch)
    plus every tensor the step creates (activations, gradients, temporaries) plus ``reserved``.
    Bytes or a size string (no fraction). Instead of ``memory_budget``, not with it."""

    reserved: Any = 0
    """Device bytes the graphs cannot see, counted against ``device_budget``: optimizer state, the
    allocator's slack, eager code's tensors (an input projection left outside the compiled layers, the
    batch it reads), and in the first step of several regions or runs, the later regions' and runs'
    parameters (each region's first plan counts those of the regions before it; once the step has shown
    its regions, every plan counts them all, and the gradients the other backwards leave:
    ``fxoffload.backend.step_budget``). Bytes or a size string."""

    runs_per_step: Any = "auto"
    """How many times each compiled graph runs in one training step: with one graph per layer
    (``layer.compile`` on identical layers, as FSDP2 and torchtitan do), the number of layers. The
    budget then bounds the whole step (each run's activations on top of what the earlier runs hold
    for their backward), and a fractional budget is a fraction of the step's activation peak.
    ``"auto"``: plan each graph for one run, count its runs in the first step, and where it ran
    more often, re-plan and recompile it once for that count (logged, and shown by ``explain``;
    graphs with symbolic sizes are not re-planned). An int applies to every graph this backend
    compiles: use one backend for the layers, another for graphs that run once."""

    check_ranks: Any = True
    """Under ``torch.distributed``, check that the ranks that compile the same graph plan it alike, and
    raise ``PlanMismatchError`` naming the ranks that differ (``fxoffload.backend.ranks``: through the job's
    store, at compile and at the second step's start; ranks that compile different graphs, such as
    pipeline stages, are not compared). ``True``: every rank; a ``ProcessGroup``: its ranks (those that
    run fxoffload); ``False``: no check."""

    check_ranks_timeout: float = 300.0
    """Seconds a rank waits, at its second step's start, for the first plans of its peers (``check_ranks``),
    and under ``select="measured"`` for their timings, before it raises ``RankCheckTimeoutError`` naming
    the ranks that never published theirs."""

    debug: bool = dataclasses.field(default_factory=lambda: os.environ.get("FXOFFLOAD_DEBUG", "") not in ("", "0"))
    """Debug mode for the runtime (``fxoffload.runtime.debugging``): the CUDA engine fills each copy's
    destination with NaN before the copy, so a consumer that misses its wait reads NaN instead of
    stale memory, and every wait counts whether it stalled (``fxoffload.runtime.debug_counts()``).
    Costs a fill per copy; plans are unchanged. Default: on when the environment sets
    ``FXOFFLOAD_DEBUG`` (to anything but ``0``)."""

    host_budget: Any = None
    """Bound on the host memory the step's copies hold (they are all alive when the last forward
    ends), counted in the pinned blocks PyTorch's CUDA caching host allocator hands out (each copy
    rounded up to a power of two; the CPU engine takes at most that). Bytes or a size string (no
    fraction), for the whole step: later graphs get what earlier ones leave. What does not fit stays
    on the device or is recomputed, with a reason. None: unbounded."""

    all_eligible: bool = False
    """Without a budget, offload every eligible saved tensor (under strategy ``"recompute"``,
    recompute every recomputable one) whether or not that lowers the peak, as naive offloading
    does: a baseline for comparisons and tests. Not with ``memory_budget`` or ``device_budget``."""

    select: Select = "predicted"
    """How strategy auto picks among its plans of a graph that meet the budget (the min-cut pair's
    joint plan, offload-only, recompute-only, PyTorch's recompute-only partition, and for a graph of
    several runs the joint plan with room under the budget): ``"predicted"``,
    the fastest the cost model predicts (plans depend on the graph and the options alone); or
    ``"measured"``, the fastest measured: the first steps run each candidate (one warm-up step, then
    ``select_steps`` timed steps; CUDA events around each graph) and the fastest median is kept for
    good, and ``explain`` reports every candidate's figures. Under ``"measured"`` the alternatives are
    planned even when the first plan predicts no cost. Over several ranks (``check_ranks`` on) the
    ranks choose together: the candidate whose slowest rank's median is least, on every rank
    (``fxoffload.backend.selection``). Needs ``strategy="auto"`` and a ``memory_budget`` to have a
    choice (refused without them: there would be one plan, and nothing to time), and graphs without
    symbolic sizes (they are compiled again per candidate; one of symbolic sizes warns, and keeps the
    fastest predicted)."""

    select_steps: int = SELECT_STEPS
    """Timed steps per candidate under ``select="measured"``, after its warm-up step (the median counts);
    a value other than this default is refused with ``select="predicted"``, which times nothing."""

    max_overhead: Any = None
    """Bound on the time a plan may add to each compiled graph (stalls on copies, recomputation), as a
    fraction of its predicted compute time without offloading: ``0.01`` or ``"1%"``. Without a budget,
    each graph's plan is the smallest activation peak within it (instead of the smallest at any cost);
    with ``memory_budget`` or ``device_budget``, the budget is the limit and this the preference: a graph
    that can meet its budget only above it raises ``OverheadExceededError`` (``on_infeasible="warn"``:
    warns, and meets the budget). Predicted by the cost model, as every plan is. None: unbounded.
    See ``OVERHEAD_FORMS``."""

    def __post_init__(self) -> None:
        parse_budget(self.memory_budget)
        parse_overhead(self.max_overhead)
        _device_bytes("device_budget", self.device_budget)
        _device_bytes("reserved", self.reserved, allow_zero=True)
        _device_bytes("host_budget", self.host_budget)
        if self.device_budget is not None and self.memory_budget is not None:
            raise OptionError("memory_budget", f"memory_budget={self.memory_budget!r} and device_budget="
                              f"{self.device_budget!r}: give one; accepted: memory_budget (saved activations) or "
                              "device_budget (the device peak)", named=True)
        if self.reserved and self.device_budget is None:
            raise OptionError("reserved", f"reserved={self.reserved!r}: counts against device_budget, which is not "
                              "given", named=True)
        if self.reserved and self.device_budget is not None and self.reserved_bytes >= self.device_budget_bytes:
            raise OptionError("reserved", f"reserved={self.reserved!r} leaves nothing of device_budget="
                              f"{self.device_budget!r}; accepted: less than device_budget", named=True)
        if not isinstance(self.debug, bool):
            raise OptionError("debug", f"got {self.debug!r}; accepted: True or False")
        if not isinstance(self.all_eligible, bool):
            raise OptionError("all_eligible", f"got {self.all_eligible!r}; accepted: True or False")
        if self.all_eligible and (self.memory_budget is not None or self.device_budget is not None):
            raise OptionError("all_eligible", f"all_eligible=True with memory_budget={self.memory_budget!r}, "
                              f"device_budget={self.device_budget!r}: a budget decides what moves; accepted: "
                              "all_eligible=True with no budget, or a budget with all_eligible=False", named=True)
        if self.all_eligible and self.max_overhead is not None:
            raise OptionError("all_eligible", f"all_eligible=True with max_overhead={self.max_overhead!r}: "
                              "all_eligible moves every candidate whatever it costs; accepted: one of them",
                              named=True)
        _check_int("min_bytes", self.min_bytes)
        if self.horizon != AUTO_HORIZON:
            _check_int("horizon", self.horizon, also="or 'auto'")
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("inner", self.inner, INNER_COMPILERS)
        _check_choice("solver", self.solver, SOLVERS)
        _check_choice("on_infeasible", self.on_infeasible, ON_INFEASIBLE)
        _check_choice("select", self.select, SELECTS)
        steps = self.select_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise OptionError("select_steps", f"got {steps!r}; accepted: an int >= 1 (timed steps per candidate)")
        self._check_selection_has_a_choice()
        runs = self.runs_per_step
        if runs != "auto" and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
            raise OptionError("runs_per_step", f"got {runs!r}; accepted: 'auto', or an int >= 1 (the number of "
                              "layers one compiled graph serves)")
        if not isinstance(self.cross_graphs, bool):
            raise OptionError("cross_graphs", f"got {self.cross_graphs!r}; accepted: True or False")
        limit = self.solver_time_limit
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise OptionError("solver_time_limit", f"got {limit!r}; accepted: a number of seconds > 0")
        if not isinstance(self.check_ranks, bool) and not _is_process_group(self.check_ranks):
            raise OptionError("check_ranks", f"got {self.check_ranks!r}; accepted: True (every rank), False, or a "
                              "torch.distributed ProcessGroup (its ranks)")
        wait = self.check_ranks_timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise OptionError("check_ranks_timeout", f"got {wait!r}; accepted: a number of seconds > 0")
        nodes = self.solver_node_limit
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise OptionError("solver_node_limit", f"got {nodes!r}; accepted: an int >= 1 (branch-and-bound nodes)")
        resolve_profile(self.device_profile)

    def _check_selection_has_a_choice(self) -> None:
        """``select="measured"`` times strategy auto's plans under a memory budget: with another strategy, or
        without that budget, there is one plan and nothing to time, and the option would be ignored unsaid."""
        if self.select != "measured":
            if self.select_steps != SELECT_STEPS:
                raise OptionError("select_steps", f"select_steps={self.select_steps!r} with select={self.select!r}: "
                                  "it counts measured selection's timed steps; accepted: select='measured' with it",
                                  named=True)
            return
        if self.strategy != "auto" or self.memory_budget is None:
            given = (f"strategy={self.strategy!r}" if self.strategy != "auto" else
                     "no memory_budget" + (f" (device_budget={self.device_budget!r})" if self.device_budget else ""))
            raise OptionError("select", f"select='measured' with {given}: it times strategy auto's plans that meet a "
                              "memory budget, and here there is one plan; accepted: select='measured' with "
                              "strategy='auto' and a memory_budget", named=True)

    @property
    def plan_options(self) -> PlanOptions:
        return PlanOptions(
            min_bytes=self.min_bytes, budget=parse_budget(self.memory_budget), solver=self.solver,
            on_infeasible=self.on_infeasible, time_limit=float(self.solver_time_limit),
            node_limit=self.solver_node_limit, strategy=self.strategy,
            cross_graphs=self.cross_graphs, all_eligible=self.all_eligible,
            runs=1 if self.runs_per_step == "auto" else self.runs_per_step,
            host_bytes=_device_bytes("host_budget", self.host_budget),
            device_bytes=None if self.device_budget is None else self.device_budget_bytes - self.reserved_bytes,
            max_overhead=parse_overhead(self.max_overhead),
            fused_kernels=self.inner == "inductor",
        )

    @property
    def device_budget_bytes(self) -> int | None:
        """``device_budget`` in bytes (None: no device budget)."""
        return _device_bytes("device_budget", self.device_budget)

    @property
    def reserved_bytes(self) -> int:
        """``reserved`` in bytes."""
        return _device_bytes("reserved", self.reserved, allow_zero=True)

    @property
    def profile(self) -> DeviceProfile:
        return resolve_profile(self.device_profile)


def _device_bytes(name: str, value: Any, allow_zero: bool = False) -> int | None:
    """Bytes of a device_budget, reserved or host_budget value: an int, or a size string; no fraction."""
    if value is None or (allow_zero and value == 0 and not isinstance(value, bool)):
        return None if value is None else 0
    accepted = ("an int number of bytes > 0, or a size string such as '70GiB' or '512MB' (KB/MB/GB are powers "
                "of 10, KiB/MiB/GiB of 2)")
    try:
        budget = _budget_of(value)  # one byte too: fit plans a device budget of one byte for the smallest peak
    except ValueError:
        budget = None
    if budget is None or budget.nbytes is None:
        raise OptionError(name, f"got {value!r}; accepted: " + ("0, " if name == "reserved" else "None, ")
                          + accepted)
    return budget.nbytes


def _is_process_group(value: Any) -> bool:
    import torch.distributed as dist  # here: only a process group given as check_ranks needs it

    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def _check_int(name: str, value: Any, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(name, f"got {value!r}; accepted: an int >= 0" + (f" {also}" if also else ""))


def _check_choice(name: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise OptionError(name, f"got {value!r}; accepted: {', '.join(map(repr, accepted))}")


def config_from_options(options: Mapping[str, Any] | None) -> OffloadConfig:
    """Build a config from keyword options, rejecting unknown keys by name."""
    options = dict(options or {})
    known = [f.name for f in dataclasses.fields(OffloadConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise OptionError(unknown[0], f"unknown fxoffload option(s) {', '.join(map(repr, unknown))}; accepted: "
                          f"{', '.join(known)}", named=True)
    return OffloadConfig(**options)
