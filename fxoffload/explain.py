"""``explain(record)``: the plan of one compiled graph as a readable table.

Every figure here is a prediction of the memory model and cost model (on the
record's device profile), not a measurement, except the passes' wall times.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from fxoffload.passes import (
    UNBACKED_SIZE, Why, activation_peaks_at, data_dependent, kept_in_last_run, peaks_over_range, plan_digest,
    readable_bytes, simulate, simulate_runs,
)

__all__ = ["explain", "format_bytes", "format_seconds", "format_stages"]

format_bytes = readable_bytes  # the name fxoffload's modules read it by


def _budget_words(plan: Any) -> str:
    """A graph's budget, bytes and as given; one below nothing (a region's share of a step whose earlier regions
    hold more than the step's budget) said so, not as negative bytes."""
    if plan.budget_bytes is None and plan.device_bytes is not None:  # (the device peak's line below says more)
        return (f"none on the activations; device cap {format_bytes(plan.device_bytes)} (device_budget less reserved"
                " and what earlier regions take)")
    if plan.budget_bytes is None:
        return "none"
    if plan.budget_bytes < 0:
        return f"none left (earlier regions hold {format_bytes(-plan.budget_bytes)} more than the step's budget)"
    return f"{format_bytes(plan.budget_bytes)} ({plan.budget})"


def format_seconds(seconds: float) -> str:
    """Seconds in s, ms or us, three significant figures."""
    for unit, size in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def format_stages(seconds: Sequence[tuple[str, float]]) -> str:
    """``(stage, seconds)`` pairs as "1.23 s: analyse 0.10, plan 1.00, ..."; under strategy auto a
    stage sums its runs over the alternatives, and "repartition (PyTorch)" is PyTorch's partitioner."""
    total = sum(s for _, s in seconds)
    return f"{total:.2f} s: " + ", ".join(f"{stage} {s:.2f}" for stage, s in seconds)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _summary(record: Any) -> str:
    plan, schedule = record.plan, record.schedule
    gap = "n/a" if math.isnan(plan.gap) else f"{plan.gap:.2%}"
    budget = _budget_words(plan)
    lines = [
        f"graph {record.index}: {len(plan.decisions)} saved activations, {len(plan.transfers)} transfers, "
        f"{format_bytes(plan.offloaded_bytes)} offloaded, {len(plan.recomputes)} recomputed "
        f"({format_bytes(plan.recomputed_bytes)}, {plan.recompute_seconds * 1e6:.1f} us of compute predicted)",
        f"options: budget {budget}, strategy={plan.strategy}, min_bytes={plan.min_bytes}, "
        f"horizon={schedule.horizon}, inner={record.inner}",
        f"partition: {plan.partition}" + ("" if not plan.partition_seconds else
                                          f" (its own recomputations: {plan.partition_seconds * 1e6:.1f} us of "
                                          "compute over the min-cut pair's, predicted)"),
        f"plan digest: {plan_digest(plan, schedule)} (what the rewrite does; the same on every rank for the same "
        "graph and options)",
        f"solver: {plan.solver}" + ("" if plan.solver == "none" else f", optimal={plan.optimal}, gap {gap}"),
        f"passes took {format_stages(record.pass_seconds)} (measured wall time)",
        f"predicted activation peak: {format_bytes(plan.activation_peak_before)} -> "
        f"{format_bytes(plan.activation_peak_after)}",
        f"predicted total peak:      {format_bytes(plan.total_peak_before)} -> {format_bytes(plan.total_peak_after)}"
        + (f" (copies placed under plain compile's {format_bytes(plan.total_cap)}: the CPU-offload marks make "
           "the partition save more)" if plan.total_cap is not None and plan.total_cap < plan.total_peak_before
           else ""),
        f"predicted stall on {record.profile.name}: {schedule.predicted_stall * 1e6:.1f} us{_step_stall(record)} "
        "(copies served in order per direction; see the placements)",
        _predicted_step(record),
        f"predicted host memory:     {format_bytes(plan.host_bytes * plan.runs)} of host copies when the forward "
        f"ends{_runs(plan)}; {format_bytes(plan.pinned_host_bytes * plan.runs)} pinned on CUDA (the caching host "
        "allocator's power-of-two blocks, kept for later steps)"
        + ("" if plan.host_budget_bytes is None else
           f"; host_budget left this graph {format_bytes(plan.host_budget_bytes)} pinned, "
           f"{'within' if plan.pinned_host_bytes * plan.runs <= plan.host_budget_bytes else 'OVER'}"),
    ]
    staged = [t for t in plan.transfers if t.staging]
    if staged:
        lines.append(
            f"staged copies: {', '.join(f'{t.base_name} ({format_bytes(t.staging)})' for t in staged)} fill no "
            "one block of memory (a layout with gaps or overlaps): the copy engine puts each through a "
            "contiguous device buffer of that size, from its "
            "offload to its release and from its prefetch to its wait (counted in the total and device peaks)")
    if plan.device_bytes is not None:
        lines.append(
            f"predicted device peak: {format_bytes(plan.device_peak_before)} -> {format_bytes(plan.device_peak_after)} "
            f"(graph inputs {format_bytes(plan.input_bytes)} and every tensor the step creates; device_budget less "
            f"reserved: {format_bytes(plan.device_bytes)}, "
            f"{'within' if plan.device_peak_after <= plan.device_bytes else 'OVER'})")
        if plan.runs > 1 and plan.run_gradients:
            lines.append(f"its first run's backward runs on top of the gradients its other {plan.runs - 1} runs' "
                         f"backwards left ({format_bytes(plan.run_gradients)} each; in its device peak)")
        if plan.backward_gradients:
            lines.append(f"its backward runs on top of {format_bytes(plan.backward_gradients)} of gradients the step's "
                         "later regions' backwards left in .grad (counted against its device budget, not in its peak)")
    share = getattr(record, "step_share", None)
    if getattr(record, "provisional", False) and share is not None:
        lines.append(
            f"provisional: its share of the step's budget was out of reach in round {record.step_round + 1} of the "
            "step's shares: planned at its smallest peak, which the next round reserves for it")
    elif getattr(record, "provisional", False):
        lines.append(
            f"provisional: the budget is out of reach for one run, and the first step has not counted this graph's "
            f"runs yet: planned for {plan.runs} (a graph handed an activation by an earlier graph is taken to serve "
            "several layers); re-planned for the runs counted, once the first step has run"
            + ("; the budget was out of reach for these runs, so this plan is the smallest peak until then"
               if getattr(record, "provisional_short", False) else ""))
    if plan.runs > 1:
        lines.append(
            f"runs per step: {plan.runs} (one graph run {plan.runs} times a step: serving {plan.runs} layers, or "
            f"called {plan.runs} times"
            + ("; counted in the first step: re-planned and recompiled once" if getattr(record, "runs_learned", False)
               else "") + f"); predicted activation peak of the "
            f"step: {format_bytes(plan.step_peak_before)} -> {format_bytes(plan.step_peak_after)}"
            + (f" (budget {format_bytes(plan.budget_bytes)} bounds the step)" if plan.budget_bytes is not None else ""))
    if getattr(record, "region", 0) or getattr(record, "held_before", 0):
        lines.append(
            f"region {record.region} of the step: earlier regions hold {format_bytes(record.held_before)} of "
            f"activations after their forward; running total with this one {format_bytes(record.held_after)} "
            "(predicted; a budget in bytes, or a share of the step's, covers them all)")
    if share is not None:
        cap = f", leaving at most {format_bytes(share.held_cap)} for its backward" if share.held_cap is not None else ""
        lines.append(
            f"share of the step's budget ({format_bytes(record.step_budget)} for the step's regions, predicted): "
            + (f"a peak within {format_bytes(share.budget)} on top of what earlier regions hold{cap} "
               if share.budget >= 0 else
               f"nothing on top of what earlier regions hold: they exceed the step's budget by "
               f"{format_bytes(-share.budget)}{cap} ") +
            f"({share.fraction:.2f} of "
            f"its own figures; re-planned once the first step had shown every region, round {record.step_round + 1})")
    lines += _layer_inputs(record)
    lines += _overhead(plan)
    lines += _selection(record)
    handed_on = [lt for lt in record.timeline.lifetimes if lt.handed_on]
    if handed_on:
        lines.append(
            "counted until the forward returns, under the fraction: the outputs it hands to the rest of the step "
            f"({', '.join(f'{lt.name} {format_bytes(lt.expr)}' for lt in handed_on)}; a later graph that saves them "
            "does not count them)")
    lines += _sizes(record)
    if plan.note:
        lines.append(f"note: {plan.note}")
    return "\n".join(lines)


def _predicted_step(record: Any) -> str:
    """The graph's step as the simulator replays it (what ``plot`` draws), and what its plan adds to the
    compute of the min-cut pair without fxoffload, part by part: on a graph of microseconds the host's
    op calls are most of it, where the stall above is none."""
    sim = simulate(record)
    stalls = sum(c.stall for c in sim.copies)
    parts = [f"{name} {format_seconds(seconds)}" for name, seconds in (
        (f"the device idle while the host makes fxoffload's {len(sim.copies) * 2} op calls (copies issued and "
         f"waited for, {format_seconds(record.profile.op_seconds)} each):", sim.host_wait),
        ("waits for copies:", stalls), ("recomputation:", sim.recompute_time), ("staging copies:", sim.staging_time),
        ("the partition's own recomputations:", sim.partition_time)) if seconds > 0]
    return (f"predicted step on {record.profile.name}: {format_seconds(sim.step_time)}"
            f"{' in one run' if record.plan.runs > 1 else ''}, against {format_seconds(sim.compute_time)} "
            f"computing without fxoffload (+{sim.overhead:.1%})" + (f"; {'; '.join(parts)}" if parts else "")
            + " (simulated, as fxoffload.plot draws it)")


def _step_stall(record: Any) -> str:
    """Where the graph runs several times a step: its runs differ (copies cross from one to the next,
    releases deferred before the last run stall in the last only), so the step simulator's stall too."""
    runs = simulate_runs(record) if record.schedule.placements else None
    if runs is None:
        return ""
    plan = record.plan
    return (f" in its last run alone; {runs.stall / plan.runs * 1e6:.1f} us a run over the step's {plan.runs} runs "
            "(fxoffload.passes.step, what strategy auto ranks by)")


def _runs(plan: Any) -> str:
    return f" (its {plan.runs} runs in a step)" if plan.runs > 1 else ""


def _sizes(record: Any) -> list[str]:
    """Under dynamic shapes: the size the plan (and its copy times) is made for, the other sizes it
    holds a fractional budget at, and the worst predicted share across that range; else the peaks
    at the smallest size the graph serves."""
    plan = record.plan
    sizes = plan.sizes_planned()  # as planned: a later compile's guards (Inductor's) may have narrowed them since
    if not sizes:
        return []
    planned = ", ".join(f"{s}={v}" for s, (v, _) in sizes.items())
    traced = {s: b for s, (_, b) in sizes.items() if not data_dependent(s)}
    how = [] if not traced else ["the largest the guards allow" if all(traced.values())
                                 else "the traced size where no upper bound is known"]
    if bounded := [str(s) for s, (_, b) in sizes.items() if data_dependent(s) and b]:
        how.append(f"{', '.join(bounded)} data-dependent: the most the guards allow")
    if unbounded := [str(s) for s, (_, b) in sizes.items() if data_dependent(s) and not b]:
        how.append(f"{', '.join(unbounded)} data-dependent, without a traced value or a bound under "
                   f"{UNBACKED_SIZE}: counted at {UNBACKED_SIZE}; a step whose data makes them larger may hold more")
    lines = [f"sizes: symbolic (shapes and bytes are formulas); planned and timed at {planned} ({'; '.join(how)})"]
    if plan.sizes:
        ranges = ", ".join(f"{s} in [{lo}, {hi}]" for s, (lo, hi) in plan.ranges_held().items() if lo < hi)
        lines.append(f"the fraction is held across {ranges}: " + "; ".join(
            f"at {size.label}: budget {format_bytes(size.budget_bytes)}, predicted activation peak "
            f"{format_bytes(size.step_peak_before)} -> {format_bytes(size.step_peak_after)}"
            for size in plan.sizes))
        if plan.partition == "min-cut":  # else "before" at other sizes is another partition's
            values, before, after = max(peaks_over_range(plan, record.timeline, record.schedule),
                                        key=lambda row: row[2] / max(row[1], 1))
            lines.append(f"worst predicted share across the range: {after / max(before, 1):.3f} at "
                         f"{', '.join(f'{s}={v}' for s, v in values.items())}")
        return lines
    # The smallest of each symbol's range as planned (a size no graph input carries stays at its traced value)
    smallest = {symbol: lo for symbol, (lo, _) in plan.ranges_held().items()}
    before, after = activation_peaks_at(plan, record.timeline, record.schedule, smallest)
    share = f", {after / before:.3f} of it" if before else ""
    if plan.partition != "min-cut":  # "before" is then this partition's, not the budget's reference
        share += " (before: this partition's own peak without the plan)"
    return lines + [f"at the smallest size the guards allow ({', '.join(f'{s}={v}' for s, v in smallest.items())}): "
                    f"predicted activation peak {format_bytes(before)} -> {format_bytes(after)}{share}"]


def _overhead(plan: Any) -> list[str]:
    """Under max_overhead: the bound, and what it kept that the smallest peak would have moved."""
    if getattr(plan, "max_overhead", None) is None:
        return []
    kept = [d for d in plan.decisions if d.why is Why.OVERHEAD]
    because = (f"; kept because of it (the smallest peak moves them): {len(kept)} saved tensors, "
               f"{format_bytes(sum(d.nbytes for d in kept))}, "  # (a formula under symbolic sizes)
               + ", ".join(d.name for d in kept[:4]) + (", ..." if len(kept) > 4 else "")) if kept else ""
    return [f"max_overhead: {plan.max_overhead:g} of the graph's predicted compute time without offloading "
            f"({plan.overhead_bound * 1e3:.3f} ms per run, predicted){because}"]


def _selection(record: Any) -> list[str]:
    """What measured selection timed (on the record it kept), or that a record was one of its trials."""
    selection = getattr(record, "selection", None)
    if selection is None:
        key = getattr(record, "candidate_key", None)
        return [] if key is None else [
            f"compiled to be timed by measured selection (candidate {key!r}); see the record it kept"]
    ranks = getattr(selection, "ranks", 1)
    figures = "; ".join(
        f"{t.label}: predicted {t.predicted_step * 1e3:.3f} ms, measured "
        + ("not timed" if t.median is None else f"{t.median * 1e3:.3f} ms (median of {len(t.seconds)} steps)")
        + ("" if ranks == 1 else ", slowest rank " + ("untimed on one" if t.slowest is None
                                                     else f"{t.slowest * 1e3:.3f} ms"))
        + (" <- kept" if t is selection.kept else "")
        for t in selection.candidates)
    kept = ("the fastest median is kept for good" if ranks == 1 else
            f"over {ranks} ranks, the one whose slowest rank's median is least is kept for good, on every rank")
    return [f"measured selection (select='measured'): each plan of strategy auto that met the budget ran its steps, "
            f"timed on the device; {kept}: {figures}"]


def _layer_inputs(record: Any) -> list[str]:
    """What the plan assumes of the inputs it offloads, and what the latest step showed
    (``fxoffload.backend.callers``)."""
    inputs = getattr(record, "offloaded_inputs", ())
    if not inputs:
        return []
    ahead = set(record.schedule.ahead) if record.schedule.ahead_bytes else set()
    names = ", ".join(
        f"{i.name} (input {i.position}; " + ("back during the next layer's backward, which starts its copy ahead)"
                                              if i.transfer in ahead else "back within its own backward)")
        for i in inputs)
    line = (f"layer inputs offloaded: {names}; their device memory is freed when the caller drops them (a loop "
            "rebinding hidden_states does at the layer's return), checked at run time when the next forward of "
            "the step begins, and when its backward does: ")
    kept = getattr(record, "caller_kept_runs", 0)
    if kept:
        line += (f"in the latest step the caller kept them after {kept} run(s), "
                 f"{format_bytes(record.caller_kept_bytes)} the copies did not free, on top of the predicted peaks "
                 "here (simulate_step(..., caller_kept=...) counts them)")
    else:
        line += "no caller has kept one so far"
    return [line]


def explain(record: Any) -> str:
    """Per graph: budget, predicted peaks, solver; per saved activation: decision, bytes, reason; per
    recomputation: its chain; per transfer: placement."""
    plan, schedule = record.plan, record.schedule
    rows = [
        [d.name, "x".join(map(str, d.shape)) or "()", str(d.dtype).replace("torch.", ""), format_bytes(d.nbytes),
         d.action, d.reason]
        for d in plan.decisions
    ]
    text = [_summary(record), _table(["activation", "shape", "dtype", "bytes", "decision", "reason"], rows)]
    if plan.recomputes:
        text.append(_table(
            ["recomputed", "bytes", "before", "ops", "reads", "compute us", "temporaries"],
            [[r.base_name, format_bytes(r.nbytes), r.cost.consumer.name, str(len(r.cost.chain)),
              ", ".join(n.name for n in r.cost.reads), f"{r.cost.seconds * 1e6:.1f}", format_bytes(r.cost.transient)]
             for r in plan.recomputes],
        ))
    if schedule.placements:
        place_rows = []
        for p in schedule.placements:
            t = plan.transfers[p.transfer]
            place_rows.append([
                t.base_name, format_bytes(t.nbytes), p.offload_after.name,
                p.free_after.name + (" (deferred)" if p.deferred else " (deferred before the last run)"
                                     if p.deferred_before_last else ""),
                p.prefetch_before.name, p.wait_before.name, str(p.ops_ahead),
                f"{p.d2h_seconds * 1e6:.1f}", f"{p.h2d_seconds * 1e6:.1f}",
                f"{p.forward_stall * 1e6:.1f}", f"{p.backward_stall * 1e6:.1f}",
            ])
        text.append(_table(
            ["transfer", "bytes", "offload after", "release after", "prefetch before", "wait before", "ops ahead",
             "d2h us", "h2d us", "fw stall us", "bw stall us"],
            place_rows,
        ))
        text.append(_crossing(plan, schedule))
    return "\n\n".join(text)


def _crossing(plan: Any, schedule: Any) -> str:
    """What crosses the graph's boundaries (deferred releases, copies started ahead)."""
    deferred = [plan.transfers[p.transfer].base_name for p in schedule.placements if p.deferred]
    lines = [
        "deferred releases (the forward returns with these copies in flight; freed once landed, at the latest "
        "when a backward begins): " + (", ".join(deferred) or "none"),
    ]
    if before_last := [plan.transfers[p.transfer].base_name for p in schedule.placements if p.deferred_before_last]:
        lines.append(f"deferred before the last run (in each of the graph's {plan.runs} runs but the step's last, "
                     "the release does not wait: the copy lands while the forward goes on, and is waited for "
                     "at the forward's end at the latest; fw stall is the last run's): " + ", ".join(before_last))
    if schedule.ahead_bytes:
        names = ", ".join(plan.transfers[k].base_name for k in schedule.ahead)
        lines.append(
            f"started ahead: the backward before this one starts this graph's first "
            f"{format_bytes(schedule.ahead_bytes)} of copies ({names}, when one graph serves every layer), "
            f"issued here before {schedule.ahead_before.name}")
        if kept := kept_in_last_run(plan, schedule):
            lines.append(
                "kept in the last run: in the step's last run of this graph, whose backward no other backward "
                "runs before, " + ", ".join(plan.transfers[k].base_name for k in kept) + " stays on the device "
                "for that backward (still copied to the host; the prefetch takes a device copy of it): no "
                "wait for its copy back, one such input more held from its release to that backward")
    else:
        lines.append("started ahead: none (every copy is hidden inside this backward, or none fits the bound)")
    if plan.interleaved:
        lines.append("forwards run between this step's backwards (1F1B, interleaved): copies started ahead "
                     "are held through the forward between two backwards, and must fit there too")
    return "\n".join(lines)
