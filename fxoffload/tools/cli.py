"""The ``fxoffload`` command: plan a model you cannot run here, and see the predicted step.

    fxoffload plan --preset llama-2-7b --seq 4096 --batch 1 --dtype bf16 --profile h100-pcie5 --budget 0.5
    python -m fxoffload plan --config path/to/config.json --layers 4 --json
    fxoffload plan --preset llama-2-7b --per-layer     # each decoder layer compiled on its own

``plan`` builds the model under ``FakeTensorMode`` (shapes only: no weights,
nothing allocated), compiles one training step with the fxoffload backend
(``inner="eager"``: the passes run, no code is generated), simulates each
compiled graph on the device profile, prints the plan table and a summary,
and writes the plot. Progress goes to stderr, results to stdout. Every time
and memory figure is a prediction (memory model, cost model, simulator), and
the output says so.

Exit status: 0 on success, 2 for bad input (options, model source, an
impossible budget), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Sequence

from fxoffload.config import OptionError, parse_budget
from fxoffload.profiles import PROFILES
from fxoffload.tools.check import CheckConfig, format_report, run_check
from fxoffload.tools.fit_command import add_fit_parser, run_fit
from fxoffload.tools.flags import add_batch, add_device, add_model_source, add_output, add_shape, flag_detail
from fxoffload.tools.models import CHECKPOINTING, PRESETS
from fxoffload.tools.plan_command import run_plan
from fxoffload.tools.report import print_report
from fxoffload.tools.tracing import Progress, UsageError, number_or_text


__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxoffload", description="fxoffload: activation offloading for torch.compile")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan", help="plan a model with fake tensors and predict its step (nothing runs on a GPU)",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
        epilog=f"presets: {', '.join(PRESETS)}. profiles: {', '.join(PROFILES)}. "
               "All figures are predictions (simulated), not measurements.",
    )
    add_model_source(plan)
    add_batch(plan)
    plan.add_argument("--seq", help="sequence length (default: the model's, at most 4096), or a range LO:HI: one "
                                    "graph for every length in it (dynamic shapes), planned at HI, with the "
                                    "figures at both ends")
    plan.add_argument("--image-size", type=int, help="image side in pixels, for vision models (default: the model's)")
    add_shape(plan)
    plan.add_argument("--per-layer", action="store_true",
                      help="compile each layer on its own, as FSDP2 and torchtitan do (layer.compile on every "
                           "block of the model's layer list), instead of the whole step as one graph")
    plan.add_argument("--checkpointing", default="none", choices=CHECKPOINTING,
                      help="activation checkpointing on each repeated layer, non-reentrant, as torchtitan applies "
                           "it: 'full' recomputes each layer's forward (a layer saves its inputs), 'selective' "
                           "saves matmul and attention outputs and recomputes the rest; 'none' adds none, a model "
                           "file's own stays (default none)")
    plan.add_argument("--budget", default=None,
                      help="memory_budget: a fraction of the activation peak (0.5) or a size (6GiB, 512MB); 'none' "
                           "plans for the smallest peak, at least cost (default 0.5; none with --device-budget)")
    plan.add_argument("--max-overhead", default="none",
                      help="max_overhead: the time each graph's plan may add, as a percentage (1%%) or fraction "
                           "(0.01) of its predicted time without offloading; with --budget none, the smallest "
                           "peak within it; with a budget, a plan that needs more is refused; 'none' (default)")
    plan.add_argument("--device-budget", default="none",
                      help="device_budget: the step's device peak (graph inputs, every tensor the step creates, "
                           "and --reserved) as a size (80GiB) or bytes, instead of --budget; 'none' (default)")
    add_device(plan)
    plan.add_argument("--horizon", default="auto", help="prefetch horizon: 'auto' or a number of compute ops")
    plan.add_argument("--solver", default="auto", help="auto, milp or greedy")
    plan.add_argument("--strategy", default="auto",
                      help="auto (keep, offload or recompute), offload or recompute (default auto)")
    plan.add_argument("--no-cross-graphs", action="store_true",
                      help="keep every copy inside its own compiled graph (cross_graphs=False)")
    add_output(plan, plot="fxoffload-plan.png")
    plan.add_argument("--all-eligible", action="store_true",
                      help="with --budget none: offload (or under --strategy recompute, recompute) every eligible "
                           "saved tensor, whether or not that lowers the peak, as naive offloading does")

    add_fit_parser(commands)
    check = commands.add_parser(
        "check", help="train a small model with and without fxoffload on this machine, and print each figure "
                      "measured beside its prediction (run it first on a GPU machine)",
        description="Calibrates the link (CUDA), trains a small GPT-style model (random weights) with plain "
                    "torch.compile and with fxoffload in debug mode, compares losses and weights, and prints "
                    "peak memory and step times, measured and predicted, with a verdict. Without CUDA the "
                    "same flow runs on the CPU engine, and says so. Exits 1 when the numerics differ or a "
                    "transfer stays pending.")
    check.add_argument("--steps", type=int, default=4, help="SGD steps per run, the first compiles (default 4)")
    check.add_argument("--layers", type=int, default=2,
                       help="the small model's transformer blocks (default 2; not a slice, as in plan and fit)")
    check.add_argument("--hidden", type=int, help="hidden size (default: 512 on CUDA, 64 on a CPU)")
    check.add_argument("--seq", type=int, help="the small model's sequence length (default: 512 on CUDA, 64 on a CPU)")
    add_batch(check, default=4)
    check.add_argument("--budget", default="0.5",
                       help="memory_budget for the small model's fxoffload run (default 0.5)")
    check.add_argument("--inner", choices=("eager", "inductor"),
                       help="inner compiler, for both runs (default: inductor on CUDA, eager on a CPU)")
    add_output(check, model_file=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    try:
        if args.command == "fit":
            status = run_fit(args, program=argv is None)  # argv None: the command line's own process
        else:
            status = _check(args) if args.command == "check" else _plan(args)
        if sys.stdout is not None:  # (None where it was closed: print wrote nothing)
            sys.stdout.flush()  # what is still buffered is written here, where a reader gone away is caught
        return status
    except UsageError as e:
        print(f"fxoffload {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _reader_gone()


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit with status 2 naming the arguments ``command`` does not take, in its own usage (the top level's
    said only ``fxoffload {plan,fit,check}``, a trial found), with the flags close to a misspelt one."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [f for action in sub._actions for f in action.option_strings if f.startswith("--")]
    hints = []
    for argument in unknown:
        near = difflib.get_close_matches(argument.split("=")[0], flags, n=2) if argument.startswith("--") else []
        if near:
            hints.append(f"{argument}: did you mean {' or '.join(near)}?")
    sub.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"; {h}" for h in hints)
              + f" (fxoffload {command} --help lists its flags)")


def _reader_gone() -> int:
    """Standard output's reader went away (``fxoffload fit | head``): status 1 without a traceback, and
    standard output pointed at the null device, so that Python's flush at exit raises nothing again (a
    reader of standard error gone too would end the command as Python ends it)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's captured stream): nothing to flush
        pass
    return 1


def _check(args: argparse.Namespace) -> int:
    """``fxoffload check``: see ``fxoffload.tools.check``."""

    budget = None if args.budget.lower() == "none" else number_or_text(args.budget)
    try:
        parse_budget(budget)
        config = CheckConfig(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch, steps=args.steps,
                             memory_budget=budget, inner=args.inner)
    except OptionError as e:
        raise UsageError(f"--budget: {flag_detail(e.detail)}") from None
    except ValueError as e:
        raise UsageError(f"--{e}") from None
    progress = Progress(args.quiet)
    report = run_check(config, progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
    return 0 if report.passed else 1


def _plan(args: argparse.Namespace) -> int:
    """``fxoffload plan``: see ``fxoffload.tools.plan_command``; prints the report (or its JSON)."""
    outcome = run_plan(args)
    if args.json:
        print(json.dumps(outcome.report, indent=2))
    else:
        print_report(outcome.report, outcome.records)
    return 0
