"""The step's shape, as its first backward shows it, and the step's memory budget in bytes.

A training step may run several compiled regions: graphs split by graph breaks (an embedding before
a ``.item()``, a loss compiled apart), blocks compiled one at a time to distinct graphs (a per-block
attribute dynamo guards on), one graph serving several layers. The backend counts, when the step's
first backward begins, which regions ran, in what order (of their first forward) and how often
(:func:`learn_step`); ``fxoffload.passes.shares`` then splits the budget across them, and each region
is re-planned once with its share (``fxoffload.backend``).

Each region's figures (:class:`RunFigures`: one run's activation bytes without offloading, and the
floor its first plan showed where that plan missed its budget) are taken from the first record seen
for it and kept, so that re-plans do not change what the step's fraction is a fraction of.

Limits: the shape is the latest step's whose regions differ from the one known (a new region, a
changed count); a region that ran in an earlier step only is not in it. Interleaved schedules
(several microbatches in flight) are modelled as one forward pass then one backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from fxoffload.passes.planning import Budget, Plan
from fxoffload.passes.shares import RegionDemand, step_peak

__all__ = ["RunFigures", "StepRegion", "StepShape", "learn_step", "run_figures"]


@dataclass(frozen=True)
class RunFigures:
    """One run's saved-activation bytes of a graph (predicted): without offloading, what the run leaves
    for its backward (``held``) and its peak; the same under a plan that reached its smallest peak, as
    the floor the graph is known to reach (0 where not known)."""

    held: int
    peak: int
    floor_held: int = 0
    floor_peak: int = 0


def run_figures(plan: Plan, largest_saved_input: int = 0) -> RunFigures:
    """:class:`RunFigures` from a plan's figures over its runs (the min-cut pair's, without offloading,
    whichever partition strategy auto took); a plan that missed its budget is at its smallest peak.
    ``largest_saved_input``: the largest activation an earlier graph hands it that it saves, which is
    back on the device for its backward whatever the plan (a loss compiled apart saves the logits it
    is handed): a floor of its peak where the plan's own figures do not count it."""
    runs = plan.runs
    held = plan.held_before // runs
    peak = plan.step_peak_before - (runs - 1) * held
    if plan.feasible:
        return RunFigures(held, peak, 0, largest_saved_input)
    floor_held = plan.held_after // runs
    return RunFigures(held, peak, floor_held,
                      max(plan.step_peak_after - (runs - 1) * floor_held, largest_saved_input))


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

    def demands(self) -> list[RegionDemand]:
        return [r.demand for r in self.regions]

    def peak_before(self) -> int:
        """The step's activation peak without offloading (predicted): what a fraction is a fraction of."""
        return step_peak(self.demands())

    def budget_bytes(self, budget: Budget) -> int:
        return budget.nbytes if budget.nbytes is not None else int(budget.fraction * self.peak_before())


def learn_step(known: StepShape | None, records: Sequence[Any], region_of: Mapping[int, tuple],
               counted: Mapping[tuple, int], shared: Callable[[Any], bool]) -> StepShape:
    """The shape of the step whose forward invocations ran ``records`` (in order); ``region_of``: each
    record's region (by record index); ``counted``: the most runs of each region counted in one step;
    ``shared``: whether a record was planned with a share of the step's budget.

    A region's figures come from its plan with a share where it has one (the step's accounting: an
    activation one region hands the next counts where it is saved), else from its first plan; a floor
    once found is kept (the most of those found)."""
    order: dict[tuple, Any] = {}
    for record in records:
        order.setdefault(region_of[record.index], record)
    kept = {r.region: r.figures for r in known.regions} if known is not None else {}
    return StepShape(tuple(StepRegion(region, counted.get(region, 1), _figures(kept.get(region), record, shared))
                           for region, record in order.items()))


def _figures(known: RunFigures | None, record: Any, shared: Callable[[Any], bool]) -> RunFigures:
    if known is not None and not shared(record):
        return known
    found = run_figures(record.plan, record.largest_saved_input)
    if known is None:
        return found
    return RunFigures(found.held, found.peak, max(found.floor_held, known.floor_held),
                      max(found.floor_peak, known.floor_peak))
