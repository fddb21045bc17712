"""The ``fxoffload plan`` command's work, apart from its flags and its printing (``fxoffload.tools.cli``).

Inputs: the command's parsed flags. Outputs: the options they stand for (:func:`plan_options`, checked
as ``OffloadConfig`` checks them, each error named by its flag), and :func:`run_plan`'s outcome: the
records of the traced step and the report ``fxoffload.tools.report`` builds of them, with the plots written.

Algorithm: build the model source, trace one step with fake tensors (``fxoffload.tools.tracing``), report each
graph and the step (``fxoffload.tools.report``), and plot each graph and the step (``fxoffload.plot``). A model
of more than four alike layers (a preset, a config), compiled whole at one length, has four traced and its joint
graph's layers copied (``tracing.trace_copying_layers``, as ``fxoffload fit`` traces), then planned
(``tracing.plan_copied``): the plan of a trace of every layer (llama-2-7b at 4096 tokens: 19 s against 26 s here),
some nodes named otherwise, so that its digest differs (``--trace-every-layer`` traces them all).
Limits: every figure is a prediction (memory model, cost model, simulator); the seconds are measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NamedTuple

from fxoffload.config import OffloadConfig, OptionError
from fxoffload.tools.flags import flag_detail
from fxoffload.tools.models import DTYPES, ModelError
from fxoffload.tools.plot import plot, plot_step
from fxoffload.tools.report import plan_report, range_report, step_report, with_optimizer
from fxoffload.tools.tracing import (
    Progress, UsageError, impossible_budget, min_bytes_of, model_source, number_or_text, plan_copied, seq_range,
    SizeRange, trace_copying_layers, trace_step,
)

__all__ = ["PlanOutcome", "budget_text", "plan_options", "run_plan"]

# The plan command's flag for each option it sets (an error about another option keeps its own name).
FLAGS = {"memory_budget": "--budget", "device_profile": "--profile", "horizon": "--horizon", "solver": "--solver",
         "strategy": "--strategy", "min_bytes": "--min-bytes", "host_budget": "--host-budget",
         "device_budget": "--device-budget", "reserved": "--reserved", "all_eligible": "--all-eligible",
         "max_overhead": "--max-overhead"}


class PlanOutcome(NamedTuple):
    """What planning one step gave: its graphs' records, and the report of them (plots written)."""

    records: list
    report: dict


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options the flags stand for (inner "eager": the passes run, no code is generated);
    a :class:`UsageError` naming the flag of a bad one, before anything is built."""
    device_budget: Any = None if args.device_budget.lower() == "none" else number_or_text(args.device_budget)
    horizon: Any = args.horizon if args.horizon == "auto" else number_or_text(args.horizon)
    host_budget: Any = None if args.host_budget.lower() == "none" else number_or_text(args.host_budget)
    options = dict(memory_budget=_memory_budget(args), horizon=horizon, device_profile=args.profile,
                   min_bytes=min_bytes_of(args), solver=args.solver, strategy=args.strategy, inner="eager",
                   cross_graphs=not args.no_cross_graphs, host_budget=host_budget, device_budget=device_budget,
                   reserved=number_or_text(args.reserved), all_eligible=args.all_eligible,
                   max_overhead=_max_overhead(args))
    try:
        OffloadConfig(**options)
    except OptionError as e:
        flag = FLAGS.get(e.option)
        raise UsageError(f"{flag}: {flag_detail(e.detail)}" if flag else str(e)) from None
    for flag in ("batch", "image_size", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: got {value}; accepted: an integer >= 1")
    lengths = seq_range(args.seq)  # checked here with the other flags, before anything is built
    if lengths and len(lengths) == 2 and args.per_layer:
        # Each layer is compiled from the eager embedding's output, at one length: its "range" was that
        # length's figures at both ends (before 2026-12-06).
        raise UsageError(f"--seq {args.seq} with --per-layer: a layer compiled on its own is traced at one length; "
                         "accepted: one length with --per-layer, or a range without it")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: got {args.dtype!r}; accepted: {', '.join(DTYPES)}")
    if not args.no_plot and Path(args.output).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"--output: got {args.output!r}; accepted: a path ending in .png, .svg or .pdf")
    return options


def budget_text(args: argparse.Namespace) -> str:
    """``--budget`` as given, else 0.5, or none under ``--device-budget`` (the two are exclusive)."""
    return args.budget if args.budget is not None else ("0.5" if args.device_budget.lower() == "none" else "none")


def _memory_budget(args: argparse.Namespace) -> Any:
    text = budget_text(args)
    return None if text.lower() == "none" else number_or_text(text)


def _max_overhead(args: argparse.Namespace) -> Any:
    text = args.max_overhead.strip()
    return None if text.lower() == "none" else text if text.endswith("%") else number_or_text(text)


def _refuse_out_of_reach(records: list, invocations: list) -> None:
    """A step of one graph run once whose budget (a fraction) was out of reach: its compile planned it
    provisionally at the smallest peak, for the first step to count its runs and share the step's budget,
    and the re-plan after it raises the same error (there is nothing else to share it with). Reported over
    its budget with status 0 before 2026-12-06; refused as an impossible budget, as bytes are."""
    if len(records) == 1 and len(invocations) == 1 and records[0].out_of_reach is not None:
        raise impossible_budget(records[0].out_of_reach)


def _check_size_flag(args: argparse.Namespace, source: Any) -> None:
    """One size flag, the model's own: ``--image-size`` once overrode ``--seq`` on a text model, silently."""
    if args.image_size is not None and args.seq is not None:
        raise UsageError(f"--seq and --image-size: got both ({args.seq!r} and {args.image_size}); accepted: one, "
                         "--seq for a text model, --image-size for an image model")
    if source.image and args.seq is not None:
        raise UsageError(f"--seq: got {args.seq!r}; {source.name} is an image model: accepted --image-size")
    if source.task is not None and not source.image and args.image_size is not None:
        raise UsageError(f"--image-size: got {args.image_size}; {source.name} is a text model ({source.task}): "
                         "accepted --seq")


def _device_budget_report(options: dict) -> dict:
    """The step's device budget and what is reserved of it, in bytes (None: no device budget)."""
    config = OffloadConfig(**options)
    return {"device_budget_bytes": config.device_budget_bytes, "reserved_bytes": config.reserved_bytes}


def run_plan(args: argparse.Namespace) -> PlanOutcome:
    """Plan one step of the model the flags name (see the module docstring)."""
    progress = Progress(args.quiet)
    options = plan_options(args)
    try:
        source = model_source(args)
        _check_size_flag(args, source)
        lengths = seq_range(args.seq)
        seq = args.image_size or (lengths[-1] if lengths else None) or source.default_seq
        copied = None if lengths and len(lengths) == 2 else trace_copying_layers(
            source, args, seq, DTYPES[args.dtype], options, progress)
        if copied is None:
            symbolic = SizeRange(1, *lengths) if lengths and len(lengths) == 2 else None
            records, invocations, seconds, optimizer, _ = trace_step(source, args, seq, DTYPES[args.dtype], options,
                                                                     progress, symbolic)
        else:
            records, seconds, optimizer = plan_copied(copied, options, progress)
            invocations = records
        _refuse_out_of_reach(records, invocations)
    except ModelError as e:
        if args.traceback and e.__cause__ is not None:
            raise
        raise UsageError(str(e)) from None
    progress(f"simulating {len(records)} graph(s) on {options['device_profile']}, and the step of "
             f"{len(invocations)} invocation(s)")
    report = plan_report(records, {"model": source.name, "batch": args.batch, "seq": seq, "dtype": args.dtype,
                                   "layers": source.layers, "checkpointing": args.checkpointing,
                                   "budget": budget_text(args), "horizon": args.horizon})
    report.update(_device_budget_report(options))
    if lengths and len(lengths) == 2:
        for graph, record in zip(report["graphs"], records):
            graph["range"] = range_report(record, lengths, options["memory_budget"])
    report["step"] = step_report(invocations, options["memory_budget"])
    report["step"].update(with_optimizer(report["step"], optimizer))
    if not args.no_plot:
        _plot(args, source.name, seq, records, invocations, report, progress)
    report["seconds"] = seconds
    return PlanOutcome(records, report)


def _plot(args: argparse.Namespace, name: str, seq: int, records: list, invocations: list, report: dict,
          progress: Progress) -> None:
    """Each graph's plot, and the step's when it ran several graphs; their paths go into the report."""
    for path, record in zip(_plot_paths(Path(args.output), len(records)), records):
        plot(record, path, title=f"{name}, batch {args.batch} x {seq}, {args.dtype}, graph {record.index}: "
                                 f"predicted on {record.profile.name} (simulated, not measured)")
        report["plots"].append(str(path))
        progress(f"wrote {path}")
    if len(invocations) > 1:  # the whole step: every run, copies crossing run boundaries
        path = Path(args.output)
        path = path.with_name(f"{path.stem}-step{path.suffix}")
        plot_step(invocations, path, budget=report["step"]["budget_bytes"],
                  title=f"{name}, batch {args.batch} x {seq}, {args.dtype}: the step of "
                        f"{len(invocations)} graph runs, predicted on {invocations[0].profile.name} "
                        "(simulated, not measured)")
        report["plots"].append(str(path))
        progress(f"wrote {path}")


def _plot_paths(path: Path, count: int) -> list[Path]:
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]
