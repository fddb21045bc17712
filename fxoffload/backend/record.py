"""What fxoffload did to one compiled graph: its ``GraphRecord``, as the backend makes it and every report reads it.

Inputs: the backend (``fxoffload.backend``) fills one per planned graph. Outputs: the record that
``explain``, ``plot``, the reports of ``fxoffload plan`` and the step's simulation
(``fxoffload.passes.step``) read. Limits: a plain mutable record; the plan, the schedule and the
timeline it holds are frozen values, the graphs are the rewritten ones (Inductor may change them
further), and the per-step fields (``caller_kept_*``) describe the latest step only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxoffload.backend.callers import OffloadedInput
from fxoffload.passes import BudgetInfeasibleError, DeviceProfile, Plan, Schedule, Share, Timeline
from fxoffload.backend.selection import Selection

__all__ = ["GraphRecord"]


@dataclass(kw_only=True)
class GraphRecord:
    """What fxoffload did to one compiled graph (built by keyword: its fields are many and alike)."""

    index: int
    forward: fx.GraphModule  # rewritten forward, as handed to the inner compiler
    backward: fx.GraphModule  # rewritten backward, as handed to the inner compiler (once compiled)
    plan: Plan
    schedule: Schedule
    pass_seconds: tuple[tuple[str, float], ...]
    inner: str
    timeline: Timeline  # the memory model's lifetimes (before the rewrite)
    profile: DeviceProfile  # the device profile the predictions are for
    work: tuple = ()  # per timeline node (FLOPs, bytes, dtype), measured before the rewrite
    region: int = 0  # position among the step's compiled regions (first compile order)
    held_before: int = 0  # predicted activation bytes earlier regions leave on the device for the backward
    held_after: int = 0  # the same, this region's included (the running total)
    runs_learned: bool = False  # re-planned for ``plan.runs`` runs per step, counted in the first step
    # Planned before the first step counted its runs (runs_per_step="auto", a graph handed an activation
    # by an earlier graph, its budget out of reach for one run): for PROVISIONAL_RUNS runs, re-planned once
    # counted; ``provisional_short``: out of reach for those too, so the smallest peak until the re-plan.
    provisional: bool = False
    provisional_short: bool = False
    # The error a provisional plan was made in place of (its budget out of reach for the runs first planned):
    # what the re-plan raises where the step shows nothing that brings the budget within reach (one region
    # run once: ``fxoffload plan`` refuses the budget so).
    out_of_reach: BudgetInfeasibleError | None = None
    offloaded_inputs: tuple[OffloadedInput, ...] = ()  # graph inputs the plan offloads (layer inputs)
    # Of the latest step's runs of this graph: those whose caller kept an offloaded input after the
    # graph returned (``fxoffload.backend.callers``), and the bytes that copy did not free.
    caller_kept_runs: int = 0
    caller_kept_bytes: int = 0
    # Re-planned, once the first step had shown every region, with this share of the step's memory budget
    # (``fxoffload.passes.shares``); None: planned with the budget as given (or what earlier regions left of it).
    step_share: Share | None = None
    step_budget: int | None = None  # the step's budget in bytes that ``step_share`` is a share of
    step_round: int = -1  # the round of shares it was planned in (``fxoffload.backend.step_budget``); -1: none
    # The largest activation an earlier graph hands it that it saves: back on the device for its
    # backward whatever the plan, so a floor of its peak in the step's accounting.
    largest_saved_input: int = 0
    # Bytes of the gradients one run's backward leaves for the parameters it is handed (in ``.grad``):
    # on the device while the earlier regions' backwards run (the step's device accounting).
    gradient_bytes: int = 0
    # Strategy auto's plans of this graph that met its budget (``fxoffload.passes.CandidatePlan``), fastest
    # predicted first; and, under select="measured", the measurement that kept this one (on the kept record).
    candidates: tuple = ()
    selection: Selection | None = None
    candidate_key: str | None = None  # compiled as this candidate, to be timed (measured selection)
    host_reserved: bool = False  # its copies' pinned blocks were made before its first run (fxoffload.runtime.pinned)
