"""One budget for the whole step (``memory_budget`` or ``device_budget``): the step's shape, as its first
backward shows it, and each compiled region's share of the budget, in rounds.

A training step may run several compiled regions: graphs split by graph breaks (an embedding before
a ``.item()``, a loss compiled apart), blocks compiled one at a time to distinct graphs (a per-block
attribute dynamo guards on), one graph serving several layers. When a step's first backward begins,
:meth:`StepBudget.learn` takes from the step's forwards which regions ran, in what order (of their
first forward) and how often (:class:`StepShape`), with each region's activation figures
(:class:`RunFigures`, from its plans). At each region's next forward the backend asks for its share
(:meth:`StepBudget.share`, by ``fxoffload.passes.shares``) and re-plans it with that share.

Rounds. A region's first plan saw only itself and counted what it hands on (under a fraction), so
the least it reaches in the step's accounting (an activation one region hands the next counted where
it is saved) is known only once it has been planned with a share. A region short of its share in
the first round runs at its smallest peak for one step (:meth:`StepBudget.fell_short`), and a second
round shares the budget with that floor known; the last round's shortfall is the step's error. A floor
is a region's smallest peak and the least it can leave for its backward (``Plan.held_least``: every
candidate moved, which reaches that peak too), not what its cheapest plan at that peak leaves (it keeps
what is born after the peak); and a region short of its own share still keeps to its held cap, raised
to that least where it must (:func:`plan_within_cap`): the regions after it run on top of it.

A moved budget. Under a fraction, the step's budget in bytes is a fraction of the step's figures, and
they change once the regions are planned with shares: a first plan counts what its region hands the next
(the logits, a checkpointed layer's output) as its own, and so does the region that saves it; a plan with
a share counts it once, where it is saved. A region whose share was cut from a budget since moved is
planned again, in the same round (:meth:`StepBudget.moved`), and the round is not settled on it; a
budget that keeps moving past that (``BUDGET_MOVES``) is not chased, so as not to recompile each step.

A device budget. The step's device peak is every region's graph inputs over its runs (parameters,
the batch: resident all step) plus, at each region's peak, what the regions before it hold, what its
runs create, and under its backward the gradients the later regions' backwards left in ``.grad``
(they ran first). So the budget the shares split is the device budget less every region's inputs
(:meth:`StepBudget.budget_bytes`), each region's demand is what its runs create with the later
regions' gradients under it, and its plan gets its share plus its own inputs as its device budget,
the later gradients as ``PlanOptions.backward_gradients`` (:meth:`StepBudget.device_cap`). One
graph serving several layers is shared so too (its other runs' parameters count; its first run's
backward runs on top of the other runs' gradients: ``PlanOptions.run_gradients``). A gradient is a
parameter's (a leaf's: ``fxoffload.backend.compile_call.leaf_gradient_bytes``), as big as it.

Limits: the shape is the latest step's; a region that ran in an earlier step only is not in it.
Under a device budget, the first step's plans see only the regions before them (the step may exceed
it), eager code between regions is not seen (its tensors belong in ``reserved``), a region's later
gradients are counted over its whole backward, and a parameter two regions share counts twice.
Figures come from the region's latest plan with a share, else its first plan (its floors less what
it hands on, which a first plan counts as its own). Interleaved schedules
(several microbatches in flight) are modelled as one forward pass then one backward pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from fxoffload.passes import (
    Budget, BudgetInfeasibleError, BudgetInfeasibleWarning, Plan, PlanOptions, RegionDemand, Share, share_for,
    step_peak,
)

__all__ = [
    "SHARE_ROUNDS", "RunFigures", "StepBudget", "StepRegion", "StepShape", "learn_step", "plan_within_cap",
    "run_figures",
]

log = logging.getLogger(__name__)

# Rounds of shares (see the module docstring).
SHARE_ROUNDS = 2
# Times the step's budget in bytes may move before a plan whose share it moved is no longer planned
# again for it: once as the shares take over from the first plans' figures; a step whose figures keep
# moving (a region that runs a different number of times each step) would otherwise recompile each step.
BUDGET_MOVES = 1


@dataclass(frozen=True)
class RunFigures:
    """One run's bytes of a graph (predicted): without offloading, what the run leaves for its backward
    (``held``) and its peak; the same under a plan that reached its smallest peak, as the floor the graph
    is known to reach (0 where not known). Under a device budget the peaks are of every tensor the run
    creates (its device peak less its graph inputs), and ``inputs`` (its graph inputs: parameters, batch,
    resident all step) and ``gradients`` (what its backward leaves in ``.grad``) are known; else 0."""

    held: int
    peak: int
    floor_held: int = 0
    floor_peak: int = 0
    inputs: int = 0
    gradients: int = 0


def run_figures(plan: Plan, largest_saved_input: int = 0, gradients: int = 0, device: bool = False) -> RunFigures:
    """:class:`RunFigures` from a plan's figures over its runs (the min-cut pair's, without offloading,
    whichever partition strategy auto took); a plan that missed its budget is at its smallest peak.
    ``largest_saved_input``: the largest activation an earlier graph hands it that it saves, which is
    back on the device for its backward whatever the plan (a loss compiled apart saves the logits it
    is handed): a floor of its peak where the plan's own figures do not count it. ``device``: the
    device figures (every tensor the runs create), with ``gradients`` (one run's, in ``.grad``)."""
    runs = plan.runs
    held = plan.held_before // runs
    inputs, gradients = (plan.input_bytes, gradients) if device else (0, 0)

    def peak_of(when: str, run_held: int) -> int:  # one run's peak ("before" or "after" the plan), on the others'
        whole = getattr(plan, f"device_peak_{when}") - inputs if device else getattr(plan, f"step_peak_{when}")
        return whole - (runs - 1) * run_held

    peak = peak_of("before", held)
    if plan.feasible:
        return RunFigures(held, peak, 0, largest_saved_input, inputs, gradients)
    floor_peak = peak_of("after", plan.held_after // runs)
    # The least a run leaves (every candidate moved, at the smallest peak too), not the cheapest plan's hold:
    # the regions after it run on top of it, and a budget out of reach asks each region for its floors.
    least = plan.held_least if plan.held_least is not None else plan.held_after
    return RunFigures(held, peak, least // runs, max(floor_peak, largest_saved_input), inputs, gradients)


@dataclass(frozen=True)
class StepRegion:
    """One compiled region of the step: its key, its runs in the step, one run's figures."""

    region: tuple
    runs: int
    figures: RunFigures

    @property
    def demand(self) -> RegionDemand:
        """Its bytes over its runs: each run after the first on top of what the earlier runs hold."""
        f, extra = self.figures, self.runs - 1
        return RegionDemand(self.runs * f.held, f.peak + extra * f.held, self.runs * f.floor_held,
                            f.floor_peak + extra * f.floor_held if f.floor_peak else 0)


@dataclass(frozen=True)
class StepShape:
    """The step's regions, in the order their forwards first ran."""

    regions: tuple[StepRegion, ...]

    def index(self, region: tuple) -> int | None:
        return next((k for k, r in enumerate(self.regions) if r.region == region), None)

    def demands(self, device: bool = False) -> list[RegionDemand]:
        """Each region's demand; under a device budget its peak also holds the gradients the later regions'
        backwards left (they ran before its backward: what its own backward makes comes on top of them)."""
        demands = [r.demand for r in self.regions]
        if not device:
            return demands
        return [dataclasses.replace(d, peak=d.peak + self.later_gradients(k),
                                    floor_peak=d.floor_peak + self.later_gradients(k) if d.floor_peak else 0)
                for k, d in enumerate(demands)]

    def later_gradients(self, k: int) -> int:
        """What the backwards of the regions after the ``k``-th leave in ``.grad``, every run (its own runs'
        gradients are in its plan: ``PlanOptions.run_gradients``)."""
        return sum(r.runs * r.figures.gradients for r in self.regions[k + 1:])

    def resident(self) -> int:
        """The graph inputs of every region, every run (parameters, batch): on the device all step."""
        return sum(r.runs * r.figures.inputs for r in self.regions)

    def peak_before(self) -> int:
        """The step's activation peak without offloading (predicted): what a fraction is a fraction of."""
        return step_peak(self.demands())

    def budget_bytes(self, budget: Budget) -> int:
        return budget.nbytes if budget.nbytes is not None else int(budget.fraction * self.peak_before())


def learn_step(known: StepShape | None, records: Sequence[Any], region_of: Mapping[int, tuple],
               counted: Mapping[tuple, int], shared: Callable[[Any], bool], device: bool = False) -> StepShape:
    """The shape of the step whose forward invocations ran ``records`` (in order); ``region_of``: each
    record's region (by record index); ``counted``: the most runs of each region counted in one step;
    ``shared``: whether a record was planned with a share of the step's budget.

    A region's figures come from its plan with a share where it has one (the step's accounting: an
    activation one region hands the next counts where it is saved), else from its first plan; a floor
    found is kept (the most of those found); a first plan's, less what it hands on (which it counts as
    its own, under a fraction, and the step's accounting where it is saved).
    ``device``: the figures of a device budget."""
    order: dict[tuple, Any] = {}
    for record in records:
        order.setdefault(region_of[record.index], record)
    kept = {r.region: r.figures for r in known.regions} if known is not None else {}
    return StepShape(tuple(StepRegion(region, counted.get(region, 1),
                                      _figures(kept.get(region), record, shared, device))
                           for region, record in order.items()))


def _figures(known: RunFigures | None, record: Any, shared: Callable[[Any], bool], device: bool) -> RunFigures:
    if known is not None and not shared(record):
        return known
    found = run_figures(record.plan, record.largest_saved_input, record.gradient_bytes if device else 0, device)
    if not shared(record) and not device and found.floor_held:
        # A first plan's floor counts what the region hands on as its own (the logits, a checkpointed
        # layer's output: ``Lifetime.handed_on``), which the step's accounting counts where it is saved:
        # kept whole, it let a region hold that much more while the one it hands on to could not meet
        # its share. Less those bytes, it is a floor of the step's.
        handed = sum(lt.nbytes for lt in record.timeline.lifetimes if lt.handed_on)
        found = dataclasses.replace(found, floor_held=max(found.floor_held - handed, 0),
                                    floor_peak=max(found.floor_peak - handed, record.largest_saved_input))
    if known is None:
        return found
    return dataclasses.replace(found, floor_held=max(found.floor_held, known.floor_held),
                               floor_peak=max(found.floor_peak, known.floor_peak))


class StepBudget:
    """The step's budget across its compiled regions: the step's shape, each region's share, and
    the round of shares regions are re-planned in (see the module docstring). Regions are the
    backend's keys; records are its ``GraphRecord`` s (read: ``index``, ``plan``, ``step_share``,
    ``step_round``, ``largest_saved_input``, ``gradient_bytes``). ``device_bytes``: a device budget (less
    what is reserved), split instead of ``budget``: see :meth:`device_cap`."""

    def __init__(self, budget: Budget | None, device_bytes: int | None = None) -> None:
        self.budget = None if device_bytes is not None else budget
        self.device_bytes = device_bytes
        self.shape: StepShape | None = None
        self.shares: dict[tuple, Share] = {}
        self.round = 0
        self._short = False  # a region fell short of its share in this round: the next step starts another
        self._settled = -1  # the latest round in which every region met its share
        self._budget_bytes: int | None = None  # the step's budget in bytes at the last learn()
        self._moves = 0  # how often it changed from one learn() to the next

    def learn(self, records: Sequence[Any], region_of: Mapping[int, tuple], counted: Mapping[tuple, int]) -> None:
        """The step whose first backward begins ran ``records`` (its forwards, in order): its shape, and
        the next round if a region fell short of its share in this one."""
        self.shape = learn_step(self.shape, records, region_of, counted, lambda record: record.step_share is not None,
                                self.device_bytes is not None)
        if self._budget_bytes is not None and self.budget_bytes() != self._budget_bytes:
            self._moves += 1
        self._budget_bytes = self.budget_bytes()
        if self._short:
            self.round, self._short = self.round + 1, False
            return
        current = [r for r in records if r.step_round == self.round]
        if current and not any(self.moved(r) for r in current):  # (shares cut from a budget since moved: not yet)
            self._settled = self.round

    def earlier(self, region: tuple) -> list[tuple]:
        """The regions that run before ``region`` in the step."""
        return [r.region for r in self.shape.regions[:self.shape.index(region)]]

    def share(self, region: tuple, held_before: Callable[[list[tuple]], int]) -> Share | None:
        """``region``'s share, once the step has shown more than one region (under a device budget, or one
        region that runs several times); ``held_before``: what the regions before it hold as planned now
        (the backend's ledger)."""
        shape = self.shape
        if self.budget_bytes() is None or shape.index(region) is None:
            return None
        # One region alone has the whole budget; under a device budget, not if it runs several times
        # (one graph serving several layers): the other runs' parameters and gradients count too.
        if len(shape.regions) < 2 and (self.device_bytes is None or shape.regions[0].runs < 2):
            return None
        k = shape.index(region)
        demands = shape.demands(self.device_bytes is not None)
        return share_for(self.budget_bytes(), held_before(self.earlier(region)), demands[k:])

    def device_cap(self, region: tuple, share: Share) -> tuple[int, int]:
        """The device budget (less reserved) a region's plan gets for ``share``, and the gradients its backward
        runs on top of: the share bounds what its runs create on top of what the regions before it hold,
        with the other regions' graph inputs (resident all step) set aside; the later regions' backwards
        left their gradients (``PlanOptions.backward_gradients``); its own inputs count in its plan's
        device peak."""
        k = self.shape.index(region)
        return share.budget + self.shape.regions[k].figures.inputs, self.shape.later_gradients(k)

    def stale(self, record: Any) -> bool:
        """Whether a region's plan, given a share now, predates this round (or had none), or shares a step
        budget in bytes that has moved since (see :meth:`moved`)."""
        return record is None or record.step_round < self.round or self.moved(record)

    def moved(self, record: Any) -> bool:
        """Whether the step's budget in bytes is no longer the one ``record``'s share was cut from. Under a
        fraction it moves once: the first shares are cut from the regions' first plans, which each count
        what they hand the next region (a checkpointed layer's output, the logits) as their own, and so
        do the regions that save it; the plans made with shares count it once, where it is saved. A budget
        that moves more often than BUDGET_MOVES is no longer chased (the rounds decide alone)."""
        return (record.step_share is not None and record.step_budget != self.budget_bytes()
                and self._moves <= BUDGET_MOVES)

    def final(self, record: Any) -> bool:
        """Whether a region's plan is final: planned without a share, or with one of the step's budget as
        it stands and in a round every region met its share in, or in the last round."""
        if record is None or record.step_share is None:
            return True
        if self.moved(record):
            return False
        return record.step_round <= self._settled or record.step_round >= SHARE_ROUNDS - 1

    @contextlib.contextmanager
    def sharing(self, region: tuple, share: Share | None) -> Iterator[None]:
        """Inside: ``region`` planned with ``share`` (None: as it is). Kept once the block ends; if the block
        raises (a re-plan that failed), the region is left without a share, to be given one again at its
        next forward."""
        if share is not None:
            self.shares[region] = share
        try:
            yield
        except BaseException:
            self.shares.pop(region, None)
            raise

    def may_retry(self, region: tuple) -> bool:
        """Whether a region short of its share may run at its smallest peak until the next round."""
        return region in self.shares and self.round < SHARE_ROUNDS - 1

    def fell_short(self) -> None:
        self._short = True

    def budget_bytes(self) -> int | None:
        """The step's budget in bytes: of saved activations under a memory budget; under a device budget, of
        the tensors the step creates (the device budget less every region's graph inputs)."""
        if self.shape is None:
            return None
        if self.device_bytes is not None:
            return self.device_bytes - self.shape.resident()
        return None if self.budget is None else self.shape.budget_bytes(self.budget)


def plan_within_cap(plan: Callable[[PlanOptions], tuple], options: PlanOptions) -> tuple:
    """``plan(options)``; under a held cap (a share of the step's budget) that the region cannot keep to,
    planned with the cap raised to the least it can leave for the backward (every candidate moved: the
    error's ``least_held``): it takes what it needs, and the regions after it get less. Where its own
    budget is out of reach too, the plan (under ``options.on_infeasible="warn"``) is at its smallest peak
    and leaves no more than that raised cap: the regions after it run on top of what it leaves."""
    if options.held_cap is None:
        return plan(options)
    strict = dataclasses.replace(options, on_infeasible="error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetInfeasibleWarning)
            return plan(strict)
    except BudgetInfeasibleError as error:
        refused, least = error, error.least_held
    if least is None:  # (not a plan's error: the forced copies over the host budget)
        return plan(dataclasses.replace(options, held_cap=None))
    raised = max(options.held_cap, least)
    if raised == options.held_cap and strict == options:
        raise refused  # (the cap holds, the budget does not: the same plan would refuse the same way)
    if raised > options.held_cap:
        log.info("fxoffload: a region cannot keep what it leaves for the backward to its share of the step's "
                 "budget (%d B): planned for %d B", options.held_cap, raised)
    return plan(dataclasses.replace(options, held_cap=raised))
