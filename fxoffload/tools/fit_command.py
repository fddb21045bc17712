"""The ``fxoffload fit`` command: will a model train on a GPU, and at what length, per strategy.

    fxoffload fit --preset llama-3-8b --device-memory 80GB --reserved 16GB --profile h100-pcie5 --batch 1

For each row of ``fxoffload.tools.fit.SETUPS`` (plain, checkpointing, checkpointing+offload, fxoffload at
most +1%, fxoffload) it
searches the longest sequence on a grid (``--granularity``, 256 tokens by default; with ``--seq``,
the largest batch instead) whose predicted device peak, with what is reserved, fits the device's
memory: each probe plans one training step as one graph and reads the plan's device peak
(``fxoffload.tools.fit.largest_fitting`` picks the sizes). The step is traced (the model built with
fake tensors, compiled with the fxoffload backend, ``inner="eager"``, nothing runs) once per
checkpointing mode with the sequence length symbolic, where fit searches the lengths of a preset's or
a config's text model: each probe is planned with every size evaluated at its length
(``fxoffload.passes.fixed_sizes``), the plan a trace at that length gives (a test checks it); a batch
search (``--seq``) of a preset's or a config's model (an image model's too) likewise with the batch
symbolic. A model file (whose own ``build`` may depend on the sizes) and an image model's size search
are traced once per size instead (the latest ``KEPT_TRACES`` kept), and so is each size where a guard
of the symbolic trace on the size does not hold (a step whose ops depend on it; fit says so). Every
setup that probes a mode and size plans its joint graph again (``fxoffload.tools.tracing.plan_again``):
the plan a trace of its own would give (a test checks it).
Each checkpointing mode is searched in a process of its own (``--jobs``; spawned, each makes its
traces again from the arguments), one per mode and at most one per CPU by default. The rows searched
in both modes (fxoffload's) take the checkpointed answers as floors (``fxoffload.tools.fit.fit_rows``):
the search without checkpointing, in the command's own process, waits for them where it reaches
such a row (plain's search first), and plans once at a floor it does not reach.
Several profiles (``--profile h100-pcie5,a100-pcie4``) are fitted from the same traces (a trace does
not depend on the profile), each setup searched for one profile after the other; one report each.
With ``--per-layer`` each layer is compiled on its own (one graph serves them all, planned for their
runs) and the embedding, head and loss run eagerly: each probe's device peak is the layer graph's
planned runs beside the step's eager parts, measured on fake tensors with stand-in layers at that size
(``fxoffload.tools.layer_step``; a test measures the answers), and the ``fxoffload`` row plans the
layer graph's smallest device peak at its answer too.
It prints each row's answer with the predicted step time and tokens per second there, what sets the
limit (read at the next size up, planned too), the ``fxoffload plan`` command that reproduces the
answer, and plots device peak against size.
Every memory and time figure is a prediction; only the command's own run time is measured.

Limits: the step must compile to one graph (with ``--per-layer``, its layers to one graph and the rest
eager); a row's answer is exact on its grid for the plans made, not for the GPU's allocator (its slack
belongs in ``--reserved``). Per layer, step times are the layer graph's runs, the eager ops priced one
after another (copies are not hidden under them) and the optimizer's step, and a preset's or a config's
step is traced as a real step runs, without the full attention mask transformers builds on fake tensors
(``fxoffload.tools.models.unpacked_sequences``, as ``fxoffload plan --per-layer`` traces it).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxoffload.config import OffloadConfig, OptionError
from fxoffload.passes import (
    BudgetInfeasibleWarning, Why, fixed_sizes, optimizer_step, run_peaks, simulate,
    simulate_step, symbol_value, timeline_at,
)
from fxoffload.profiles import PROFILES, resolve_profile
from fxoffload.tools.fit import (
    SETUPS, WITHIN_ONE_PERCENT, FitError, Grid, Limit, LimitCode, Point, Probe, Row, Setup, best_rows,
    checkpointing_modes, chooses_checkpointing, floor_in, limit_at_peak, search_setups,
)
from fxoffload.tools.flags import add_batch, add_device, add_model_source, add_output, add_shape, flag_detail
from fxoffload.tools.layer_step import EagerParts, LayerStepError, layer_step_peak, measure_eager_parts
from fxoffload.tools.models import (
    DTYPES, PRESETS, ModelError, layer_list, one_line, unpacked_sequences,
)
from fxoffload.tools.plot import plot_fit
from fxoffload.tools.tracing import (
    Progress, UsageError, copies_layers, min_bytes_of, model_source, number_or_text, partitioned_anew, plan_again,
    reserve_optimizer_state, retry_wider, SizeRange, trace_step, with_layer_copies,
)


__all__ = ["add_fit_parser", "run_fit"]

# The longest sequence tried for a model that does not say how many positions it takes.
DEFAULT_MAX_SEQ = 131072
DEFAULT_MAX_BATCH = 256


def add_fit_parser(commands: Any) -> None:
    fit = commands.add_parser(
        "fit", help="the longest sequence (or largest batch) a GPU trains a model at, per strategy, predicted "
                    "from fake tensors (nothing runs on a GPU)",
        description=" ".join(__doc__.split("\n\n")[2].split()),
        epilog=f"presets: {', '.join(PRESETS)}. profiles: {', '.join(PROFILES)}. "
               "All figures are predictions (simulated), not measurements.")
    add_model_source(fit)
    fit.add_argument("--device-memory", required=True, help="the GPU's memory, as a size (80GB) or bytes")
    add_device(fit, several_profiles="each fitted from the same traces (a trace does not depend on the profile), "
                                      "one report each")
    add_batch(fit)
    fit.add_argument("--seq", type=_one_length, help="a sequence length: search the largest batch at it instead "
                                                      "(not a range, as in plan)")
    add_shape(fit)
    fit.add_argument("--per-layer", action="store_true",
                     help="each layer compiled on its own (one graph serving every layer, as FSDP2 and torchtitan "
                          "compile), the embedding, head and loss eager beside them and counted in the device peak")
    fit.add_argument("--granularity", type=int,
                     help="the search's grid: 256 tokens (default), or 1 for a batch search with --seq")
    fit.add_argument("--max-seq", type=int,
                     help=f"the longest sequence tried (default: the model's positions, else {DEFAULT_MAX_SEQ}; "
                          "not with --seq)")
    fit.add_argument("--max-batch", type=int,
                     help=f"the largest batch tried with --seq (default {DEFAULT_MAX_BATCH})")
    fit.add_argument("--jobs", type=int,
                     help="processes that search the checkpointing modes side by side (default: one per mode, at "
                          "most one per CPU; 1: one after the other, in this process)")
    add_output(fit, plot="fxoffload-fit.png")


def _one_length(text: str) -> int:
    """``--seq``'s value: one length (plan's ``LO:HI`` range is refused by name, not as "invalid int value")."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; accepted: one integer length (a range LO:HI is plan's: fit searches the longest sequence "
            "without --seq, the largest batch at one length with it)") from None


def run_fit(args: argparse.Namespace, *, program: bool = False) -> int:
    """``fxoffload fit``. ``program``: this process is the command itself (not a program calling it), and
    ends without freeing its traces once the report is printed (as fit's workers do: see
    :func:`_exit_without_freeing`; freeing an 8B step's trace took 5 s, 2026-11-29)."""
    started = time.perf_counter()
    progress = Progress(args.quiet)
    memory, reserved = _device_figures(args)
    profiles = _profiles(args)
    for name in profiles:  # checked here, before any process starts; each search makes its own
        _common_options(_for_profile(args, name))
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: got {args.dtype!r}; accepted: {', '.join(DTYPES)}")
    if not args.no_plot and Path(args.output).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"--output: got {args.output!r}; accepted: a path ending in .png, .svg or .pdf")
    source = _source(args)
    grid = _grid(args, source)
    modes = checkpointing_modes()
    jobs = min(args.jobs or os.cpu_count() or 1, len(modes))
    what = _searched_words("batch" if grid.by_batch else "seq", source.image)
    progress(f"searching {what} for {len(SETUPS)} setups of {source.name} on {', '.join(profiles)}: grid "
             f"{grid.step}, up to {grid.most}, against {memory / 1e9:.2f} GB"
             + (f"; {len(modes)} checkpointing modes in {jobs} processes" if jobs > 1 else ""))
    search = _search_kept if program else search_mode
    # The later modes first, the first (no checkpointing: the most probes) with their answers as floors
    # (fxoffload.tools.fit.fit_rows): a row its setup cannot win is not searched to its own answer.
    if jobs == 1:
        others = [search(args, mode) for mode in modes[1:]]
        searched = [search(args, modes[0], lambda: others), *others]
    else:  # spawned, not forked: a forked child inherits the parent's thread pools half made
        with ProcessPoolExecutor(jobs - 1, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_exit_without_freeing) as pool:
            # The first mode is searched here meanwhile, waiting for the others' answers where it needs
            # them: one process fewer to start and to import torch in (about 4 s of an 8B fit's 70, 2026-11-29).
            futures = [pool.submit(_search_kept, args, mode) for mode in modes[1:]]
            searched = [search(args, modes[0], lambda: [f.result() for f in futures])]
            searched += [f.result() for f in futures]
    reports = []
    for i, name in enumerate(profiles):
        one = _for_profile(args, name, plot_of=len(profiles) > 1)
        rows = best_rows([row for found, _ in searched for row in found[i]])
        reports.append(fit_report(rows, one, source, memory, reserved, grid))
        if not args.no_plot:
            reports[-1]["plot"] = _plot(rows, one, source, memory, grid)
            progress(f"wrote {one.output}")
    report = reports[0] if len(reports) == 1 else {"profiles": reports}
    report["seconds"] = time.perf_counter() - started
    report["traces"], report["jobs"] = sum(traced for _, traced in searched), jobs
    print(json.dumps(report, indent=2) if args.json else format_fit(report))
    if program:
        if sys.stdout is not None:  # a reader gone away raises here, for the command's status 1, before the exit
            sys.stdout.flush()
        _exit_without_freeing()
    return 0


# One mode's search: per profile, one row per setup; and the traces made.
Searched = tuple[list[list[Row]], int]


def search_mode(args: argparse.Namespace, mode: str, later: Callable[[], Sequence[Searched]] = tuple) -> Searched:
    """The setups of one checkpointing mode searched (here, or in a process of its own: everything is
    made again from ``args``): per profile (``_profiles``), one row per setup; and the traces made.
    ``later``: the other modes' searches (asked where first needed, it may wait for them), whose answers
    are this mode's floors (``fxoffload.tools.fit.fit_rows``)."""
    rows, traces = _searched(args, mode, later)
    return rows, traces.traced


# A worker's traces, kept to its end: see _exit_without_freeing.
_WORKER_TRACES: list = []


def _search_kept(args: argparse.Namespace, mode: str, later: Callable[[], Sequence[Searched]] = tuple) -> Searched:
    """:func:`search_mode`, its traces kept to the process's end rather than freed on return (in a worker
    of fit's pool, or the command's own process: each ends without freeing them, :func:`_exit_without_freeing`)."""
    rows, traces = _searched(args, mode, later)
    _WORKER_TRACES.append(traces)
    return rows, traces.traced


def _exit_without_freeing() -> None:
    """A worker's initializer, and the command's own process once its report is printed: the process ends
    without freeing what it holds (``os._exit(0)`` first thing at its exit, its output flushed). A step's
    trace is millions of Python objects, and freeing them at the process's end kept the command waiting
    for its workers (2.1 s after the answers for 8 layers of llama-3-8b; none since, 2026-11-29)."""
    def exit_now() -> None:
        status = 0
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # its reader gone (a pipe to `head`), or closed (None)
                status = 1
        os._exit(status)

    atexit.register(exit_now)


def _searched(args: argparse.Namespace, mode: str,
              later: Callable[[], Sequence[Searched]]) -> tuple[list[list[Row]], "_Traces"]:
    """One mode's setups searched for each profile, on one trace per mode (:class:`_Traces`): rows per profile.
    With several profiles each setup is searched for one profile after the other, its profile among its
    options (``device_profile``), so that each search starts from the answer just found (the profiles'
    answers lie close: the plain rows' are equal) and plans at lengths whose partition was just made.
    A setup whose row ``later``'s searches answered (on its profile) has that answer as its floor."""
    progress = Progress(args.quiet)
    memory, reserved = _device_figures(args)
    profiles = _profiles(args)
    common = _common_options(_for_profile(args, profiles[0]))
    source = _source(args)
    grid = _grid(args, source)
    traces = _Traces(args, source, DTYPES[args.dtype], common, grid, progress)
    evaluate = _evaluator(args, source, traces, memory, reserved, common, grid)
    setups = [dataclasses.replace(s, options={**s.options, "device_profile": name})
              for s in SETUPS if s.checkpointing == mode for name in profiles]

    def floor_of(setup: Setup) -> int | None:
        if not chooses_checkpointing(setup.row):  # (its row has no other mode's setup: nothing to wait for)
            return None
        at = profiles.index(setup.options["device_profile"])
        return floor_in([row for found, _ in later() for row in found[at]], setup)

    try:
        rows = search_setups(evaluate, memory, grid, setups=setups, progress=progress,
                             answers_again=not args.per_layer, floor_of=floor_of)
    except (ModelError, FitError) as e:
        raise UsageError(str(e)) from None
    finally:
        gc.unfreeze()  # the traces (frozen by _Traces._trace) and their garbage are the collector's again
    return [[row for row, s in zip(rows, setups) if s.options["device_profile"] == name] for name in profiles], traces


def _profiles(args: argparse.Namespace) -> list[str]:
    """``--profile``'s names (one, or several comma-separated), checked for blanks and repeats."""
    names = [name.strip() for name in args.profile.split(",")]
    if "" in names or len(set(names)) < len(names):
        raise UsageError(f"--profile: got {args.profile!r}; accepted: a profile name, or several different ones "
                         f"separated by commas ({', '.join(PROFILES)}, auto)")
    return names


def _for_profile(args: argparse.Namespace, name: str, plot_of: bool = False) -> argparse.Namespace:
    """``args`` for the one profile ``name``; ``plot_of``: the plot's file named after it as well
    (``fxoffload-fit-h100-pcie5.png``), one per profile."""
    output = Path(args.output)
    return argparse.Namespace(**{**vars(args), "profile": name,
                                 "output": str(output.with_stem(f"{output.stem}-{name}")) if plot_of else args.output})


def _source(args: argparse.Namespace) -> Any:
    try:
        return model_source(args)
    except ModelError as e:
        raise UsageError(str(e)) from None


def _plot(rows: list[Row], args: argparse.Namespace, source: Any, memory: int, grid: Grid) -> str:
    image = source.image
    fixed = f"{'image side' if image else 'sequence'} {args.seq}" if grid.by_batch else f"batch {args.batch}"
    searched = "image side (pixels)" if image else "sequence length (tokens)"
    plot_fit(rows, memory, args.output, "batch" if grid.by_batch else searched,
             f"{source.name}{', per layer' if args.per_layer else ''}, {fixed}, {args.dtype}: device peak against "
             f"{memory / 1e9:.0f} GB, predicted on "
             f"{args.profile} (simulated, not measured)")
    return args.output


def _grid(args: argparse.Namespace, source: Any) -> Grid:
    for flag in ("batch", "seq", "layers", "granularity", "max_seq", "max_batch", "jobs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: got {value}; accepted: an integer >= 1")
    # Each bound belongs to one search: the other's was ignored, unsaid (a trial, 2026-12-07).
    if args.seq is None and args.max_batch is not None:
        raise UsageError(f"--max-batch: got {args.max_batch} without --seq; it bounds the batch search at a sequence "
                         "length; accepted: with --seq (without it, fit searches the longest sequence: --max-seq)")
    if args.seq is not None and args.max_seq is not None:
        raise UsageError(f"--max-seq: got {args.max_seq} with --seq {args.seq}, which searches the largest batch at "
                         "that size; accepted: without --seq (with it: --max-batch)")
    if args.seq is not None:
        step, most = args.granularity or 1, args.max_batch or DEFAULT_MAX_BATCH
        if step > most:
            raise UsageError(f"--granularity: got {step}, above --max-batch {most}; accepted: at most it")
        return Grid(True, step, step, most)
    positions = source.positions
    most = args.max_seq or positions or DEFAULT_MAX_SEQ
    if positions is not None and most > positions:
        raise UsageError(f"--max-seq: got {most}; {source.name} takes at most {positions} positions "
                         "(max_position_embeddings); accepted: up to that")
    step = args.granularity or 256
    if step > most:
        raise UsageError(f"--granularity: got {step}, above the longest sequence tried ({most}); accepted: at most it")
    top = Limit(LimitCode.POSITIONS if most == positions else LimitCode.LARGEST_TRIED)
    return Grid(False, step, min(source.default_seq, most), most, top)


def _device_figures(args: argparse.Namespace) -> tuple[int, int]:
    """--device-memory and --reserved in bytes, checked as device_budget and reserved are."""

    try:
        config = OffloadConfig(device_budget=number_or_text(args.device_memory),
                               reserved=number_or_text(args.reserved))
    except OptionError as e:
        flag = {"device_budget": "--device-memory", "reserved": "--reserved"}.get(e.option, e.option)
        detail = e.detail.replace("accepted: None, ", "accepted: ") if flag == "--device-memory" else e.detail
        raise UsageError(f"{flag}: {detail}") from None  # (the device's memory is required: no None)
    return config.device_budget_bytes, config.reserved_bytes


def _common_options(args: argparse.Namespace) -> dict[str, Any]:
    host = None if args.host_budget.lower() == "none" else number_or_text(args.host_budget)
    options = dict(device_profile=args.profile, min_bytes=min_bytes_of(args), inner="eager", host_budget=host)
    try:
        OffloadConfig(**options)
    except OptionError as e:
        flag = {"device_profile": "--profile", "min_bytes": "--min-bytes", "host_budget": "--host-budget"}
        raise UsageError(f"{flag.get(e.option, e.option)}: {flag_detail(e.detail)}") from None
    return options


# Traces kept at once (each a whole step's joint graph; the searches come back to recent sizes).
KEPT_TRACES = 4


class _Symbolic(NamedTuple):
    """A step traced once with the size searched symbolic (its sequence length, or its batch): the trace,
    and the size's symbol, its shape environment, the sizes its guards allow (``lower`` to ``upper``) and
    the guards (and runtime asserts) on the size besides (sympy expressions). The trace stops at its joint
    graph (``joints_only``), before dynamo would check its guards against the sizes marked: a size is
    served where every guard holds there."""

    traced: Any
    shape_env: Any
    symbol: Any
    lower: int
    upper: int
    guards: tuple = ()

    def serves(self, size: int) -> bool:
        return self.lower <= size <= self.upper and all(_holds(guard, self.symbol, size) for guard in self.guards)


def _holds(guard: Any, symbol: Any, value: int) -> bool:
    """Whether a guard on ``symbol`` holds at ``value`` (False where it does not come out True or False)."""
    try:
        return bool(guard.xreplace({symbol: sympy.Integer(value)}))
    except TypeError:
        return False


def _guards_on(shape_env: Any, symbol: Any) -> tuple:
    """The shape environment's guards and runtime asserts that read ``symbol``, its replacements made in
    them (an image's batch: the labels' and the pixel values' sizes, marked apart, are one symbol in the
    graph by the replacement their equality guard made; that guard then holds at every size)."""
    asserts = [a.expr for found in getattr(shape_env, "deferred_runtime_asserts", {}).values() for a in found]
    replaced = (shape_env.replace(expr) for expr in [g.expr for g in shape_env.guards] + asserts)
    return tuple(expr for expr in replaced if symbol in getattr(expr, "free_symbols", ()))


class _Traces:
    """The step traced per checkpointing mode. Where the model built does not depend on the size
    searched (``ModelSource.symbolic_length``: a preset's or a config's text model; ``symbolic_batch``:
    a preset's or a config's model, text or image), once per mode (and the size held fixed) with the size
    searched symbolic (the token ids' length, or the inputs' batch: dynamo's ``mark_dynamic``, bounded by
    the search's grid), each probe planned at its size (``fixed_sizes``: the plan a trace at that size
    gives; a test checks it for each). Else (a model file, an image model's size, a symbolic trace that
    failed or whose guards leave a size out) once per size, the latest
    ``KEPT_TRACES`` kept. Every setup of a mode and size plans the same joint graph again
    (``plan_again``), as ``trace_step`` plans it."""

    def __init__(self, args: argparse.Namespace, source: Any, dtype: Any, common: dict, grid: Grid,
                 progress: Callable[[str], None] = lambda _: None) -> None:
        self._args, self._source, self._dtype, self._common = args, source, dtype, common
        lower = max(grid.step, 2)  # dynamo specializes sizes 0 and 1
        symbolic = (source.symbolic_batch if grid.by_batch else source.symbolic_length) and grid.most > lower
        self._range = (lower, grid.most) if symbolic else None
        self._by_batch = grid.by_batch
        self._what = "batch" if grid.by_batch else "length"
        self._example = min(max(grid.start, lower), grid.most)
        self._progress = progress
        self._kept: dict[tuple, Any] = {}  # per size: a trace of its own, or the symbolic one's joint to plan there
        # per (checkpointing, the size held fixed: the batch, or the length of a batch search); None: it failed
        self._symbolic: dict[tuple, _Symbolic | None] = {}
        self._eager: dict[tuple, EagerParts] = {}  # per (batch, seq), under --per-layer
        self.traced = 0  # traces made (the rest of the probes planned a kept one)

    def _split(self, batch: int, seq: int) -> tuple[int, int]:
        """(the size held fixed, the size searched) of ``(batch, seq)``."""
        return (seq, batch) if self._by_batch else (batch, seq)

    def _joined(self, fixed: int, size: int) -> tuple[int, int]:
        """(batch, seq) of the size held fixed and the size searched."""
        return (size, fixed) if self._by_batch else (fixed, size)

    @contextlib.contextmanager
    def at(self, checkpointing: str, batch: int, seq: int) -> Iterator[Any]:
        """Within: the step's trace to plan at ``(batch, seq)`` (``plan_again``), and read (sizes, times)."""
        fixed, size = self._split(batch, seq)
        symbolic = self._symbolic_trace(checkpointing, fixed) if self._range else None
        if symbolic is None or not symbolic.serves(size):
            if symbolic is not None and (checkpointing, batch, seq) not in self._kept:
                self._progress(f"the trace with the {self._what} symbolic (checkpointing {checkpointing}) does not "
                               f"serve {self._what} {size} (its guards: {symbolic.lower} to {symbolic.upper}"
                               + (f"; {', '.join(map(str, symbolic.guards))}" if symbolic.guards else "")
                               + f"): traced at that {self._what}")
            yield self._per_size(checkpointing, batch, seq)
            return
        key = (checkpointing, batch, seq)
        if key not in self._kept:  # its own default partition, made at this size
            self._keep(key, partitioned_anew(symbolic.traced))
        with fixed_sizes(symbolic.shape_env, {symbolic.symbol: size}):
            yield self._kept[key]

    def serving(self, checkpointing: str, batch: int, seq: int) -> _Symbolic | None:
        """The symbolic trace (made already) where it serves ``(batch, seq)``, else None."""
        fixed, size = self._split(batch, seq)
        symbolic = self._symbolic.get((checkpointing, fixed))
        return symbolic if symbolic is not None and symbolic.serves(size) else None

    def _symbolic_trace(self, checkpointing: str, fixed: int) -> _Symbolic | None:
        key = (checkpointing, fixed)
        if key not in self._symbolic:
            self._symbolic[key] = self._trace_symbolic(checkpointing, fixed)
        return self._symbolic[key]

    def _trace_symbolic(self, checkpointing: str, fixed: int) -> _Symbolic | None:
        lower, upper = self._range
        example = self._example
        if self._args.per_layer and not self._by_batch and example % 2 == 0:
            # Odd: a length no other dimension of a layer's inputs has (tracing.compile_layer marks theirs by
            # size; llama-3-8b's hidden size is the 4096 tokens fit tries first, and that trace failed).
            example += 1 if example < upper else -1 if example > lower else 0
        batch, seq = self._joined(fixed, example)
        try:
            traced = (self._trace_copying_layers(checkpointing, batch, seq)
                      or self._trace(checkpointing, batch, seq, symbolic=True))
        except Exception as e:  # noqa: BLE001 -- traced per size instead, which reports its own failure
            self._progress(f"tracing with the {self._what} symbolic (checkpointing {checkpointing}) failed "
                           f"({one_line(e)}): tracing each {self._what} instead")
            return None
        symbols = _input_symbols(traced.joints[0]) if len(traced.joints) == 1 else set()
        if len(symbols) != 1:
            self._progress(f"tracing with the {self._what} symbolic (checkpointing {checkpointing}) gave "
                           f"{len(traced.joints)} graph(s) and {len(symbols)} symbolic size(s), not one each: "
                           f"tracing each {self._what} instead")
            return None
        routing = _value_routed(traced.joints[0]) if self._args.per_layer else ""
        if routing:
            self._progress(f"the step traced with the {self._what} symbolic counts tensor values ({routing}: an "
                           f"MoE's routing), where the graph and its plans differ from a trace at each {self._what}: "
                           f"tracing each {self._what} instead")
            return None
        (symbol,) = symbols
        shape_env = traced.joints[0].context.fake_mode.shape_env
        allowed = shape_env.var_to_range[symbol]  # the guards may have narrowed what was marked
        return _Symbolic(traced, shape_env, symbol, max(int(allowed.lower), lower), min(int(allowed.upper), upper),
                         _guards_on(shape_env, symbol))

    def _trace_copying_layers(self, checkpointing: str, batch: int, seq: int) -> Any:
        """The step traced with a few layers (``LayerRepeat.traced``), its joint graph's layers copied to the
        model's (``with_layer_copies``), where the source builds fewer layers and they repeat; else None."""
        source = self._source
        repeat = copies_layers(source, self._args, batch, seq, self._dtype, self._progress)
        if repeat is None:
            return None
        while repeat is not None:
            try:
                with _paused_then_frozen():  # the copies' objects too are frozen out of the plans' collections
                    traced = self._trace(checkpointing, batch, seq, symbolic=True,
                                         source=source.with_layers(repeat.traced(source.layers)))
                    return with_layer_copies(traced, source.layers, self._common["device_profile"], repeat.period,
                                             repeat.head)
            except Exception as e:  # noqa: BLE001 (whatever the copies cannot do, a trace of every layer does)
                repeat = retry_wider(source, repeat, (batch, seq, self._dtype), e,
                                     f" (checkpointing {checkpointing})", self._progress)
        return None

    def _per_size(self, checkpointing: str, batch: int, seq: int) -> Any:
        key = (checkpointing, batch, seq)
        if key not in self._kept:
            traced = self._trace(checkpointing, batch, seq)
            if len(traced.joints) != 1:
                raise FitError(f"{self._source.name}: the step compiled to {len(traced.joints)} graphs (graph "
                               "breaks); fit needs it as one graph, whose device peak sees every tensor of the step")
            self._keep(key, traced)
        return self._kept[key]

    def _trace(self, checkpointing: str, batch: int, seq: int, symbolic: bool = False, source: Any = None) -> Any:
        # Traced to its joint graph, the compile stopped there (where the step is one graph; else planned
        # under the cheapest plan, keep everything): each setup plans the joint graph again.
        run = argparse.Namespace(batch=batch, checkpointing=checkpointing, per_layer=self._args.per_layer,
                                 optimizer=self._args.optimizer, traceback=self._args.traceback, keep_joints=True,
                                 joints_only=True)
        with _paused_then_frozen():
            ranged = SizeRange(0 if self._by_batch else 1, *self._range) if symbolic else None
            traced = trace_step(source or self._source, run, seq, self._dtype, {**self._common, "memory_budget": 1.0},
                                Progress(True), ranged)
        self.traced += 1
        return traced

    def eager_parts(self, batch: int, seq: int) -> EagerParts:
        """Under ``--per-layer``: the step's eager parts at ``(batch, seq)`` (``layer_step``), the model built
        again with fake tensors at that size (its checkpointing does not change them: the layers' places
        are taken by stand-ins)."""
        key = (batch, seq)
        if key not in self._eager:
            with FakeTensorMode(allow_non_fake_inputs=True), unpacked_sequences(self._source):
                step, inputs, kwargs = self._source.build(batch, seq, self._dtype)
                layers = layer_list(step)
                if layers is None:
                    raise FitError(f"--per-layer: {self._source.name} has no list of repeated layers (an "
                                   "nn.ModuleList of one layer class) to compile one at a time")
                try:
                    self._eager[key] = measure_eager_parts(step, list(layers), inputs, kwargs)
                except LayerStepError as e:
                    raise FitError(f"--per-layer: {self._source.name}: {e}") from None
        return self._eager[key]

    def _keep(self, key: tuple, traced: Any) -> None:
        if len(self._kept) >= KEPT_TRACES:
            del self._kept[next(iter(self._kept))]
        self._kept[key] = traced


@contextlib.contextmanager
def _paused_then_frozen() -> Iterator[None]:
    """Within: Python's cyclic garbage collector paused (a trace makes millions of objects, most of them
    kept; each full collection walked them all). After: every object left (the traces kept) frozen out of
    later collections (``gc.freeze``), so that the plans' collections do not walk the traces again; the
    search unfreezes them when it ends. On an 8B step: its symbolic trace 36.7 s -> 32.3 s, and six plans
    27.1 s -> 21.2 s (2026-11-29, this CPU). The first trace's garbage is frozen with it, not collected
    (1.6 million objects of an 8B trace, 2.0 s to collect, in a process of 0.7 GB: its search's memory,
    not a leak, 2026-11-29); a later trace first collects what the earlier ones left (a trace dropped
    since, and their garbage), so that tracing size after size does not hold every trace made."""
    enabled = gc.isenabled()
    earlier = gc.get_freeze_count()
    gc.unfreeze()
    if earlier:
        gc.collect()
    gc.disable()
    # Dynamo's own collection after a compile (of the younger generations: every object the trace made,
    # the collector being paused) would walk them once more.
    quiet = {"run_gc_after_compile": False} if hasattr(torch._dynamo.config, "run_gc_after_compile") else {}
    try:
        with torch._dynamo.config.patch(**quiet):
            yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


# Ops that count or select tensor values (an MoE's routing: transformers' experts count their tokens with histc).
# Where a step has them its symbolic trace was not the graph a trace at each length gives: Mixtral's kept a view a
# fixed length elides (its planned device peak at 448 tokens 0.9 MB, 3.4%, below its own trace's; a review,
# 2026-12-07), and Qwen3-MoE's step time differed in the fifth digit. Under --per-layer such a layer graph is
# traced at each length, as before 2026-12-07. The whole step is not (it would trace every layer at every length:
# minutes for a full-size MoE): its rows may differ from their plan commands (the guide's "Will it fit").
VALUE_ROUTED = ("aten.histc", "aten.bincount", "aten.nonzero", "aten.unique", "aten.masked_select")


def _value_routed(joint: Any) -> str:
    """The ops of ``VALUE_ROUTED`` in ``joint``'s graph, named, or ''."""
    found = sorted({str(n.target).rsplit(".", 1)[0] for n in joint.module.graph.nodes
                    if n.op == "call_function" and str(n.target).startswith(VALUE_ROUTED)})
    return ", ".join(found)


def _input_symbols(joint: Any) -> set:
    """The symbols of the sizes of a joint graph's inputs."""
    symbols: set = set()
    for value in torch.utils._pytree.tree_leaves(joint.joint_inputs):
        sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
        for size in sizes:
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
    return symbols


def _evaluator(args: argparse.Namespace, source: Any, traces: _Traces, memory: int, reserved: int, common: dict,
               grid: Grid) -> Callable[[Setup, int, bool], Point]:
    """Plans one step of a setup at a size (fake tensors, one graph, traced by ``traces``) and reads its
    device peak: see ``fxoffload.tools.fit.Setup`` for what a probe and an answer of a ``device_budget``
    setup plan."""

    def evaluate(setup: Setup, size: int, answer: bool) -> Point:
        batch, seq = (size, args.seq) if grid.by_batch else (args.batch, size)
        parts = traces.eager_parts(batch, seq) if args.per_layer else None
        with traces.at(setup.checkpointing, batch, seq) as traced:  # sizes read within: at this size
            return planned(setup, size, traced, answer, parts)

    def planned(setup: Setup, size: int, traced: Any, answer: bool, parts: EagerParts | None) -> Point:
        point, record = planned_point(setup, size, traced, answer, parts)
        host = {**common, **setup.options}.get("host_budget")
        if host is None or point.device_peak <= memory or not any(d.why is Why.HOST_BUDGET
                                                                 for d in record.plan.decisions):
            return point
        # Its plan kept tensors whose copies host_budget had no room for: the host budget is the limit
        # where the same setup, planned without it, fits.
        unbounded, _ = planned_point(dataclasses.replace(setup, options={**setup.options, "host_budget": None}),
                                     size, traced, answer, parts)
        if unbounded.device_peak > memory:
            return point
        return dataclasses.replace(point, limit=Limit(LimitCode.HOST_BUDGET, point.limit.figures))

    def planned_point(setup: Setup, size: int, traced: Any, answer: bool, parts: EagerParts | None) -> tuple:
        """The point ``setup`` plans at ``size``, and the record of its plan."""
        options = {**common, **setup.options}
        if parts is not None:
            options["runs_per_step"] = len(parts.forwards)
        # A budget of one byte, planned for the smallest device peak instead (per layer the answer is its
        # probe's plan: search_setups' answers_again).
        if setup.device_budget and not answer:
            options.update(device_budget=1, on_infeasible="warn")
        elif setup.device_budget:  # the optimizer's state joins what is reserved (for the smallest peak it
            # must not: one byte cannot hold it; it is added below like any reserved bytes)
            options.update(device_budget=memory, reserved=reserved)
            if traced.optimizer["state_bytes"]:
                options = reserve_optimizer_state(options, traced.optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetInfeasibleWarning)
            (record,) = plan_again(traced, options, rewrite=False)  # read only: the analysis kept per length
        optimizer = optimizer_step(args.optimizer, traced.optimizer["parameter_bytes"],
                                   resolve_profile(options["device_profile"]))
        if parts is not None:
            checkpointed = setup.checkpointing != "none"
            return _layer_step_point(size, record, parts, reserved, optimizer, memory, checkpointed), record
        fixed = reserved + optimizer.state_bytes
        limit = limit_at_peak(record, record.plan.input_bytes + fixed, memory, source.vocab,
                              setup.checkpointing != "none")
        peak = record.plan.device_peak_after + fixed
        return Point(size, peak, simulate(record).step_time + optimizer.seconds, limit,
                     _estimate(record, peak, *_neighbour(setup, size))), record

    def _neighbour(setup: Setup, size: int) -> tuple[int, _Symbolic | None]:
        """The next size up on the grid (down, at the largest), and the symbolic trace where it serves
        both sizes (the plan is of that trace), else None."""
        other = size + grid.step if size + grid.step <= grid.most else size - grid.step
        if other < grid.step:
            return other, None
        served = [traces.serving(setup.checkpointing, *((n, args.seq) if grid.by_batch else (args.batch, n)))
                  for n in (size, other)]
        return other, None if None in served else served[0]

    return evaluate


def _estimate(record: Any, peak: int, other: int, symbolic: _Symbolic | None) -> Probe | None:
    """The device peak at size ``other`` (a length, or a batch) of the plan ``record`` made at a device peak
    of ``peak`` from the symbolic trace ``symbolic`` (None: no estimate): ``peak`` and the difference of its
    largest run peak with the plan's sizes at ``other`` and as planned (the plan kept as it is, not planned
    there; every other symbol at the value the plan gave it)."""
    if symbolic is None:
        return None
    symbols = {s for lt in record.timeline.lifetimes if not isinstance(lt.expr, int) for s in lt.expr.free_symbols}
    values = {s: other if s == symbolic.symbol else symbol_value(symbolic.shape_env, s) for s in symbols}
    here = run_peaks(record.plan, record.timeline, record.schedule)
    there = run_peaks(record.plan, timeline_at(record.timeline, values), record.schedule)
    return Probe(other, peak + max(there.forward, there.backward) - max(here.forward, here.backward))


def _layer_step_point(size: int, record: Any, parts: EagerParts, reserved: int, optimizer: Any, memory: int,
                      checkpointed: bool) -> Point:
    """A planned size of a step whose layers run one graph (``--per-layer``): the device peak of its eager
    parts and the layer graph's runs (``layer_step``), with the step's resident bytes, what is reserved
    and the optimizer's state; the step time of the layer graph's runs, the eager ops (priced as nodes
    are, one after another) and the optimizer's step; the limit read from the largest share at the peak."""
    peak = layer_step_peak(parts, run_peaks(record.plan, record.timeline, record.schedule))
    fixed = parts.resident + reserved + optimizer.state_bytes
    figures = {"graph inputs and reserved": fixed, "eager parts (embedding, head, loss)": peak.eager,
               "held by the layer runs for their backwards": peak.held,
               "a layer run's own tensors and the runs' gradients": peak.other}
    largest = max(("eager", "held", "other"), key=lambda share: getattr(peak, share))
    if fixed >= memory:
        code = LimitCode.FIXED_BYTES
    elif largest == "eager":  # between the forwards and the backwards, the head's: the logits
        code = LimitCode.LOGITS if peak.phase == "between" else LimitCode.TEMPORARIES
    elif largest == "held":
        code = LimitCode.LAYER_INPUTS if checkpointed else LimitCode.SAVED_ACTIVATIONS
    else:
        code = LimitCode.TEMPORARIES
    step_time = simulate_step([record] * len(parts.forwards)).step_time + parts.seconds(record.profile)
    return Point(size, fixed + peak.nbytes, step_time + optimizer.seconds, Limit(code, figures))


def _plan_command(args: argparse.Namespace, row: Row, batch: int, seq: int, image: bool) -> str:
    """The ``fxoffload plan`` command that plans the row's answer alone (``image``: ``ModelSource.image``; an
    image model's size is its ``--image-size``, which ``plan`` takes where it refuses ``--seq``)."""
    source = next(f"--{flag} {getattr(args, flag)}" for flag in ("preset", "config", "model") if getattr(args, flag))
    words = ["fxoffload plan", source] + ([f"--layers {args.layers}"] if args.layers else [])
    words += ["--per-layer"] if args.per_layer else []
    size = "--image-size" if image else "--seq"
    words += [f"{size} {seq} --batch {batch} --dtype {args.dtype} --profile {args.profile}"]
    if row.checkpointing != "none":
        words.append(f"--checkpointing {row.checkpointing}")
    words.append({"plain": "--budget 1.0", "checkpointing": "--budget 1.0",
                  "checkpointing+offload": "--budget none --strategy offload --all-eligible",
                  WITHIN_ONE_PERCENT: "--budget none --max-overhead 1%"}.get(
        row.name, f"--device-budget {args.device_memory} --reserved {args.reserved}"))
    if args.optimizer != "none":
        words.append(f"--optimizer {args.optimizer}")
    if args.host_budget.lower() != "none":
        words.append(f"--host-budget {args.host_budget}")
    if args.min_bytes != "64KiB":
        words.append(f"--min-bytes {args.min_bytes}")
    return " ".join(words)


def _smallest_per_layer(args: argparse.Namespace, row: Row) -> bool:
    """Whether the row's answer is the layer graph's smallest device peak, which no ``plan`` flag asks for
    (``--per-layer``: a device budget would bound the layer graph alone)."""
    return args.per_layer and any(s.device_budget for s in SETUPS if s.row == row.name)


def fit_report(rows: list[Row], args: argparse.Namespace, source: Any, memory: int, reserved: int,
               grid: Grid) -> dict:
    """The command's JSON: the setting, then one entry per row."""
    out = []
    blind = [row.name for row in rows if _size_blind(row)]
    image = source.image  # its size is the image's side: images, not tokens, a second
    for row in rows:
        batch, seq = (row.size, args.seq) if grid.by_batch else (args.batch, row.size)
        fit = row.fit
        rate = fit.step_time and not blind if fit else False
        out.append({
            "name": row.name, "max_seq": seq, "batch": batch, "checkpointing": row.checkpointing,
            "device_peak": fit.device_peak if fit else None,
            "step_time": fit.step_time if fit else None,
            # (a step blind to the size in one row is in every row: the rows that start from another's
            # answer plan one size only, where the blindness cannot show)
            "tokens_per_second": batch * seq / fit.step_time if rate and not image else None,
            "images_per_second": batch / fit.step_time if rate and image else None,
            "limit": row.limit.code.name.lower().replace("_", "-"), "limit_words": row.limit.words,
            "next": None if row.over is None else {"size": row.over.size, "device_peak": row.over.device_peak},
            "planned": [{"size": p.size, "device_peak": p.device_peak} for p in row.probes],
            "command": (_plan_command(args, row, batch, seq, image)
                        if fit and not _smallest_per_layer(args, row) else None),
        })
    return {
        "model": source.name, "searched": "batch" if grid.by_batch else "seq", "image": image, "batch": args.batch,
        "per_layer": args.per_layer,
        "seq": args.seq, "dtype": args.dtype, "profile": args.profile, "device_memory": memory,
        "reserved": reserved, "optimizer": args.optimizer, "granularity": grid.step, "most": grid.most,
        "note": "device peaks and step times are predictions (memory model, cost model, simulator), not "
                "measurements; seconds is this command's own run time, measured",
        "size_blind": blind,
        "rows": out,
    }


def _size_blind(row: Row) -> bool:
    """Whether the row's device peak was the same at every size it planned, up to the largest tried: a model
    whose step does not grow with the size searched (a model file whose inputs ignore ``seq``), whose
    tokens per second would count tokens it never sees (67 billion a second, before 2026-12-06)."""
    return (row.limit.code == LimitCode.LARGEST_TRIED and len({p.size for p in row.probes}) > 1
            and len({p.device_peak for p in row.probes}) == 1)


def format_fit(report: dict) -> str:
    """The report as a table, each row's limit and its plan command below it; with several profiles
    (``report["profiles"]``), one such table per profile."""
    if "profiles" in report:
        tables = [_format_profile(one) for one in report["profiles"]]
        return "\n\n".join(tables) + (f"\n\nfit ran {report['seconds']:.0f} s here (measured), for "
                                      f"{len(tables)} profiles from the same traces")
    return _format_profile(report) + f"\n\nfit ran {report['seconds']:.0f} s here (measured)"


def _searched_words(searched: str, image: bool) -> str:
    if searched == "batch":
        return "the largest batch"
    return "the largest image side" if image else "the longest sequence"


def _format_profile(report: dict) -> str:
    memory = report["device_memory"] / 1e9
    image = report.get("image", False)
    lines = [f"{report['model']}, {report['dtype']}, on {report['profile']} with {memory:.2f} GB "
             f"({report['reserved'] / 1e9:.2f} GB reserved, optimizer {report['optimizer']}), grid "
             f"{report['granularity']} up to {report['most']}: predicted (memory model, cost model, simulator), "
             "not measured",
             f"searched: {_searched_words(report['searched'], image)}"
             + ("; each layer compiled on its own, the embedding, head and loss eager beside them (step times: the "
                "layer graph's runs, then the eager ops one after another)" if report.get("per_layer") else ""),
             f"{'row':<30}{'image' if image else 'seq':>8}{'batch':>7}{'device peak':>14}{'step time':>12}"
             f"{'images/s' if image else 'tokens/s':>11}  limit"]
    for row in report["rows"]:
        peak = "-" if row["device_peak"] is None else f"{row['device_peak'] / 1e9:.2f} GB"
        step = "-" if row["step_time"] is None else f"{row['step_time']:.3f} s"
        per_second = row["images_per_second"] if image else row["tokens_per_second"]
        rate = "-" if per_second is None else f"{per_second:,.{1 if image else 0}f}"
        chose = chooses_checkpointing(row["name"]) and row["checkpointing"] != "none"
        name = row["name"] + (" (ckpt)" if chose else "")
        lines.append(f"{name:<30}{row['max_seq']:>8}{row['batch']:>7}{peak:>14}{step:>12} {rate:>10}  {row['limit']}")
    lines.append("")
    if report.get("size_blind"):
        searched = "batch" if report["searched"] == "batch" else "image side" if image else "sequence length"
        lines += [f"the device peak was the same at every {searched} planned (rows {', '.join(report['size_blind'])}): "
                  f"the step does not grow with it (a model file whose inputs ignore it?); "
                  f"{'images/s' if image else 'tokens/s'} not given", ""]
    for row in report["rows"]:
        up = row["next"]
        at = f"at {up['size']}, {up['device_peak'] / 1e9:.2f} GB: " if up else ""
        lines.append(f"{row['name']}: limit {at}{row['limit_words']}")
        if row["command"]:
            lines.append(f"  {row['command']}")
        elif row["device_peak"] is not None:
            lines.append("  (the layer graph's smallest device peak: no plan flag asks for it)")
    return "\n".join(lines)

