"""The step the backend compiles for, behind one object: its ledger and its memory budget.

Inputs: the backend's options (``OffloadConfig``), then what the backend sees as the step runs: each
plan of a region, each forward and backward, the inputs callers kept. Outputs: the answers the backend
asks for: a region's plan options (what the regions before it hold, its share of the step's budget),
whether a region must be planned again and with which share, what a refusal says about the step.

:class:`StepCoordinator` owns a :class:`~fxoffload.backend.step_ledger.StepLedger` (what each region
holds and how often it runs) and a :class:`~fxoffload.backend.step_budget.StepBudget` (the step's shape
and each region's share, in rounds); the backend reads and writes neither directly.

Algorithm: none of its own; each question is answered from the two as their modules say.
Limits: one coordinator per backend, which serves one step (as the ledger does).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

from fxoffload.backend.callers import KeptInput
from fxoffload.backend.step_budget import StepBudget, StepRegion
from fxoffload.backend.step_ledger import StepLedger
from fxoffload.config import OffloadConfig
from fxoffload.explain import format_bytes
from fxoffload.passes import Budget, BudgetInfeasibleError, KeptSource, PlanOptions, Share

__all__ = ["StepCoordinator", "StepFields"]

# A budget in bytes is the step's under dynamic shapes too: the regions are planned in compile order, each with
# what the earlier ones leave of it, and no output is counted twice.
ADVICE_BYTES = "pass a budget in bytes (memory_budget='<size>', e.g. '2GiB'), which bounds the step's graphs together"


@dataclass(frozen=True)
class StepFields:
    """What a region's record says of the step it was planned in: its share of the step's budget (None:
    planned without one), the step's budget in bytes then, and the round of shares."""

    share: Share | None
    budget_bytes: int | None
    round: int  # -1: no share


class StepCoordinator:
    """The step's ledger and memory budget, answering the backend (see the module docstring)."""

    def __init__(self, config: OffloadConfig) -> None:
        self._config = config
        self._ledger = StepLedger(config.runs_per_step)
        options = config.plan_options
        self._budget = StepBudget(options.budget, options.device_bytes)

    # ----------------------------------------------------------------------------- what the step is

    def invocations(self) -> list[Any]:
        return self._ledger.invocations()

    def caller_kept(self) -> list[tuple[KeptSource, ...]]:
        return self._ledger.caller_kept()

    def host_total(self) -> int:
        return self._ledger.host_total()

    def place(self, region: tuple) -> int:
        return self._ledger.place(region)

    def regions(self) -> tuple[StepRegion, ...] | None:
        """The step's regions in order, once its first backward has shown them."""
        return None if self._budget.shape is None else self._budget.shape.regions

    def counted(self, region: tuple) -> bool:
        """Whether a step has counted ``region``'s runs."""
        return region in self._ledger.counted

    @property
    def backward_seen(self) -> bool:
        return self._ledger.backward_seen

    # ----------------------------------------------------------------------------- planning a region

    def options_for(self, region: tuple) -> tuple[PlanOptions, int]:
        """The plan options of ``region``, and the bytes earlier regions hold: an absolute budget is for
        the whole step, so a region gets what earlier regions leave of it; once the step is known, a
        region re-planned with its share of the budget gets that share."""
        ledger = self._ledger
        options = dataclasses.replace(self._config.plan_options, runs=ledger.runs_of(region),
                                      interleaved=ledger.interleaved)
        earlier = ledger.earlier(region, self._budget)
        if options.host_bytes is not None:  # the step's host budget, less what earlier regions' copies take
            options = dataclasses.replace(options, host_bytes=max(options.host_bytes - ledger.host_before(earlier), 0))
        held = ledger.held_before(earlier)
        if (share := self._budget.shares.get(region)) is not None:
            # The step's accounting: an activation one region hands the next counts in the curve of the
            # region that saves it (which may offload it: a layer's input), never in both.
            shared = dict(held_cap=share.held_cap, count_outputs=False,
                          kept_inputs=ledger.kept_inputs.get(region, frozenset()))
            if options.device_bytes is not None:
                cap, gradients = self._budget.device_cap(region, share)
                return dataclasses.replace(options, device_bytes=max(cap, 1), backward_gradients=gradients,
                                           **shared), held
            return dataclasses.replace(options, budget=Budget(nbytes=share.budget), **shared), held
        if options.device_bytes is not None:  # before the step is known: what the regions so far take
            taken = held + ledger.inputs_before(earlier)
            return (dataclasses.replace(options, device_bytes=max(options.device_bytes - taken, 1)) if taken
                    else options), held
        if options.budget is None or options.budget.nbytes is None or not held:
            return options, held
        return dataclasses.replace(options, budget=Budget(nbytes=max(options.budget.nbytes - held, 1))), held

    def may_retry(self, region: tuple) -> bool:
        return self._budget.may_retry(region)

    def fell_short(self) -> None:
        """A region re-planned with its share could not meet it: the next step starts another round."""
        self._budget.fell_short()

    def has_share(self, region: tuple) -> bool:
        return region in self._budget.shares

    def fields(self, region: tuple) -> StepFields:
        """What ``region``'s record keeps of the step it is planned in now."""
        if region not in self._budget.shares:
            return StepFields(None, None, -1)
        return StepFields(self._budget.shares[region], self._budget.budget_bytes(), self._budget.round)

    def may_wait(self, region: tuple, handed_activations: bool, replannable: bool, held_before: int) -> bool:
        """Whether a region whose budget is out of reach may run the first step provisionally, to be
        re-planned once the step is known: under runs_per_step="auto", before the step has counted it,
        when it is handed an activation (it may serve several layers), or under a memory budget that
        the rest of the step may make room for (a fraction, or bytes that earlier regions took some of).
        An absolute budget out of reach with nothing before it is out of reach for the step."""
        if not replannable or region in self._ledger.counted or region in self._budget.shares:
            return False
        options = self._config.plan_options
        if handed_activations:
            return True
        if options.device_bytes is not None:  # the rest of the step may make room once it is known
            return held_before > 0
        return options.budget is not None and (options.budget.nbytes is None or held_before > 0)

    def note_record(self, index: int, region: tuple) -> None:
        self._ledger.note_record(index, region)

    def note_plan(self, region: tuple, held: int, host: int, spill: int, inputs: int) -> None:
        self._ledger.note_plan(region, held, host, spill, inputs)

    # ----------------------------------------------------------------------------- planning again

    def share(self, region: tuple) -> Share | None:
        """``region``'s share of the step's budget as the regions before it are planned now (None: no share)."""
        return self._budget.share(region, self._ledger.held_before)

    def needs_replan(self, region: tuple, record: Any, share: Share | None) -> bool:
        """Whether the step, as counted, asks for another plan of ``region``: forwards seen to run between
        its backwards since it was planned, more runs than planned, a provisional plan, or a share of a
        step of several regions in a round it was not planned in (its first plan saw only itself, and
        counted what it hands on under a fraction, not in the step's accounting)."""
        if record is not None and record.plan.interleaved != self._ledger.interleaved:
            return True  # forwards were seen to run between the backwards since it was planned
        if share is not None:
            return self._budget.stale(record)
        planned = record.plan.runs if record is not None else self._ledger.runs_of(region)
        return self._ledger.counted[region] > planned or (record is not None and record.provisional)

    def final(self, record: Any) -> bool:
        return self._budget.final(record)

    def counted_runs(self, region: tuple) -> int:
        return self._ledger.counted[region]

    @contextlib.contextmanager
    def replanning(self, region: tuple, share: Share | None) -> Iterator[None]:
        """Inside: ``region`` planned for the runs a step counted and with ``share`` (see
        ``StepLedger.planning_runs`` and ``StepBudget.sharing``: kept once the block ends, undone if it raises)."""
        with self._ledger.planning_runs(region, self._ledger.counted[region]), self._budget.sharing(region, share):
            yield

    # ----------------------------------------------------------------------------- the step running

    def forward_begins(self, waiting: bool) -> bool:
        """A forward of the step begins (before any re-plan it asks for), ``waiting``: whether an earlier
        forward still waits for its backward. The ledger learns whether forwards run between the step's
        backwards; True where the step begins again (``StepLedger.forward_begins``)."""
        return self._ledger.forward_begins(waiting)

    def note_forward(self, record: Any, region: tuple) -> int:
        """A forward of the step ran ``record``'s graph for ``region``; the index of this run in the step."""
        self._ledger.note_forward(record)
        self._ledger.count_forward(region)
        return len(self._ledger.records) - 1

    def warn_held(self, region: tuple) -> None:
        budget = self._config.plan_options.budget
        if budget.nbytes is None:  # a fraction, of a graph never re-planned (symbolic sizes)
            self._ledger.warn_per_run(region, self._config.memory_budget)
        else:
            self._ledger.warn_held(region, budget.nbytes, self._config.memory_budget)

    def note_backward(self) -> bool:
        """A backward begins; whether it is the step's first (its last forward's)."""
        return self._ledger.note_backward()

    def learn(self, kept: list[KeptInput]) -> None:
        """The step's first backward begins, its callers having kept ``kept``: note them, and learn the step."""
        ledger = self._ledger
        kept_before = dict(ledger.kept_inputs)
        ledger.note_kept(kept)
        if not ledger.records:
            return
        if any(ledger.kept_inputs[r] != kept_before.get(r) for r in ledger.kept_inputs if r in self._budget.shares):
            # A region re-planned with its share offloaded an input its caller keeps: that copy freed
            # nothing, so its share was not met; the next round counts the input where it stays.
            self._budget.fell_short()
        self._budget.learn(ledger.records, ledger.region_of, ledger.counted)

    # ----------------------------------------------------------------------------- refusals

    def in_step(self, error: BudgetInfeasibleError, region: tuple, held_before: int,
                options: PlanOptions, symbolic: bool = False) -> BudgetInfeasibleError:
        """``error``, saying what earlier regions of the step took of an absolute budget, or of the step's;
        for a fraction out of reach in a graph of symbolic sizes (``symbolic``: not re-planned with a share
        of the step), that the fraction is this graph's, and that a budget in bytes is the step's."""
        place = self._ledger.place(region)
        if region in self._budget.shares:
            return error.within(self._context(region, place, held_before, error.smallest))
        if symbolic and type(error) is BudgetInfeasibleError and options.budget is not None \
                and options.budget.nbytes is None:
            return BudgetInfeasibleError(
                f"compiled region {place} (dynamic shapes: the step is not re-planned with shares of its budget, so "
                f"the fraction is of this graph's own activation peak, the outputs it hands to the rest of the step "
                f"counted until its forward returns): {error.reason}", error.smallest, error.budget,
                (ADVICE_BYTES, *error.advice), least_held=error.least_held)
        if not held_before or options.budget is None or options.budget.nbytes is None:
            return error
        return error.within(
            f"compiled region {place}: "
            f"earlier regions of the step hold {held_before} B of activations after their forward "
            f"(predicted), leaving {options.budget.nbytes} B of memory_budget={self._config.memory_budget!r} "
            f"for this one; ")

    def _context(self, region: tuple, place: int, held_before: int, smallest: int) -> str:
        """Where the step's budget went, for the error of a region that cannot keep to its share, and the
        step's floor as planned: what the regions before it hold, plus its own smallest peak."""
        shape, ledger = self._budget.shape, self._ledger
        earlier = shape.regions[:shape.index(region)]
        holds = ", ".join(f"region {ledger.place(r.region)} {format_bytes(ledger.held.get(r.region, 0) * r.runs)}"
                          + (f" ({r.runs} runs)" if r.runs > 1 else "") for r in earlier) or "none"
        if self._budget.device_bytes is not None:
            return (f"the step ({_regions_words(shape.regions)}, predicted): device_budget="
                    f"{self._config.device_budget!r} leaves {self._budget.budget_bytes()} B for the tensors the step "
                    f"creates, after reserved and every region's graph inputs ({shape.resident()} B); the regions "
                    f"before region {place} hold {held_before} B after their forward ({holds}), and the later "
                    f"regions' backwards leave {shape.later_gradients(shape.index(region))} B of gradients, leaving "
                    f"{_left_words(self._budget.shares[region].budget - shape.later_gradients(shape.index(region)))} "
                    f"for what region {place} creates; ")
        budget = self._config.memory_budget
        return (f"the step ({_regions_words(shape.regions)}, predicted): memory_budget={budget!r} is "
                f"{self._budget.budget_bytes()} B for the whole step, of {shape.peak_before()} B without offloading; "
                f"the regions before region {place} hold {held_before} B after their forward ({holds}), leaving "
                f"{_left_words(self._budget.shares[region].budget)} for region {place}; with them as planned, the "
                f"step's activation peak is at least {held_before + smallest} B "
                f"({(held_before + smallest) / max(shape.peak_before(), 1):.2f} of it without offloading); ")


def _regions_words(regions: tuple[StepRegion, ...]) -> str:
    """The step's compiled regions in words: "6 compiled regions", or "1 compiled region, 6 runs"."""
    if len(regions) == 1:
        return f"1 compiled region, {regions[0].runs} runs"
    return f"{len(regions)} compiled regions"


def _left_words(nbytes: int) -> str:
    """What a share leaves a region, in words: nothing, and by how much, where it is below nothing."""
    return f"{nbytes} B" if nbytes >= 0 else f"nothing ({-nbytes} B short)"
