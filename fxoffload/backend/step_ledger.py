"""The step's ledger: what each compiled region of a step holds and how often it runs, as the backend learns it.

A step runs several compiled regions (one graph serving every layer, DDP's buckets, a pipeline's
stages), each planned on its own; a memory budget is the step's, so each region's plan must know
what the regions before it leave on the device. The backend keeps, in one :class:`StepLedger`:

* per region, in the order regions were first compiled (the forward's order): the activation
  bytes one run leaves for its backward, its graph inputs' bytes (what a device budget counts of
  the regions before a region, until the step is known), the pinned host bytes of one run's copies and what it
  spills into the next region (sources of copies deferred past its forward, copies the next
  backward starts ahead for it), all predicted by its plan; the runs its plan is for, and the
  most counted in one step; the positions of its offloaded inputs a caller kept;
* per step: the record of each forward in the order they ran, and the offloaded inputs their
  callers kept (``fxoffload.backend.callers``), per run.

Algorithm: a new step begins at the first forward after a backward began. A forward that begins
after a backward began while an earlier forward still waits for its backward (the backend's count:
each forward until its backward begins or its graph is freed) shows that forwards run between the
backwards (1F1B): every region is planned so from then on (``PlanOptions.interleaved``). The regions
before a region are, once the step is re-planned with shares of its budget, the step's own order
(``fxoffload.backend.step_budget``); before that, the regions whose forwards ran so far in this step.
What they hold is each run's activations for its backward, plus what the last of them spills.

A forward whose backward never runs (an evaluation forward with gradients on, its loss only logged)
waits no longer once its autograd graph is freed; where a step's forwards so far are all such, and no
backward began, the step begins again without them (before, a loss logged ahead of the first step had
the graph re-planned for two runs a step, as if forwards ran between backwards).

Limits: every figure is a plan's prediction; one ledger per backend, which serves one step. A forward
whose graph is held without its backward (its output kept across the step) waits until it goes: the
forwards meanwhile count as running between backwards, and their plans count copies started ahead over
the forward, which costs memory, never exactness.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from fxoffload.backend.callers import KeptInput, kept_warning
from fxoffload.passes import KeptSource, warn_from_user
from fxoffload.backend.step_budget import StepBudget

__all__ = ["StepLedger"]

log = logging.getLogger(__name__)


@dataclass
class StepLedger:
    """What each compiled region of the step holds and how often it runs (see the module docstring)."""

    runs_per_step: int | str  # the option: "auto", or the runs every region's plan is for
    held: dict[tuple, int] = field(default_factory=dict)  # activation bytes one run leaves for its backward
    host_held: dict[tuple, int] = field(default_factory=dict)  # pinned host bytes of one run's copies
    spill: dict[tuple, int] = field(default_factory=dict)  # what a run leaves while the next region runs
    inputs: dict[tuple, int] = field(default_factory=dict)  # graph input bytes of one run (parameters, batch)
    runs: dict[tuple, int] = field(default_factory=dict)  # runs each region is planned for, once counted
    counted: dict[tuple, int] = field(default_factory=dict)  # the most runs counted in one step
    forwards: dict[tuple, int] = field(default_factory=dict)  # forwards of each region since a backward began
    kept_inputs: dict[tuple, frozenset[int]] = field(default_factory=dict)  # inputs callers kept, by region
    region_of: dict[int, tuple] = field(default_factory=dict)  # record index -> its region
    records: list[Any] = field(default_factory=list)  # the step's forwards' records, in the order they ran
    backward_seen: bool = False  # a backward of the latest step has begun
    # A forward ran after a backward began while others still waited for theirs (1F1B, interleaved
    # pipeline schedules): copies a backward starts ahead are held through it. Learned once, kept.
    interleaved: bool = False
    kept: dict[int, list[KeptInput]] = field(default_factory=dict)  # offloaded inputs kept, by the step's run
    held_warned: set[tuple] = field(default_factory=set)
    kept_warned: set[int] = field(default_factory=set)  # records (by index) warned about

    def runs_of(self, region: tuple) -> int:
        default = self.runs_per_step
        return self.runs.get(region, 1 if default == "auto" else default)

    def place(self, region: tuple) -> int:
        """A region's position in the step: where it was first compiled, or next if it is new."""
        regions = list(self.held)
        return regions.index(region) if region in self.held else len(regions)

    def earlier(self, region: tuple, step: StepBudget) -> list[tuple]:
        """The regions that run before ``region`` in the step: by the step's shape once it is re-planned
        with a share of the step's budget, else those whose forwards have run so far in this step."""
        if region in step.shares:
            return step.earlier(region)
        if self.backward_seen:  # the step's first forward: nothing before it
            return []
        ran = dict.fromkeys(self.region_of[r.index] for r in self.records)
        return [r for r in ran if r != region]

    def held_before(self, earlier: Sequence[tuple]) -> int:
        """What ``earlier`` regions (in the step's order) hold while the next one runs: each run's activations
        for its backward, and what the last of them spills into the next."""
        held = sum(self.held.get(r, 0) * self.runs_of(r) for r in earlier)
        return held + (self.spill.get(earlier[-1], 0) if earlier else 0)

    def inputs_before(self, earlier: Sequence[tuple]) -> int:
        """The graph inputs of ``earlier`` regions, every run (their parameters: resident all step)."""
        return sum(self.inputs.get(r, 0) * self.runs_of(r) for r in earlier)

    def host_before(self, earlier: Sequence[tuple]) -> int:
        """The pinned host bytes the copies of ``earlier`` regions take, every run."""
        return sum(self.host_held.get(r, 0) * self.runs_of(r) for r in earlier)

    def host_total(self) -> int:
        """The pinned host bytes of every region's copies, every run."""
        return sum(nbytes * self.runs_of(r) for r, nbytes in self.host_held.items())

    @contextlib.contextmanager
    def planning_runs(self, region: tuple, runs: int) -> Iterator[None]:
        """Inside: ``region``'s plans are for ``runs`` runs (what the plan options read). Kept once the block
        ends; the count it had before comes back if the block raises (a re-plan that failed)."""
        before = self.runs.get(region)
        self.runs[region] = runs
        try:
            yield
        except BaseException:
            if before is None:
                del self.runs[region]
            else:
                self.runs[region] = before
            raise

    def note_record(self, index: int, region: tuple) -> None:
        """The record ``index`` is a plan of ``region``."""
        self.region_of[index] = region

    def note_plan(self, region: tuple, held: int, host: int, spill: int, inputs: int = 0) -> None:
        """A plan of ``region``: what one run leaves for its backward, its copies' pinned host bytes, its spill,
        its graph inputs' bytes."""
        self.held[region], self.host_held[region], self.spill[region] = held, host, spill
        self.inputs[region] = inputs

    def forward_begins(self, waiting: bool) -> bool:
        """A forward of the step begins, ``waiting``: whether an earlier forward still waits for its backward
        (the backend's, exact: one whose graph was freed waits no longer). Learn whether it runs between two
        backwards (one began, and an earlier forward waits). Where no backward began in this step and none of
        its forwards waits (their graphs freed: a loss only logged, with gradients on), the step begins again:
        those forwards are forgotten, and True is returned."""
        self.interleaved = self.interleaved or (self.backward_seen and waiting)
        if self.backward_seen or waiting or not self.records:
            return False
        self.records, self.kept = [], {}
        self.forwards.clear()
        return True

    def note_forward(self, record: Any) -> None:
        """A forward of the step ran ``record``'s graph (the first after a backward begins a new step)."""
        if self.backward_seen:
            self.records, self.backward_seen, self.kept = [], False, {}
        self.records.append(record)

    def count_forward(self, region: tuple) -> int:
        self.forwards[region] = self.forwards.get(region, 0) + 1
        return self.forwards[region]

    def note_backward(self) -> bool:
        """A backward begins: the forwards since the last one are counted. Whether it is the step's first."""
        first = not self.backward_seen
        self.backward_seen = True
        for region, runs in self.forwards.items():
            self.counted[region] = max(self.counted.get(region, 1), runs)
        self.forwards.clear()
        return first

    def invocations(self) -> list[Any]:
        """The latest step's forward invocations, in the order they ran (a record once per run)."""
        return list(self.records)

    def caller_kept(self) -> list[tuple[KeptSource, ...]]:
        """Per invocation: the transfers whose source, a graph input, its caller kept after the graph returned."""
        return [tuple(KeptSource(k.input.transfer, k.into_backward) for k in self.kept.get(run, ()))
                for run in range(len(self.records))]

    def note_kept(self, kept: list[KeptInput]) -> None:
        """Record the step's offloaded inputs its callers kept, per invocation, by region and on each graph's
        record (every record of the step, so that an earlier step's figures do not linger); warn once per graph."""
        for k in kept:
            self.kept.setdefault(k.run, []).append(k)
            if k.into_backward:
                region = self.region_of[self.records[k.run].index]
                self.kept_inputs[region] = self.kept_inputs.get(region, frozenset()) | {k.input.position}
        for record in self.records:
            record.caller_kept_runs = record.caller_kept_bytes = 0
        for k in kept:
            record = self.records[k.run]
            record.caller_kept_runs += 1
            record.caller_kept_bytes += k.input.nbytes
        for record in {self.records[k.run].index: self.records[k.run] for k in kept}.values():
            inputs = [k for k in kept if self.records[k.run] is record]
            message = kept_warning(record.region, inputs, record.caller_kept_runs)
            runs = sum(1 for r in self.records if r is record)
            # Half its runs or more: most of its copies are for nothing. Fewer (a model holding its
            # embedding output keeps the first layer's input): explain and the log say so.
            if 2 * record.caller_kept_runs < runs:
                log.info("%s", message)
            elif record.index not in self.kept_warned:
                self.kept_warned.add(record.index)
                warn_from_user(UserWarning(message))

    def warn_per_run(self, region: tuple, memory_budget: Any) -> None:
        """Warn once when a region of symbolic sizes (never re-planned for the step) ran more often in this
        forward than its plan counted: a fraction then bounds each run's activation peak, not the step's (a
        scoring call at another batch size made Dynamo trace the training graph so, and its two runs a step
        went planned for one, silently)."""
        runs = self.forwards[region]
        if runs <= self.runs_of(region) or region in self.held_warned:
            return
        self.held_warned.add(region)
        warn_from_user(UserWarning(
            f"fxoffload: compiled region {self.place(region)} has run {runs} times in this forward, but its "
            f"sizes are symbolic (dynamic shapes), so it is not re-planned for the step: "
            f"memory_budget={memory_budget!r} bounds the activation peak of each run, not of the step's "
            f"{runs} runs. Keep the graph's sizes static (torch.compile(..., dynamic=False)) so that the plan is "
            f"made again for the step, or pass runs_per_step=<the most runs of one graph held at once> (every "
            f"region is then planned for that many)."))

    def warn_held(self, region: tuple, budget: int, memory_budget: Any) -> None:
        """Warn once when a region ran more often in this forward than its plan counted, and the forwards
        so far leave more activations than an absolute ``budget`` (no re-planning)."""
        runs = self.forwards[region]
        held = sum(self.held.get(r, 0) * n for r, n in self.forwards.items())
        if runs <= self.runs_of(region) or held <= budget or region in self.held_warned:
            return
        self.held_warned.add(region)
        warn_from_user(UserWarning(
            f"fxoffload: compiled region {self.place(region)} has run {runs} times in this forward (one "
            f"compiled graph serving several layers, e.g. per-layer compile), but its plan counted its "
            f"activations once ({self.held.get(region, 0)} B, predicted): the forwards so far leave {held} B of "
            f"activations on the device for the backward, above memory_budget={memory_budget!r} "
            f"({budget} B). Pass runs_per_step=<the number of layers the graph serves> so that the plan "
            f"covers the whole step."))
