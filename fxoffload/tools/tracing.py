"""The tracer of ``fxoffload plan`` and ``fxoffload fit``: a model source (a preset, a config file, a
model file) built with fake tensors for a step (batch, length, dtype, checkpointing), compiled with the
fxoffload backend, and what that gave (:func:`trace_step`); for a model of many alike layers, four of them
traced and the joint graph's layers copied to the model's (:func:`trace_copying_layers`: the same joint graph,
its nodes named by FX rather than by the trace). Also what the commands share to read their
flags (:func:`number_or_text`, :func:`min_bytes_of`, :func:`seq_range`) and to report progress and bad
input (:class:`Progress`, :class:`UsageError`).

Nothing here allocates a tensor: building, tracing and planning run under a ``FakeTensorMode``.
Limits: ``--per-layer`` needs a list of repeated layers of a module class of the model's own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import traceback as tracebacks
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxoffload.backend import JointKept, OffloadBackend
from fxoffload.backend.partition import PartitionMemo
from fxoffload.backend.partition import with_stack_headroom
from fxoffload.config import OffloadConfig, OptionError, config_from_options, parse_budget
from fxoffload.explain import format_bytes, format_stages
from fxoffload.passes import (
    ADVICE_WARN, TRACED_LAYERS, BudgetInfeasibleError, LayerCopyError, copy_layers, optimizer_step, tensor_nbytes,
    traced_layers,
)
from fxoffload.profiles import resolve_profile
from fxoffload.tools import models
from fxoffload.tools.models import ModelError, checkpoint_layers, layer_list, one_line, unpacked_sequences


__all__ = ["LayerRepeat", "Progress", "UsageError", "copies_layers", "impossible_budget", "layer_repeat",
           "min_bytes_of", "model_source", "number_or_text", "partitioned_anew", "plan_again", "plan_copied",
           "reserve_optimizer_state", "retry_wider", "seq_range", "SizeRange", "trace_copying_layers", "trace_step"]


class UsageError(ValueError):
    """Bad input to the command; its message is printed as is."""


class SizeRange(NamedTuple):
    """One trace for every size from ``lower`` to ``upper`` of the token ids' dimension ``dim`` (1: the
    length, as ``--seq LO:HI`` asks; 0: the batch, as fit's batch search asks), marked dynamic."""

    dim: int
    lower: int
    upper: int

    @property
    def asked_by(self) -> str:
        """What asked for the range, as an error names it."""
        return "--seq LO:HI" if self.dim == 1 else "a batch search"



class Progress:
    """Timestamped progress lines on stderr (tracing a 7B graph takes tens of seconds)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.start = quiet, time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", file=sys.stderr, flush=True)



def number_or_text(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text



def min_bytes_of(args: argparse.Namespace) -> Any:
    """``--min-bytes`` as a number of bytes (a size like 1MiB is parsed); a UsageError naming the forms."""

    min_bytes = number_or_text(args.min_bytes)
    if isinstance(min_bytes, (str, float)):
        try:
            min_bytes = parse_budget(str(min_bytes)).nbytes
        except (ValueError, AttributeError):
            raise UsageError(f"--min-bytes: got {args.min_bytes!r}; accepted: a number of bytes or a size like 1MiB")
    return min_bytes



def seq_range(text: str | None) -> tuple[int, ...] | None:
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



def model_source(args: argparse.Namespace):
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



def trace_step(source: Any, args: argparse.Namespace, seq: int, dtype: torch.dtype, options: dict, progress: Progress,
           symbolic: SizeRange | None = None):
    """Build and compile one fake training step (see :class:`_Traced`). The optimizer's state (see
    ``--optimizer``) joins what is reserved under a device budget. ``args``: the step's batch,
    checkpointing, per_layer, optimizer and traceback flags, and ``keep_joints`` (optional): keep each
    compile's joint graph (``_Traced.joints``) for :func:`plan_again`; ``joints_only`` (optional): keep it
    and stop the compile there (no plan, no record) where it is the step's one graph (dynamo compiled it at
    the step's return; after a graph break every graph is compiled and planned, to be counted).
    ``symbolic``: one trace for every size in that range of the token ids' length or batch."""


    torch._dynamo.reset()
    seconds = {}
    with FakeTensorMode(allow_non_fake_inputs=True), checkpointed_side_effects_allowed(), \
            fake_kernel_failures_unlogged(getattr(args, "traceback", False)):
        progress(f"building {source.name} with fake tensors (batch {args.batch}, size {seq}, {dtype})")
        start = time.perf_counter()
        step, inputs, kwargs = source.build(args.batch, seq, dtype)
        wrapped = checkpoint_layers(step, args.checkpointing, source.origin)
        if wrapped:
            progress(f"checkpointing ({args.checkpointing}) each of {wrapped} layers")
        seconds["build"] = time.perf_counter() - start
        optimizer = _optimizer(step, args.optimizer, options)
        if optimizer["state_bytes"] and options.get("device_budget") is not None:
            options = reserve_optimizer_state(options, optimizer)
        if symbolic is not None:
            _mark_sizes(inputs, kwargs, symbolic)
        progress("tracing and planning: dynamo, AOTAutograd, min-cut partitioner, fxoffload passes")
        start = time.perf_counter()
        blocks = list(layer_list(step) or ()) if args.per_layer else []
        if args.per_layer and not blocks:
            raise UsageError(f"--per-layer: {source.name} has no list of repeated layers (an nn.ModuleList "
                             "of one layer class) to compile one at a time")
        # One graph serves every layer: plan it for the step's runs of it.
        config = config_from_options({**options, **({"runs_per_step": len(blocks)} if blocks else {})})
        # Only the joint graph wanted (fit): the compile stops once it is kept, where it is the step's one graph.
        backend = OffloadBackend(config, keep_joints=getattr(args, "keep_joints", False),
                                 stop_at_joint=getattr(args, "joints_only", False) and not blocks)
        stopped = False  # at the joint graph (stop_at_joint)
        try:
            if blocks:
                progress(f"compiling each of {len(blocks)} {type(blocks[0]).__name__} layers on its own")
                for block in blocks:
                    compile_layer(block, backend, symbolic, seq)
                # The rest of the step runs eagerly, on fake tensors: as on real ones, without the full
                # attention mask transformers builds where it cannot read the position ids.
                with unpacked_sequences(source), unlogged_graphs():
                    with_stack_headroom(step, *inputs, **kwargs)
            else:
                with unlogged_graphs():
                    with_stack_headroom(torch.compile(step, backend=backend), *inputs, **kwargs)
        except Exception as e:
            stopped = _cause(e, (JointKept,)) is not None
            if not stopped:
                error = _usage_error(e, source, args.traceback, optimizer)
                if error is e:
                    raise
                raise error from None
        seconds["trace_and_plan"] = time.perf_counter() - start
    torch._dynamo.reset()
    if stopped:
        progress(f"traced the step's joint graph in {seconds['trace_and_plan']:.1f} s (not planned)")
        return _Traced([], [], {**seconds, "fxoffload_passes": 0.0, "fxoffload_stages": {}}, optimizer, backend.joints)
    _check_compiled(backend, blocks, source)
    stages = pass_stages(backend.records)
    seconds["fxoffload_passes"] = sum(stages.values())
    seconds["fxoffload_stages"] = stages
    progress(f"planned {len(backend.records)} graph(s) in {seconds['trace_and_plan']:.1f} s "
             f"(fxoffload passes {format_stages(tuple(stages.items()))})")
    return _Traced(backend.records, backend.step_invocations() or list(backend.records), seconds, optimizer,
                   backend.joints or [])


def pass_stages(records: list) -> dict[str, float]:
    """Seconds per fxoffload pass stage, summed over ``records`` (measured)."""
    stages: dict[str, float] = {}
    for record in records:
        for stage, spent in record.pass_seconds:
            stages[stage] = stages.get(stage, 0.0) + spent
    return stages


def checkpointed_side_effects_allowed() -> contextlib.AbstractContextManager:
    """Dynamo traces a checkpointed region whose forward changes Python state (transformers 5.25's layers set
    and reset the `kernels` package's active functions in each attention forward), skipping that change in
    the region's recompute, where it would otherwise break the graph at the region and run it eagerly:
    unplanned, and under ``--per-layer`` no graph at all. The trace only plans (fake tensors, no step is
    trained), so a change its recompute skips alters no plan; a user's own training sets the same flag
    (README, "Limits")."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def with_layer_copies(traced: "_Traced", layers: int, profile: Any, period: int = 1, head: int = 1) -> "_Traced":
    """``traced`` (a step of ``traced_layers(layers, period, head)`` layers traced to its one joint graph,
    ``joints_only``) as if all ``layers`` had been traced: its joint graph's layers copied
    (:func:`fxoffload.passes.copy_layers`), and the parameters' and the optimizer's figures counted for
    them. Raises ``LayerCopyError`` where the layers do not repeat (the caller traces them all)."""
    if len(traced.joints) != 1 or traced.records:
        raise LayerCopyError(f"the step traced to {len(traced.joints)} joint graph(s), not one kept whole")
    joint = traced.joints[0]
    if joint.inputs.activations:
        raise LayerCopyError("the step's graph takes activations of an earlier graph")
    copied = copy_layers(joint.module, layers, joint.context.fake_mode, period, head)
    added = copied.added_parameter_bytes
    kwargs = dict(joint.kwargs)
    if "static_lifetime_input_indices" in kwargs:
        kwargs["static_lifetime_input_indices"] = copied.primal_indices(kwargs["static_lifetime_input_indices"])
    placeholders = list(copied.module.graph.find_nodes(op="placeholder"))
    joint_inputs = tuple([p.meta["val"] for p in placeholders if p.name.startswith(prefix)]
                         for prefix in ("primals_", "tangents_"))
    inputs = joint.inputs._replace(gradient_bytes=joint.inputs.gradient_bytes + added)
    copy = dataclasses.replace(joint, module=copied.module, joint_inputs=joint_inputs, kwargs=kwargs, inputs=inputs,
                               graph=f"{joint.graph}, layers copied to {layers}", partition=PartitionMemo())
    parameter_bytes = traced.optimizer["parameter_bytes"] + added
    cost = optimizer_step(traced.optimizer["kind"], parameter_bytes, resolve_profile(profile))
    optimizer = {**traced.optimizer, "parameter_bytes": parameter_bytes, "state_bytes": cost.state_bytes,
                 "step_time": cost.seconds}
    return traced._replace(joints=[copy], optimizer=optimizer)


class LayerRepeat(NamedTuple):
    """How a model's layers repeat, for copies: every ``period`` layers alike after ``head`` kept as traced
    (``passes.copy_layers``); ``unlike``: why they are not all alike (None where they are); ``period``
    None where copies cannot stand for them, and ``refused`` then says why, after "<model>'s layers"."""

    period: int | None
    unlike: str | None
    head: int = 1
    refused: str | None = None
    start: int = 0  # the leading layers unlike the rest

    def traced(self, layers: int) -> int:
        """How many of the ``layers`` to trace (``fxoffload.passes.traced_layers``)."""
        return traced_layers(layers, self.period or 1, self.head)

    def pattern(self) -> str:
        """The pattern in words: "repeat every 6 (why)", "repeat every 1 from layer 1"."""
        return (f"repeat every {self.period}{f' from layer {self.start}' if self.start else ''}"
                f"{f' ({self.unlike})' if self.unlike else ''}")

    def said(self, layers: int) -> str:
        """The pattern and the trace it makes, for progress."""
        return f"{self.pattern()}: tracing {self.traced(layers)} of {layers}"

    def wider(self, layers: int) -> "LayerRepeat | None":
        """The same pattern with the first layer of each kind kept as traced too (the head past the unlike
        layers and a whole period: ``start + period + 1``), where that is a longer head and a trace shorter
        than the model; else None."""
        head = self.start + (self.period or 1) + 1
        wider = self._replace(head=head)
        return wider if head > self.head and wider.traced(layers) < layers else None


# The most layers unlike the rest a model may lead with for copies (DeepSeek-V3's three dense layers).
LONGEST_PREFIX = 4


def layer_repeat(source: Any, batch: int, seq: int, dtype: torch.dtype) -> LayerRepeat:
    """How the model's layers repeat (``models.layer_period``: the copied graph's own check sees only the
    traced), the model built with fake tensors: the fewest layers unlike the rest before the first
    (``LONGEST_PREFIX`` at most; none: every layer of the pattern, the head layer 0 alone; else the head two
    past them, ``passes.layer_copies``), then the fewest period whose trace is shorter than the model.
    Where either is not the plain case, the model built with that trace's layers too, its layers checked
    alike the model's they stand for (all but the last, the model's first; the last, the model's last)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        step, _, _ = source.build(batch, seq, dtype)
        layers = layer_list(step)
        if layers is None:
            return LayerRepeat(None, None, refused="are not all alike (no list of layers of one class)")
        layers = list(layers)
        repeat = _pattern(layers, models.unlike_layers(layers))
        if repeat.period is None or (repeat.period, repeat.head) == (1, 1):
            return repeat
        return repeat._replace(period=None, refused=refused) if (refused := _built_otherwise(
            source, (batch, seq, dtype), repeat, layers)) else repeat


def _built_otherwise(source: Any, size: tuple, repeat: LayerRepeat, layers: list) -> str | None:
    """Why a build of ``repeat``'s traced count of layers does not make the model's ``layers`` it stands for
    (its first all but one, the model's first; its last, the model's last), None where it does."""
    count = len(layers)
    traced = repeat.traced(count)
    said = f"{repeat.pattern()}, but a build of {traced} layers"
    try:
        shorter, _, _ = source.with_layers(traced).build(*size)
    except Exception as e:  # noqa: BLE001 (a build the full model's did not fail: every layer is traced)
        return f"{said} failed ({one_line(e)})"
    built = list(layer_list(shorter) or [])
    stands = [*range(traced - 1), count - 1]  # the model's layer each traced one stands for
    if len(built) != traced or not all(models.alike_at(layer, layers[at], (i, at))
                                       for i, (layer, at) in enumerate(zip(built, stands))):
        return f"{said} does not make the model's layers it stands for"
    return None


def _pattern(layers: list, unlike: str | None) -> LayerRepeat:
    """The fewest leading layers unlike the rest, then the fewest period of the rest (see ``layer_repeat``)."""
    count = len(layers)
    for start in range(min(LONGEST_PREFIX, count - 1) + 1):
        head = 1 if start == 0 else start + 2
        longest = max((p for p in range(1, count) if traced_layers(count, p, head) < count), default=0)
        period = models.layer_period(layers, longest, start) if longest else None
        if period is not None:
            return LayerRepeat(period, unlike, head, start=start)
    shorter = "with no period a trace of fewer layers than the model's holds"
    return LayerRepeat(None, unlike, refused=f"are not all alike ({unlike}), {shorter}" if unlike else
                       f"lead with a layer unlike the rest, {shorter}")


def retry_wider(source: Any, failed: LayerRepeat, size: tuple, error: Exception, what: str,
                progress: Progress) -> LayerRepeat | None:
    """After ``failed``'s copies raised ``error``: the same pattern with the first layer of each kind kept as
    traced (``LayerRepeat.wider``), its shorter build checked as ``layer_repeat`` checks; None where there is
    none, for the caller to trace every layer. Said through ``progress`` either way. Why: a symbolic trace
    may read a size at the first layer of a kind from that layer's own tensor (``sym_size``) and at the later
    ones from a node they share (Llama-4's experts every other layer, under ``fit``)."""
    count = source.layers
    why = str(error) if isinstance(error, LayerCopyError) else f"{type(error).__name__}: {error}"
    said = f"the layers of a {failed.traced(count)}-layer trace{what} do not repeat as copies need ({why})"
    wider = failed.wider(count)
    if wider is not None:
        with FakeTensorMode(allow_non_fake_inputs=True):
            layers = list(layer_list(source.build(*size)[0]) or [])
            refused = _built_otherwise(source, size, wider, layers)
        if refused is None:
            progress(f"{said}: tracing {wider.traced(count)} of {count}, the first layer of each kind kept as traced")
            return wider
    progress(f"{said}: tracing all {count}")
    return None


def copies_layers(source: Any, args: argparse.Namespace, batch: int, seq: int, dtype: torch.dtype,
                  progress: Progress) -> LayerRepeat | None:
    """How a trace of a few layers may be copied to the model's (:func:`layer_repeat`), None where it may
    not: under ``--per-layer`` or ``--trace-every-layer``, for a source that builds no fewer layers than it
    has or whose layers do not repeat within a trace shorter than the model (said through ``progress``)."""
    if (args.per_layer or getattr(args, "trace_every_layer", False) or source.with_layers is None
            or (source.layers or 0) <= TRACED_LAYERS):
        return None
    repeat = layer_repeat(source, batch, seq, dtype)
    if repeat.period is None:
        progress(f"{source.name}'s layers {repeat.refused}: tracing all {source.layers}")
        return None
    if (repeat.period, repeat.head) != (1, 1):
        progress(f"{source.name}'s layers {repeat.said(source.layers)}")
    return repeat


def trace_copying_layers(source: Any, args: argparse.Namespace, seq: int, dtype: torch.dtype, options: dict,
                         progress: Progress) -> "_Traced | None":
    """The step traced with a few layers (``LayerRepeat.traced``: four where all are alike) to its one joint
    graph (the compile stopped there), the graph's layers copied to the model's (:func:`with_layer_copies`):
    the joint graph a trace of every layer gives, in a few seconds (``seconds["layer_copies"]``: the copying;
    ``seconds["build"]`` counts the full model's build that checks its layers). None, for the caller to trace
    every layer: under ``--per-layer`` or ``--trace-every-layer``, for a source of ``TRACED_LAYERS`` layers or
    fewer or one that builds no fewer, where the model's layers do not repeat (:func:`copies_layers`), and
    where the traced graph's layers do not repeat as copies need (the last two said through ``progress``)."""
    start = time.perf_counter()
    repeat = copies_layers(source, args, args.batch, seq, dtype, progress)
    if repeat is None:
        return None
    checked = time.perf_counter() - start
    run = argparse.Namespace(**{**vars(args), "keep_joints": True, "joints_only": True})
    # The joint graph is kept before any plan: the trace plans nothing but where the step breaks into several
    # graphs (then traced whole below), so it plans without a budget, as fit's traces do.
    # (reserved goes with the device budget: it counts against one, and is refused without; all_eligible with
    # any budget: fit's checkpointing+offload rows printed `--budget none --all-eligible`, which then raised)
    unbudgeted = {**options, "memory_budget": 1.0, "device_budget": None, "reserved": 0, "max_overhead": None,
                  "all_eligible": False}
    while True:
        traced = trace_step(source.with_layers(repeat.traced(source.layers)), run, seq, dtype, unbudgeted, progress)
        start = time.perf_counter()
        try:
            copied = with_layer_copies(traced, source.layers, options["device_profile"], repeat.period, repeat.head)
            break
        except Exception as e:  # noqa: BLE001 (whatever the copies cannot do, a trace of every layer does)
            repeat = retry_wider(source, repeat, (args.batch, seq, dtype), e, "", progress)
            if repeat is None:
                return None
    spent = time.perf_counter() - start
    progress(f"copied the joint graph's layers to {source.layers} in {spent:.1f} s")
    seconds = copied.seconds
    return copied._replace(seconds={**seconds, "build": seconds["build"] + checked, "layer_copies": spent})


def plan_copied(copied: Any, options: dict, progress: Progress) -> tuple[list, dict, dict]:
    """(records, seconds, optimizer) of planning ``copied`` (``trace_copying_layers``: one joint graph of every
    layer) under ``options``, as ``trace_step`` plans a trace of its own, the optimizer's state reserved
    under a device budget as there."""
    if copied.optimizer["state_bytes"] and options.get("device_budget") is not None:
        options = reserve_optimizer_state(options, copied.optimizer)
    start = time.perf_counter()
    # As the step's compile plans it: under runs_per_step="auto" (the default) a fraction out of reach is
    # planned provisionally at the smallest peak (plan_command refuses it where the step is one graph run once).
    records = plan_again(copied, options, replannable=config_from_options(options).runs_per_step == "auto")
    planned = time.perf_counter() - start
    stages = pass_stages(records)
    progress(f"planned {len(records)} graph(s) in {planned:.1f} s "
             f"(fxoffload passes {format_stages(tuple(stages.items()))})")
    seconds = copied.seconds
    seconds = {**seconds, "trace_and_plan": seconds["trace_and_plan"] + seconds["layer_copies"] + planned,
               "fxoffload_passes": sum(stages.values()), "fxoffload_stages": stages}
    return records, seconds, copied.optimizer


# AOTAutograd's functions that print its joint, forward and backward graphs as text for its structured log
# and its cache entries, whether or not a log is on (``AOTConfig.enable_log``, which dynamo's compiles
# leave on): (module, name, what it returns when it logs nothing).
_GRAPH_LOGGERS = (("torch._functorch._aot_autograd.graph_compile", "_log_joint_graph", None),
                  ("torch._functorch._aot_autograd.graph_compile", "_log_fw_bw_graphs", (None, None)))


@contextlib.contextmanager
def fake_kernel_failures_unlogged(traceback: bool) -> Iterator[None]:
    """Within (unless ``traceback``): PyTorch logs no failure of an op on fake tensors. It logged each with
    its traceback (34 lines for one shape mismatch in a config's model code) before the error that carries it
    reached the one line we print of it; ``--traceback`` shows both."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    if not traceback:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def unlogged_graphs() -> Iterator[None]:
    """Within: AOTAutograd prints no graph as text (it does so as ``enable_log=False`` has it: the
    strings are None). A traced step is only planned and read, never logged nor cached: on an 8B step
    the printing took 1.2 s of a 35 s trace (2026-11-29, this CPU). A release without one of those
    functions is left as it is."""
    import importlib

    patched = []
    for module_name, name, quiet in _GRAPH_LOGGERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if callable(getattr(module, name, None)):
            patched.append((module, name, getattr(module, name)))
            setattr(module, name, lambda *args, _quiet=quiet, **kwargs: _quiet)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def plan_again(traced: "_Traced", options: dict, *, rewrite: bool = True, replannable: bool = False) -> list:
    """The records of planning each joint graph ``traced`` kept (``args.keep_joints``) under ``options``
    (checked as the backend's), one backend for all, without tracing again: the plans ``trace_step``
    would make under them. The caller reserves the optimizer's state (:func:`reserve_optimizer_state`).
    ``rewrite=False``: records to read only (their graphs not rewritten; ``OffloadBackend.plan_joint``);
    ``replannable``: a budget out of reach planned at the smallest peak, as a compile under
    ``runs_per_step="auto"`` plans it (``OffloadBackend.plan_joint``)."""
    backend = OffloadBackend(config_from_options(options))
    try:
        return [backend.plan_joint(joint, rewrite=rewrite, replannable=replannable) for joint in traced.joints]
    except BudgetInfeasibleError as error:
        raise impossible_budget(error, traced.optimizer) from None



def partitioned_anew(traced: "_Traced") -> "_Traced":
    """``traced`` whose kept joint graphs are partitioned anew when planned again (each joint keeps the
    default partition it was first planned with): for plans at other sizes of a symbolic trace."""
    return traced._replace(joints=[dataclasses.replace(joint, partition=joint.partition.anew())
                                   for joint in traced.joints])


class _Traced(NamedTuple):
    """What tracing and planning one step gave: the records, the step's invocations (records in the
    order they ran), wall times (measured), the optimizer's figures (predicted: ``_optimizer``) and,
    when asked (``args.keep_joints``), each compile's joint graph (``fxoffload.backend.Joint``)."""

    records: list
    invocations: list
    seconds: dict
    optimizer: dict
    joints: list



def _optimizer(step: Any, kind: str, options: dict) -> dict:
    """The optimizer's figures for the model's parameters (predicted): state bytes and step seconds."""

    if kind != "none" and not isinstance(step, torch.nn.Module):
        raise UsageError(f"--optimizer {kind}: the model's step is not a torch.nn.Module, so its parameters are "
                         "unknown; accepted: a model that is one, or --optimizer none")
    parameters = list(step.parameters()) if isinstance(step, torch.nn.Module) else []
    parameter_bytes = sum(int(tensor_nbytes(p)) for p in parameters)
    cost = optimizer_step(kind, parameter_bytes, resolve_profile(options["device_profile"]))
    return {"kind": kind, "parameter_bytes": parameter_bytes, "state_bytes": cost.state_bytes,
            "step_time": cost.seconds}



def reserve_optimizer_state(options: dict, optimizer: dict) -> dict:
    """``options`` with the optimizer's state added to what is reserved of the device budget."""

    reserved = OffloadConfig(**options).reserved_bytes + optimizer["state_bytes"]
    try:
        OffloadConfig(**{**options, "reserved": reserved})
    except OptionError:
        raise UsageError(f"--optimizer {optimizer['kind']}: its state ({optimizer['state_bytes']} B, "
                         f"{format_bytes(optimizer['state_bytes'])}) and --reserved ({options['reserved']}) take "
                         f"{reserved} B, nothing left of --device-budget {options['device_budget']}; accepted: a "
                         "larger --device-budget, or less reserved") from None
    return {**options, "reserved": reserved}



def _usage_error(error: Exception, source: Any, traceback: bool, optimizer: dict | None = None) -> Exception:
    """What to raise for an error while tracing and planning: a one-line UsageError for an impossible
    budget, a bad model, or any failure of a model file's own code or of transformers' model code (unless
    --traceback); else ``error``."""

    cause = _cause(error, (BudgetInfeasibleError, ModelError))
    if isinstance(cause, BudgetInfeasibleError):
        return impossible_budget(cause, optimizer)
    if isinstance(cause, ModelError):
        return UsageError(str(cause))
    if traceback:
        return error
    innermost = f"{one_line(list(_chain(error))[-1])} (--traceback shows where)"
    if source.user_code:
        return UsageError(f"{source.origin}: tracing the training step (dynamo, AOTAutograd) failed: {innermost}")
    frame = transformers_frame(error)
    if frame is not None:
        return UsageError(f"{source.origin or source.name}: transformers' own model code fails on it "
                          f"({Path(frame.filename).name}:{frame.lineno}, in {frame.name}): {innermost}")
    return error


def transformers_frame(error: BaseException) -> tracebacks.FrameSummary | None:
    """The frame of transformers' model code where ``error`` arose while Dynamo traced a step (a config whose
    fields its modeling code does not support: DeepSeek-V3's ``head_dim`` at odds with ``qk_rope_head_dim``
    failed in its rotary embedding with a page of traceback), else None. Only an error of the model's own making
    is the model's: one Dynamo met in the code it traced (its ``real_stack``, whose last frame outside torch is
    transformers'), raised by transformers itself or by one of PyTorch's op checks (``_SHAPE_CHECKS``: a shape
    that does not broadcast, a dtype that does not match). A failure of a compile (ours, the inner compiler's),
    of Dynamo itself, of an op without a fake kernel, of a size read from data, or of a compiled graph at run
    time is never the model's: it propagates whole."""
    chain = list(_chain(error))
    if any(isinstance(e, (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.InternalTorchDynamoError,
                          NotImplementedError)) for e in chain):
        return None
    stack = next((e.real_stack for e in chain if getattr(e, "real_stack", None)), None)
    raised = tracebacks.extract_tb(chain[-1].__traceback__)
    if not stack or not raised:
        return None
    import transformers  # here: only a step that failed asks

    if not (_under(raised[-1].filename, transformers) or _in_shape_check(raised[-1].filename)):
        return None
    outside_torch = [f for f in stack if not _under(f.filename, torch)]
    if not outside_torch or not _under(outside_torch[-1].filename, transformers):
        return None
    return outside_torch[-1]


# Where PyTorch checks an op's arguments (relative to torch's folder): an error raised there is the caller's.
_SHAPE_CHECKS = ("_refs", "_prims_common", "_meta_registrations.py", "_decomp", "__init__.py")


def _in_shape_check(filename: str) -> bool:
    return any(_under(filename, torch, part) for part in _SHAPE_CHECKS)


def _under(filename: str, package: Any, part: str = "") -> bool:
    """Whether ``filename`` is in ``package``'s folder (or its ``part`` there: a folder or a file)."""
    folder = Path(package.__file__).resolve().parent
    return Path(filename).resolve().is_relative_to(folder / part if part else folder)



def impossible_budget(error: BudgetInfeasibleError, optimizer: dict | None = None) -> UsageError:
    """The one line for a budget out of reach. The command plans for the budget it is given: the advice to
    warn instead does not apply. Under a device budget, what is reserved holds ``optimizer``'s state beside
    ``--reserved``, which the planner's words ("after reserved") leave unsaid."""
    text = error.explained([a for a in error.advice if a != ADVICE_WARN])
    if optimizer and optimizer.get("state_bytes") and error.reason.startswith("device_budget"):
        text += (f" (reserved: --reserved and the state of --optimizer {optimizer['kind']}, "
                 f"{optimizer['state_bytes']} B, {format_bytes(optimizer['state_bytes'])})")
    return UsageError(f"impossible budget: {text}")



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



def compile_layer(block: torch.nn.Module, backend: Any, size: SizeRange | None, traced: int) -> None:
    """Compile ``block`` on its own (``Module.compile``). With ``size`` a range of lengths, each call first marks
    dynamic, bounded to the range, every dimension past the batch of its tensor arguments that has the traced
    length ``traced``: the layer's inputs are made by the step's eager code (the embedding, the rotary
    embedding), which the mark on the token ids never reaches (``fit --per-layer`` traced every length, each
    a trace, since it compiled layers apart). A dimension of that size by chance is marked too: the graph
    then has more than one symbol, or Dynamo specializes it and the trace fails, and fit traces each length
    instead, as it did."""
    block.compile(backend=backend)
    if size is None or size.dim != 1:
        return
    compiled = block._compiled_call_impl  # what Module.compile made: torch.compile of the block's _call_impl

    def marked_then_compiled(*args: Any, **kwargs: Any) -> Any:
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor):
                for dim in range(1, value.dim()):
                    if value.shape[dim] == traced:
                        torch._dynamo.mark_dynamic(value, dim, min=size.lower, max=size.upper)
        return compiled(*args, **kwargs)

    block._compiled_call_impl = marked_then_compiled


def _mark_sizes(inputs: tuple, kwargs: dict, size: SizeRange) -> None:
    """The token ids' dimension ``size.dim`` dynamic, bounded to its range: one graph for every size there.
    An image model's batch: its pixel values' and labels' first dimension (one symbol, as the loss
    equates them); its images' side stays as traced (the model built depends on it)."""
    pixels = kwargs.get("pixel_values")
    if pixels is not None and size.dim == 0:
        for batched in (pixels, kwargs.get("labels")):
            if isinstance(batched, torch.Tensor):
                torch._dynamo.mark_dynamic(batched, 0, min=size.lower, max=size.upper)
        return
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if ids is None or pixels is not None:
        raise UsageError(f"{size.asked_by}: needs a text model whose inputs are token ids (input_ids, batch x length)"
                         + ("" if size.dim else ", or an image model's batch"))
    torch._dynamo.mark_dynamic(ids, size.dim, min=size.lower, max=size.upper)



def _chain(error: BaseException):
    """``error`` and the errors it wraps, outermost first (dynamo wraps the model's and the backend's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__



def _cause(error: BaseException, kinds: tuple) -> BaseException | None:
    return next((e for e in _chain(error) if isinstance(e, kinds)), None)
