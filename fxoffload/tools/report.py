"""What ``fxoffload plan`` reports: each compiled graph's figures and the step's, as a dict (its
``--json`` output) and as text.

Reads the backend's ``GraphRecord``s and the step's invocations; gives plain dicts of numbers (bytes,
seconds, ratios) and prints them. Every figure is a prediction (memory model, cost model,
simulator) and the text says so; the one measured figure is the command's own time, which the
caller adds (``seconds``). Limits: a graph's input bytes are its plan's (parameters, buffers,
batch); the step's optimizer figures are what the caller estimated (``with_optimizer``).
"""

from __future__ import annotations

from typing import Any, Mapping

from fxoffload.config import parse_budget
from fxoffload.explain import explain, format_bytes, format_stages
from fxoffload.passes import Why, activation_peaks_at, plan_digest, simulate, simulate_step
from fxoffload.tools.plot import format_seconds


__all__ = ["plan_report", "print_report", "range_report", "step_report", "with_optimizer"]


def _optimizer_words(report: dict) -> str:
    state = report["step"]["optimizer_state_bytes"]
    return f", the optimizer's state {format_bytes(state)}" if state else ""



def _device_peaks(plan: Any) -> dict:
    """A graph's device peak under a device budget (None without one): its inputs and every tensor it
    creates, against what its plan was given (device_budget less reserved, less what earlier graphs
    of the step hold)."""
    given = plan.device_bytes
    return {
        "device_bytes": given,
        "device_peak_before": None if given is None else plan.device_peak_before,
        "device_peak_after": None if given is None else plan.device_peak_after,
        "within_device_budget": None if given is None else plan.device_peak_after <= given,
    }



def range_report(record: Any, lengths: tuple[int, int], memory_budget: Any) -> list[dict]:
    """The graph's predicted activation peaks at both ends of the range (planned at the longest);
    a fractional budget is the same fraction at every length."""

    plan, limit = record.plan, parse_budget(memory_budget)
    sizes = plan.sizes_planned()
    held = {size.values: size for size in plan.sizes}  # the other sizes the plan holds its budget at
    out = []
    for length in lengths:
        values = {s: (length if v == lengths[-1] else v) for s, (v, _) in sizes.items()}
        before, after = activation_peaks_at(plan, record.timeline, record.schedule, values)
        budget, note = None if limit is None else limit.resolve(before), ""
        size = held.get(tuple(values.items()))
        if length == lengths[-1] and plan.partition != "min-cut":
            # The plan's own size, on PyTorch's recompute-only partition (strategy auto): the
            # min-cut peak the fraction refers to is the plan's.
            before, budget = plan.step_peak_before, plan.budget_bytes
        elif size is not None:  # a size the plan holds the budget at: its budget and reference
            before, budget = size.step_peak_before, size.budget_bytes
        elif plan.partition != "min-cut" and limit is not None and limit.fraction is not None:
            budget, note = None, (f"planned on another partition ({plan.partition}): the fraction's reference "
                                  "is not known here")
        out.append({"seq": length, "activation_peak_before": before, "activation_peak_after": after,
                    "budget_bytes": budget, "within_budget": budget is None or after <= budget, "note": note})
    return out



def plan_report(records: list, planned: Mapping[str, Any]) -> dict:
    """Each compiled graph's figures (predicted: memory model, cost model, simulator), after ``planned``:
    what was planned, as the command was asked (model, batch, seq, dtype, layers, checkpointing, budget,
    horizon)."""

    graphs = []
    for record in records:
        plan, sim = record.plan, simulate(record)
        graphs.append({
            "index": record.index,
            "budget_bytes": plan.budget_bytes,
            "within_budget": plan.budget_bytes is None or plan.step_peak_after <= plan.budget_bytes,
            "runs_per_step": plan.runs,
            "step_peak_before": plan.step_peak_before,
            "step_peak_after": plan.step_peak_after,
            "activation_peak_before": plan.activation_peak_before,
            "activation_peak_after": plan.activation_peak_after,
            "total_peak_before": plan.total_peak_before,
            "total_peak_after": plan.total_peak_after,
            "input_bytes": record.plan.input_bytes,
            "saved_activations": len(plan.decisions),
            "transfers": len(plan.transfers),
            "offloaded_bytes": plan.offloaded_bytes,
            "host_bytes": plan.host_bytes * plan.runs,
            "pinned_host_bytes": plan.pinned_host_bytes * plan.runs,
            "host_budget_bytes": plan.host_budget_bytes,
            "recomputes": len(plan.recomputes),
            **_device_peaks(plan),
            "partition": plan.partition,
            "plan_digest": plan_digest(plan, record.schedule),
            "recomputed_bytes": plan.recomputed_bytes,
            "recompute_time": plan.recompute_seconds,
            "partition_time": plan.partition_seconds,
            "step_time": sim.step_time,
            "step_time_without_offload": sim.compute_time,
            "overhead": sim.overhead,
            "floor": sim.floor,
            "step_over_floor": sim.step_time / sim.floor if sim.floor else 1.0,
            "bound": sim.bound,
            "stall": sum(c.stall for c in sim.copies),
            "solver": plan.solver,
            "solver_gap": None if plan.gap != plan.gap else plan.gap,
            "offloaded_tensors": [{"name": t.base_name, "bytes": int(t.nbytes)} for t in plan.transfers],
            "max_overhead": plan.max_overhead,
            "overhead_bound": plan.overhead_bound,
            "kept_for_overhead": [d.name for d in plan.decisions if d.why is Why.OVERHEAD],
        })
    return {
        **planned,
        "profile": records[0].profile.name,
        "note": "memory and times are predictions (memory model, cost model, simulator); seconds are measured here",
        "graphs": graphs, "plots": [],
    }



def with_optimizer(step: dict, optimizer: dict) -> dict:
    """The step's optimizer figures (predicted), and its time with the optimizer's step added."""
    return {"optimizer": optimizer["kind"], "parameter_bytes": optimizer["parameter_bytes"],
            "optimizer_state_bytes": optimizer["state_bytes"], "optimizer_step_time": optimizer["step_time"],
            "step_time_with_optimizer": step["step_time"] + optimizer["step_time"]}



def step_report(invocations: list, memory_budget: Any) -> dict:
    """The step's figures: every compiled-graph invocation replayed as one step (simulated)."""

    sim = simulate_step(invocations)
    budget = parse_budget(memory_budget)
    before, graphs = sim.activation_peak_before, len({id(r) for r in invocations})
    if graphs == 1:
        # One graph (per layer, or the whole step): its plan's own figures. Under strategy auto the
        # graph may be PyTorch's recompute-only partition, whose peak without offloading is lower
        # than the min-cut partition's that the fraction refers to.
        before = invocations[0].plan.step_peak_before
    if budget is None:
        budget_bytes = None
    elif budget.nbytes is not None:
        budget_bytes = budget.nbytes
    else:  # a fraction of the step's activation peak without offloading
        budget_bytes = int(budget.fraction * before)
    return {
        "invocations": sim.invocations,
        "graphs": graphs,
        "budget_bytes": budget_bytes,
        "within_budget": budget_bytes is None or sim.activation_peak <= budget_bytes,
        "activation_peak_before": before,
        "activation_peak_after": sim.activation_peak,
        "step_time": sim.step_time,
        "step_time_without_offload": sim.compute_time,
        "overhead": sim.overhead,
        "stall": sim.stall,
        "crossing_copies": sim.crossing,
        "host_bytes": sim.host_bytes,
        "pinned_host_bytes": sim.pinned_host_bytes,
    }



def print_report(report: dict, records: list) -> None:
    for record, graph in zip(records, report["graphs"]):
        print(explain(record))
        print()
        budget = "none" if graph["budget_bytes"] is None else format_bytes(graph["budget_bytes"])
        layers = "" if report["layers"] is None else f"{report['layers']} layers, "
        checkpointing = "" if report["checkpointing"] == "none" else f", checkpointing {report['checkpointing']}"
        print(f"summary, graph {graph['index']} ({report['model']}, {layers}batch {report['batch']} x "
              f"{report['seq']}, {report['dtype']}{checkpointing}; predicted on {report['profile']}, simulated, "
              "not measured):")
        if graph["runs_per_step"] == 1:
            print(f"  activation peak  {format_bytes(graph['activation_peak_before'])} -> "
                  f"{format_bytes(graph['activation_peak_after'])} (budget {budget}: "
                  f"{'within' if graph['within_budget'] else 'OVER'})")
        else:
            print(f"  activation peak  {format_bytes(graph['activation_peak_before'])} -> "
                  f"{format_bytes(graph['activation_peak_after'])} per run; over its {graph['runs_per_step']} runs "
                  f"{format_bytes(graph['step_peak_before'])} -> {format_bytes(graph['step_peak_after'])} "
                  f"(budget {budget} of the step: {'within' if graph['within_budget'] else 'OVER'})")
        print(f"  total peak       {format_bytes(graph['total_peak_before'])} -> "
              f"{format_bytes(graph['total_peak_after'])} "
              "(tensors the step creates: activations, gradients, temporaries)")
        if graph["device_bytes"] is not None:
            print(f"  device peak      {format_bytes(graph['device_peak_before'])} -> "
                  f"{format_bytes(graph['device_peak_after'])} (graph inputs and every tensor the step creates; "
                  f"device budget {format_bytes(report['device_budget_bytes'])} less reserved "
                  f"{format_bytes(report['reserved_bytes'])}{_optimizer_words(report)} and earlier graphs' "
                  "activations leaves "
                  f"{format_bytes(graph['device_bytes'])}: {'within' if graph['within_device_budget'] else 'OVER'})")
        for end in graph.get("range", ()):
            if end["note"]:
                judged = end["note"]
            else:
                limit = "none" if end["budget_bytes"] is None else format_bytes(end["budget_bytes"])
                judged = f"budget {limit}: {'within' if end['within_budget'] else 'OVER'}"
            print(f"  at length {end['seq']:<6} activation peak {format_bytes(end['activation_peak_before'])} -> "
                  f"{format_bytes(end['activation_peak_after'])} ({judged})")
        print(f"  graph inputs     {format_bytes(graph['input_bytes'])} (parameters, buffers, batch: resident "
              "throughout; optimizer state is not a graph input: --optimizer)")
        print(f"  offloaded        {format_bytes(graph['offloaded_bytes'])} in {graph['transfers']} transfers")
        print(f"  host memory      {format_bytes(graph['host_bytes'])} when the forward ends; "
              f"{format_bytes(graph['pinned_host_bytes'])} pinned on CUDA (power-of-two blocks)"
              + ("" if graph["host_budget_bytes"] is None else
                 f"; host budget {format_bytes(graph['host_budget_bytes'])}"))
        print(f"  recomputed       {format_bytes(graph['recomputed_bytes'])} in {graph['recomputes']} chains "
              f"({format_seconds(graph['recompute_time'])} of compute, predicted)"
              + ("" if not graph["partition_time"] else
                 f"; the partition's own recomputations {format_seconds(graph['partition_time'])} more"))
        print(f"  step time        {format_seconds(graph['step_time'])} (without offload "
              f"{format_seconds(graph['step_time_without_offload'])}: overhead {graph['overhead']:+.1%})")
        print(f"  floor            {format_seconds(graph['floor'])} ({graph['bound']}-bound); step is "
              f"{graph['step_over_floor']:.3f}x the floor")
    step = report["step"]
    budget = "none" if step["budget_bytes"] is None else format_bytes(step["budget_bytes"])
    print(f"summary, the whole step: {step['invocations']} invocation(s) of {step['graphs']} compiled graph(s), "
          "replayed as one (simulated, not measured; compute outside the compiled graphs not included):")
    print(f"  activation peak  {format_bytes(step['activation_peak_before'])} -> "
          f"{format_bytes(step['activation_peak_after'])} (budget {budget} of the step: "
          f"{'within' if step['within_budget'] else 'OVER'}; a fraction is of the step's peak)")
    print(f"  step time        {format_seconds(step['step_time'])} (without offload "
          f"{format_seconds(step['step_time_without_offload'])}: overhead {step['overhead']:+.1%}); "
          f"{step['crossing_copies']} copies crossed a graph boundary")
    if step["optimizer"] != "none":
        print(f"  optimizer        {step['optimizer']}: state {format_bytes(step['optimizer_state_bytes'])} (of "
              f"{format_bytes(step['parameter_bytes'])} of parameters; reserved under a device budget), its step "
              f"{format_seconds(step['optimizer_step_time'])}: the step with it "
              f"{format_seconds(step['step_time_with_optimizer'])} (predicted, memory-bound)")
    print(f"  host memory      {format_bytes(step['host_bytes'])} when the last forward ends; "
          f"{format_bytes(step['pinned_host_bytes'])} pinned on CUDA (power-of-two blocks)")
    seconds = report["seconds"]
    print(f"measured here: build {seconds['build']:.1f} s, trace and plan {seconds['trace_and_plan']:.1f} s "
          f"(fxoffload passes {format_stages(tuple(seconds['fxoffload_stages'].items()))})")
    for path in report["plots"]:
        print(f"plot: {path}")
