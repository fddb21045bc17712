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
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from fxoffload.report import plan_report, print_report, range_report, step_report, with_optimizer

__all__ = ["main"]


class Progress:
    """Timestamped progress lines on stderr (tracing a 7B graph takes tens of seconds)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.start = quiet, time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    from fxoffload.models import CHECKPOINTING, DTYPES, PRESETS
    from fxoffload.passes import OPTIMIZERS
    from fxoffload.profiles import PROFILES

    parser = argparse.ArgumentParser(prog="fxoffload", description="fxoffload: activation offloading for torch.compile")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan", help="plan a model with fake tensors and predict its step (nothing runs on a GPU)",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
        epilog=f"presets: {', '.join(PRESETS)}. profiles: {', '.join(PROFILES)}. "
               "All figures are predictions (simulated), not measurements.",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"a built-in architecture: {', '.join(PRESETS)}")
    source.add_argument("--config", help="a transformers config.json (or the folder holding it)")
    source.add_argument("--model", help="a Python file defining build(batch, seq, dtype) -> (model, inputs)")
    plan.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    plan.add_argument("--seq", help="sequence length (default: the model's, at most 4096), or a range LO:HI: one "
                                    "graph for every length in it (dynamic shapes), planned at HI, with the "
                                    "figures at both ends")
    plan.add_argument("--image-size", type=int, help="image side in pixels, for vision models (default: the model's)")
    plan.add_argument("--dtype", default="bf16",
                      help=f"parameter and activation dtype: {', '.join(DTYPES)} (default bf16)")
    plan.add_argument("--layers", type=int, help="plan only the first N layers (a quick slice)")
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
    plan.add_argument("--device-budget", default="none",
                      help="device_budget: the step's device peak (graph inputs, every tensor the step creates, "
                           "and --reserved) as a size (80GiB) or bytes, instead of --budget; 'none' (default)")
    plan.add_argument("--reserved", default="0",
                      help="reserved: device bytes the graphs cannot see (optimizer state, allocator slack), "
                           "counted against --device-budget, as a size or bytes (default 0)")
    plan.add_argument("--optimizer", default="none", choices=tuple(OPTIMIZERS),
                      help="the optimizer the step ends with: its state (AdamW: two moments per parameter) is "
                           "reserved under --device-budget, and its step (a memory-bound pass over parameters, "
                           "gradients and state) is added to the step's predicted time (default none)")
    plan.add_argument("--host-budget", default="none",
                      help="host_budget: pinned host memory the step's copies may take, as a size (64GiB) or bytes; "
                           "'none' (default): unbounded")
    plan.add_argument("--horizon", default="auto", help="prefetch horizon: 'auto' or a number of compute ops")
    plan.add_argument("--profile", default="h100-pcie5", help=f"device profile: {', '.join(PROFILES)}")
    plan.add_argument("--min-bytes", default="64KiB", help="smallest storage worth a transfer (default 64KiB)")
    plan.add_argument("--solver", default="auto", help="auto, milp or greedy")
    plan.add_argument("--strategy", default="auto",
                      help="auto (keep, offload or recompute), offload or recompute (default auto)")
    plan.add_argument("--no-cross-graphs", action="store_true",
                      help="keep every copy inside its own compiled graph (cross_graphs=False)")
    plan.add_argument("--output", default="fxoffload-plan.png",
                      help="plot path, .png/.svg/.pdf (default fxoffload-plan.png)")
    plan.add_argument("--no-plot", action="store_true", help="do not write the plot")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout instead of tables")
    plan.add_argument("--quiet", action="store_true", help="no progress on stderr")
    plan.add_argument("--traceback", action="store_true",
                      help="show the full traceback when a model file fails, instead of one line")
    plan.add_argument("--all-eligible", action="store_true",
                      help="with --budget none: offload (or under --strategy recompute, recompute) every eligible "
                           "saved tensor, whether or not that lowers the peak, as naive offloading does")
    from fxoffload.fit_command import add_fit_parser

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
    check.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    check.add_argument("--hidden", type=int, help="hidden size (default: 512 on CUDA, 64 on a CPU)")
    check.add_argument("--seq", type=int, help="sequence length (default: 512 on CUDA, 64 on a CPU)")
    check.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    check.add_argument("--budget", default="0.5", help="memory_budget for fxoffload (default 0.5)")
    check.add_argument("--inner", choices=("eager", "inductor"),
                       help="inner compiler, for both runs (default: inductor on CUDA, eager on a CPU)")
    check.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    check.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


class UsageError(ValueError):
    """Bad input to the command; its message is printed as is."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "fit":
            from fxoffload.fit_command import run_fit

            return run_fit(args)
        return _check(args) if args.command == "check" else _plan(args)
    except UsageError as e:
        print(f"fxoffload {args.command}: error: {e}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> int:
    """``fxoffload check``: see ``fxoffload.check``."""
    from fxoffload.check import CheckConfig, format_report, run_check
    from fxoffload.config import OptionError, parse_budget

    budget = None if args.budget.lower() == "none" else number_or_text(args.budget)
    try:
        parse_budget(budget)
        config = CheckConfig(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch, steps=args.steps,
                             memory_budget=budget, inner=args.inner)
    except OptionError as e:
        raise UsageError(f"--budget: {e.detail}") from None
    except ValueError as e:
        raise UsageError(f"--{e}") from None
    progress = Progress(args.quiet)
    report = run_check(config, progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
    return 0 if report.passed else 1


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from fxoffload.config import OffloadConfig, OptionError

    budget: Any = _memory_budget(args)
    device_budget: Any = None if args.device_budget.lower() == "none" else number_or_text(args.device_budget)
    horizon: Any = args.horizon if args.horizon == "auto" else number_or_text(args.horizon)
    host_budget: Any = None if args.host_budget.lower() == "none" else number_or_text(args.host_budget)
    options = dict(memory_budget=budget, horizon=horizon, device_profile=args.profile, min_bytes=min_bytes_of(args),
                   solver=args.solver, strategy=args.strategy, inner="eager", cross_graphs=not args.no_cross_graphs,
                   host_budget=host_budget, device_budget=device_budget, reserved=number_or_text(args.reserved),
                   all_eligible=args.all_eligible)
    try:
        OffloadConfig(**options)
    except OptionError as e:
        flag = _FLAGS.get(e.option)
        raise UsageError(f"{flag}: {e.detail}" if flag else str(e)) from None
    for flag in ("batch", "image_size", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: got {value}; accepted: an integer >= 1")
    _seq_range(args.seq)  # checked here with the other flags, before anything is built
    return options


def min_bytes_of(args: argparse.Namespace) -> Any:
    """``--min-bytes`` as a number of bytes (a size like 1MiB is parsed); a UsageError naming the forms."""
    from fxoffload.config import parse_budget

    min_bytes = number_or_text(args.min_bytes)
    if isinstance(min_bytes, (str, float)):
        try:
            min_bytes = parse_budget(str(min_bytes)).nbytes
        except (ValueError, AttributeError):
            raise UsageError(f"--min-bytes: got {args.min_bytes!r}; accepted: a number of bytes or a size like 1MiB")
    return min_bytes


def _budget_text(args: argparse.Namespace) -> str:
    """``--budget`` as given, else 0.5, or none under ``--device-budget`` (the two are exclusive)."""
    return args.budget if args.budget is not None else ("0.5" if args.device_budget.lower() == "none" else "none")


def _memory_budget(args: argparse.Namespace) -> Any:
    text = _budget_text(args)
    return None if text.lower() == "none" else number_or_text(text)


def _device_budget_report(options: dict) -> dict:
    """The step's device budget and what is reserved of it, in bytes (None: no device budget)."""
    from fxoffload.config import OffloadConfig

    config = OffloadConfig(**options)
    return {"device_budget_bytes": config.device_budget_bytes, "reserved_bytes": config.reserved_bytes}


# The plan command's flag for each option it sets (an error about another option keeps its own name).
_FLAGS = {"memory_budget": "--budget", "device_profile": "--profile", "horizon": "--horizon", "solver": "--solver",
          "strategy": "--strategy", "min_bytes": "--min-bytes", "host_budget": "--host-budget",
          "device_budget": "--device-budget", "reserved": "--reserved", "all_eligible": "--all-eligible"}


def number_or_text(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def model_source(args: argparse.Namespace):
    from fxoffload import models

    if args.preset or args.config:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UsageError("--preset and --config models are built with transformers, which is not installed; "
                             "pip install 'fxoffload[models]'") from None
    if args.preset:
        return models.from_preset(args.preset, args.layers)
    if args.config:
        return models.from_config_file(args.config, args.layers)
    if args.layers is not None:
        raise UsageError("--layers: applies to --preset and --config models only (a model file builds its own)")
    return models.from_python_file(args.model)


def _plan(args: argparse.Namespace) -> int:
    from fxoffload.models import DTYPES, ModelError

    progress = Progress(args.quiet)
    options = _options(args)
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: got {args.dtype!r}; accepted: {', '.join(DTYPES)}")
    if not args.no_plot and Path(args.output).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"--output: got {args.output!r}; accepted: a path ending in .png, .svg or .pdf")
    try:
        source = model_source(args)
        lengths = _seq_range(args.seq)
        seq = args.image_size or (lengths[-1] if lengths else None) or source.default_seq
        records, invocations, seconds, optimizer = trace_step(source, args, seq, DTYPES[args.dtype], options, progress,
                                                          lengths)
    except ModelError as e:
        if args.traceback and e.__cause__ is not None:
            raise
        raise UsageError(str(e)) from None
    progress(f"simulating {len(records)} graph(s) on {options['device_profile']}, and the step of "
             f"{len(invocations)} invocation(s)")
    report = plan_report(records, model=source.name, batch=args.batch, seq=seq, dtype=args.dtype,
                         layers=source.layers, checkpointing=args.checkpointing, budget=_budget_text(args),
                         horizon=args.horizon)
    report.update(_device_budget_report(options))
    if lengths and len(lengths) == 2:
        for graph, record in zip(report["graphs"], records):
            graph["range"] = range_report(record, lengths, options["memory_budget"])
    report["step"] = step_report(invocations, options["memory_budget"])
    report["step"].update(with_optimizer(report["step"], optimizer))
    if not args.no_plot:
        for path, record in zip(_plot_paths(Path(args.output), len(records)), records):
            from fxoffload.plot import plot

            plot(record, path, title=f"{source.name}, batch {args.batch} x {seq}, {args.dtype}, graph {record.index}: "
                                     f"predicted on {record.profile.name} (simulated, not measured)")
            report["plots"].append(str(path))
            progress(f"wrote {path}")
        if len(invocations) > 1:  # the whole step: every run, copies crossing run boundaries
            from fxoffload.plot import plot_step

            path = Path(args.output)
            path = path.with_name(f"{path.stem}-step{path.suffix}")
            plot_step(invocations, path, budget=report["step"]["budget_bytes"],
                      title=f"{source.name}, batch {args.batch} x {seq}, {args.dtype}: the step of "
                            f"{len(invocations)} graph runs, predicted on {invocations[0].profile.name} "
                            "(simulated, not measured)")
            report["plots"].append(str(path))
            progress(f"wrote {path}")
    report["seconds"] = seconds
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, records)
    return 0


def trace_step(source: Any, args: argparse.Namespace, seq: int, dtype: torch.dtype, options: dict, progress: Progress,
           lengths: tuple[int, ...] | None = None):
    """Build and compile one fake training step (see :class:`_Traced`). The optimizer's state (see
    ``--optimizer``) joins what is reserved under a device budget."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fxoffload
    from fxoffload.explain import format_stages
    from fxoffload.models import checkpoint_layers, layer_list

    torch._dynamo.reset()
    seconds = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        progress(f"building {source.name} with fake tensors (batch {args.batch}, size {seq}, {dtype})")
        start = time.perf_counter()
        step, inputs, kwargs = source.build(args.batch, seq, dtype)
        wrapped = checkpoint_layers(step, args.checkpointing, source.origin)
        if wrapped:
            progress(f"checkpointing ({args.checkpointing}) each of {wrapped} layers")
        seconds["build"] = time.perf_counter() - start
        optimizer = _optimizer(step, args.optimizer, options)
        if optimizer["state_bytes"] and options.get("device_budget") is not None:
            options = _reserve_optimizer_state(options, optimizer)
        if lengths and len(lengths) == 2:
            _mark_lengths(inputs, kwargs, *lengths)
        progress("tracing and planning: dynamo, AOTAutograd, min-cut partitioner, fxoffload passes")
        start = time.perf_counter()
        blocks = list(layer_list(step) or ()) if args.per_layer else []
        if args.per_layer and not blocks:
            raise UsageError(f"--per-layer: {source.name} has no list of repeated layers (an nn.ModuleList "
                             "of one layer class) to compile one at a time")
        # One graph serves every layer: plan it for the step's runs of it.
        backend = fxoffload.offload_backend(**options, **({"runs_per_step": len(blocks)} if blocks else {}))
        try:
            if blocks:
                progress(f"compiling each of {len(blocks)} {type(blocks[0]).__name__} layers on its own")
                for block in blocks:
                    block.compile(backend=backend)
                step(*inputs, **kwargs)  # the rest of the step runs eagerly, on fake tensors
            else:
                torch.compile(step, backend=backend)(*inputs, **kwargs)
        except Exception as e:
            error = _usage_error(e, source, args.traceback)
            if error is e:
                raise
            raise error from None
        seconds["trace_and_plan"] = time.perf_counter() - start
    torch._dynamo.reset()
    _check_compiled(backend, blocks, source)
    stages: dict[str, float] = {}
    for record in backend.records:
        for stage, spent in record.pass_seconds:
            stages[stage] = stages.get(stage, 0.0) + spent
    seconds["fxoffload_passes"] = sum(stages.values())
    seconds["fxoffload_stages"] = stages
    progress(f"planned {len(backend.records)} graph(s) in {seconds['trace_and_plan']:.1f} s "
             f"(fxoffload passes {format_stages(tuple(stages.items()))})")
    return _Traced(backend.records, backend.step_invocations() or list(backend.records), seconds, optimizer)


class _Traced(NamedTuple):
    """What tracing and planning one step gave: the records, the step's invocations (records in the
    order they ran), wall times (measured) and the optimizer's figures (predicted: ``_optimizer``)."""

    records: list
    invocations: list
    seconds: dict
    optimizer: dict


def _optimizer(step: Any, kind: str, options: dict) -> dict:
    """The optimizer's figures for the model's parameters (predicted): state bytes and step seconds."""
    from fxoffload.passes import tensor_nbytes
    from fxoffload.passes import optimizer_step
    from fxoffload.profiles import resolve_profile

    if kind != "none" and not isinstance(step, torch.nn.Module):
        raise UsageError(f"--optimizer {kind}: the model's step is not a torch.nn.Module, so its parameters are "
                         "unknown; accepted: a model that is one, or --optimizer none")
    parameters = list(step.parameters()) if isinstance(step, torch.nn.Module) else []
    parameter_bytes = sum(int(tensor_nbytes(p)) for p in parameters)
    cost = optimizer_step(kind, parameter_bytes, resolve_profile(options["device_profile"]))
    return {"kind": kind, "parameter_bytes": parameter_bytes, "state_bytes": cost.state_bytes,
            "step_time": cost.seconds}


def _reserve_optimizer_state(options: dict, optimizer: dict) -> dict:
    """``options`` with the optimizer's state added to what is reserved of the device budget."""
    from fxoffload.config import OffloadConfig, OptionError
    from fxoffload.explain import format_bytes

    reserved = OffloadConfig(**options).reserved_bytes + optimizer["state_bytes"]
    try:
        OffloadConfig(**{**options, "reserved": reserved})
    except OptionError:
        raise UsageError(f"--optimizer {optimizer['kind']}: its state ({optimizer['state_bytes']} B, "
                         f"{format_bytes(optimizer['state_bytes'])}) and --reserved ({options['reserved']}) take "
                         f"{reserved} B, nothing left of --device-budget {options['device_budget']}; accepted: a "
                         "larger --device-budget, or less reserved") from None
    return {**options, "reserved": reserved}


def _usage_error(error: Exception, source: Any, traceback: bool) -> Exception:
    """What to raise for an error while tracing and planning: a one-line UsageError for an impossible
    budget, a bad model, or any failure of a model file's own code (unless --traceback); else ``error``."""
    from fxoffload.models import ModelError, one_line
    from fxoffload.passes import ADVICE_WARN, BudgetInfeasibleError

    cause = _cause(error, (BudgetInfeasibleError, ModelError))
    if isinstance(cause, BudgetInfeasibleError):
        # The command plans for the budget it is given: the advice to warn instead does not apply.
        advice = [a for a in cause.advice if a != ADVICE_WARN]
        return UsageError(f"impossible budget: {cause.explained(advice)}")
    if isinstance(cause, ModelError):
        return UsageError(str(cause))
    if source.user_code and not traceback:
        return UsageError(f"{source.origin}: tracing the training step (dynamo, AOTAutograd) failed: "
                          f"{one_line(list(_chain(error))[-1])} (--traceback shows where)")
    return error


def _check_compiled(backend: Any, blocks: list, source: Any) -> None:
    if blocks and not backend.records:
        kind = type(blocks[0])
        raise UsageError(
            f"--per-layer: compiling each {kind.__name__} layer of {source.name} on its own gave no graph"
            + (f": dynamo skipped torch.nn's own module {kind.__module__}.{kind.__name__} (torch 2.13 and earlier do "
               "not compile torch.nn's modules one at a time); "
               "put each layer in a module class of your own" if kind.__module__.startswith("torch.nn") else ""))
    if not backend.records:
        raise UsageError(f"{source.name}: nothing to plan: the step compiled no graph that needs a backward")


def _seq_range(text: str | None) -> tuple[int, ...] | None:
    """``--seq``: None, (length,) or (lo, hi)."""
    if text is None:
        return None
    accepted = "accepted: a length like 4096, or a range LO:HI like 1024:4096 with 2 <= LO < HI"
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"--seq: got {text!r}; {accepted}")
    values = tuple(int(p) for p in parts)
    if len(values) == 2 and not 2 <= values[0] < values[1] or values[0] < 1:
        raise UsageError(f"--seq: got {text!r}; {accepted}")
    return values


def _mark_lengths(inputs: tuple, kwargs: dict, lo: int, hi: int) -> None:
    """One graph for every length in [lo, hi]: the token ids' sequence dimension is dynamic, bounded."""
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if ids is None or kwargs.get("pixel_values") is not None:
        raise UsageError("--seq LO:HI: needs a text model whose inputs are token ids (input_ids, batch x length)")
    torch._dynamo.mark_dynamic(ids, 1, min=lo, max=hi)


def _chain(error: BaseException):
    """``error`` and the errors it wraps, outermost first (dynamo wraps the model's and the backend's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__


def _cause(error: BaseException, kinds: tuple) -> BaseException | None:
    return next((e for e in _chain(error) if isinstance(e, kinds)), None)


def _plot_paths(path: Path, count: int) -> list[Path]:
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]
