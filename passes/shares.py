"""Shares of a step's budget: how much of one activation budget each compiled region of a step gets.

Inputs: a step's regions (the compiled graphs it ran) in the order their forwards first ran, each as a
:class:`RegionDemand` (bytes over all its runs in the step, predicted: ``held``, what its forwards
leave on the device for the backward without offloading; ``peak``, its own activation peak without
offloading, every earlier run's ``held`` included; ``floor_held`` and ``floor_peak``, the least it is
known to reach, 0 where not known: a plan that moves every candidate reaches both at once), the
step's budget (bytes) and what the regions before the first of them hold (as planned).
Output: a :class:`Share` for the first of those regions: the budget its plan bounds its peak by (the
step's budget less what earlier regions hold) and the cap on what its forwards may leave for the
backward (None for the step's last region: nothing runs on top of what it holds).

The model. Forwards run in order, then the backwards in reverse. While region ``k`` runs, forward or
backward, every earlier region holds what it keeps for its backward, and later regions hold nothing
(their forward has not begun, or their backward has ended), so the step's activation peak is
``max_k (held_1 + ... + held_{k-1} + peak_k)`` (:func:`step_peak`).

The split. Each remaining region gets the same fraction ``a`` of its own figures, raised to its floor
where it has one: ``held_k(a) = max(a * held_k, floor_held_k)``, likewise the peak. ``a`` is the largest
in [0, 1] for which the step's peak under these figures fits what the budget leaves (bisection: every
figure grows with ``a``, so does the peak). Without floors ``a`` is the budget's fraction of the rest
of the step; a region that cannot shrink is given what it needs, and the others make up for it. The
backend plans regions one at a time, in the order they run, each with what those before it actually
hold: one that holds less than its cap leaves more for the rest.

Limits. Floors are known only where a plan has already reached its smallest peak; elsewhere 0 (the
region is taken to shrink as far as asked), so a later region may still find its share out of
reach. The order model is a step's: forwards, then backwards in reverse; it does not follow
pipeline schedules with several microbatches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["RegionDemand", "Share", "scaled", "share_for", "step_peak"]

_BISECTIONS = 60  # halvings of [0, 1]: far below a byte on any step


@dataclass(frozen=True)
class RegionDemand:
    """One region's activation bytes over its runs in a step (see the module docstring)."""

    held: int
    peak: int
    floor_held: int = 0
    floor_peak: int = 0


@dataclass(frozen=True)
class Share:
    """What a region's plan gets of the step's budget."""

    # its activation peak, over its runs, on top of nothing: the step's budget less what earlier regions hold
    budget: int
    held_cap: int | None  # what its runs may leave for the backward; None: the step's last region
    fraction: float  # the ``a`` of the module docstring: the share of its own figures it may keep


def scaled(region: RegionDemand, fraction: float) -> RegionDemand:
    """A region's figures at ``fraction`` of its own, each raised to its floor."""
    return RegionDemand(max(int(fraction * region.held), region.floor_held),
                        max(int(fraction * region.peak), region.floor_peak), region.floor_held, region.floor_peak)


def step_peak(regions: Sequence[RegionDemand], held_before: int = 0) -> int:
    """The step's activation peak: each region's peak on top of what the regions before it hold."""
    peak, held = held_before, held_before
    for region in regions:
        peak = max(peak, held + region.peak)
        held += region.held
    return peak


def share_for(budget: int, held_before: int, rest: Sequence[RegionDemand]) -> Share:
    """The share of ``rest[0]``, the next region to plan (see the module docstring); ``held_before``: what
    the regions planned before it hold. Where even every floor exceeds the budget, ``fraction`` is 0 and
    the share asks for the floors: the plan then says the budget is out of reach."""
    if not rest:
        raise ValueError("share_for: no region to share the budget with")
    low, high = 0.0, 1.0
    if step_peak([scaled(r, high) for r in rest], held_before) > budget:
        for _ in range(_BISECTIONS):
            middle = (low + high) / 2
            if step_peak([scaled(r, middle) for r in rest], held_before) <= budget:
                low = middle
            else:
                high = middle
    else:
        low = high
    first = scaled(rest[0], low)
    return Share(budget=budget - held_before, held_cap=first.held if len(rest) > 1 else None, fraction=low)

