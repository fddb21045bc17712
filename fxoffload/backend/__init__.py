"""The torch.compile backend: AOTAutograd, the min-cut partitioner, our passes, an inner compiler.

``offload_backend(**options)`` returns an :class:`OffloadBackend`. For every
graph dynamo hands it, AOTAutograd traces the joint forward/backward graph,
PyTorch's min-cut partitioner splits it, and our partition hook plans the
pair as one timeline (``fxoffload.passes.plan_best_partition``: under strategy
``"auto"``, alternatives are planned too when the first plan has a predicted
cost, PyTorch's recompute-only partition at the budget among them, and the
fastest predicted kept) and rewrites it before the inner compiler sees either
graph:

* ``inner="inductor"``: ``compile_fx`` with our hook as Inductor's
  ``custom_partitioner_fn`` (so Inductor's joint-graph passes and
  decompositions run as usual), and ``control_deps`` ordering pins
  (``fxoffload.backend.ordering``) so Inductor keeps every copy where it was planned.
* ``inner="eager"``: ``aot_autograd`` with Inductor's decomposition table (the
  same graphs as the Inductor path) and the rewritten FX graphs run as they are.

Each compiled graph leaves a :class:`GraphRecord` in ``backend.records``.
The backend is also registered with dynamo as ``"fxoffload"`` (entry point
``torch_dynamo_backends``): ``torch.compile(m, backend="fxoffload", options={...})``.

CUDA graphs are refused: a captured graph would replay its ``offload`` and ``wait``
nodes without registering their transfers. ``mode="reduce-overhead"`` and
``"max-autotune"`` raise; ``"max-autotune-no-cudagraphs"`` applies its Inductor
options; the global ``torch._inductor.config.triton.cudagraphs`` is turned off for
our graphs, with a warning.

Both partitioner runs (the default one, and PyTorch's recompute-only one that strategy auto weighs)
happen under ``fxoffload.backend.partition.quick_min_cut``: the same cuts, in less than half the time.

Limits: graphs compiled for inference (no grad) go through unchanged and
leave no record. AOTAutograd's cache is off for our graphs, so that every
compile runs the passes and leaves its record; Inductor's FX-graph cache (keyed
by the rewritten graphs and fxoffload's source: ``fusion_distance``) stays on. A
forward's lowering tells the backward the layouts it wrote its offloaded sources
in (``ordering.share_source_layouts``); a forward the cache hands back tells them
through its Python wrapper (``ordering.layouts_from_code``), and where that code
cannot (a C++ or FX wrapper, a call it cannot read), it is compiled again without
the cache.

Owns: the backend and the step it compiles for. This package's ``__init__`` is the backend; beside
it, what a compile call says (``compile_call``), the partition hook (``partition``), the inserted ops'
order for Inductor (``ordering``), a graph's record (``record``), the step's bookkeeping
(``step_coordinator``, which owns ``step_ledger`` and ``step_budget``), the checks across ranks
(``ranks``) and on callers (``callers``), measured selection's schedule (``selection``) and what
differs between torch releases (``compat``).

May import: the passes (``fxoffload.passes``, through their face), the runtime (``fxoffload.runtime``)
and the top-level modules (``config``, ``errors``, ``profiles``, ``explain``); never the tools
(``tests/test_architecture.py`` checks the rooms' order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

import fxoffload.runtime  # op kernels, and the invocations copies cross graphs by
from fxoffload.backend.callers import CallerWatch, offloaded_inputs
from fxoffload.backend.compat import compiled_autograd_on
from fxoffload.backend.compile_call import (
    EAGER_REGIONS, InputFacts, eager_region_breaks, input_facts, mode_patches, no_cudagraphs, pipeline_inference,
    run_while_compiling, warn_user_recompute_budget,
)
from fxoffload.backend.fusion_distance import distances_without_our_ops, cached_under_our_source
from fxoffload.config import OffloadConfig, OptionError, config_from_options
from fxoffload.errors import CompiledAutogradError
from fxoffload.explain import explain, format_bytes
from fxoffload.backend.ordering import (
    constrain_offload_sources, follow_source_layouts, layouts_from_code, pairs_layouts, pin_offload_order,
    share_source_layouts,
)
from fxoffload.backend.partition import PartitionMemo, Partitioner, lazy_graph_modules, module_copy, with_stack_headroom
from fxoffload.runtime.pinned import reservation
from fxoffload.passes import (
    BudgetInfeasibleError, BudgetInfeasibleWarning, CandidatePlan, KeptSource, OverheadExceededError,
    PassResult, Plan, PlanOptions, Share, held_after_forward, inputs_at, plan_best_partition, plan_digest,
    rewrite_planned, unbounded_size_warning, warn_from_user,
)
from fxoffload.profiles import available_host_memory, local_processes
from fxoffload.backend.ranks import RankCheck, graph_key
from fxoffload.backend.record import GraphRecord
from fxoffload.backend.selection import Mark, RegionSelection, WholeSteps
from fxoffload.backend.step_budget import plan_within_cap
from fxoffload.backend.step_coordinator import StepCoordinator

log = logging.getLogger(__name__)

# Runs a graph handed an activation by an earlier graph is planned for, where its budget is out of reach
# for one run, before the first step has counted them (runs_per_step="auto"): such a graph is most
# often a layer that several layers run, and at one run offloading its input lowers nothing (a
# checkpointed layer saves only its input). Re-planned once counted, whatever the count.
PROVISIONAL_RUNS = 2

__all__ = ["GraphRecord", "Joint", "JointKept", "OffloadBackend", "offload_backend", "dynamo_backend", "named_backend",
           "register_backend_name"]


REFUSED_COMPILED_AUTOGRAD = (
    "fxoffload: compiled autograd is on (torch._dynamo.compiled_autograd._enable(...) around this step, or "
    "torch._dynamo.config.compiled_autograd set) and this graph's plan copies activations, which compiled "
    "autograd would re-trace and cannot: turn it off for steps compiled with fxoffload (no _enable(...) around "
    "them, torch._dynamo.config.compiled_autograd False), or plan without copies (strategy='recompute')"
)


def _backward_node(out: Any) -> Any:
    """The autograd node of a compiled forward's outputs: the compiled backward itself, rather than
    the view an aliased output gets (a loss that ignores that output would never reach its hook)."""
    nodes = [t.grad_fn for t in torch.utils._pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    compiled = [n for n in nodes if "CompiledFunction" in type(n).__name__]
    return (compiled or nodes or [None])[0]


@dataclass(frozen=True)
class _Compiled:
    """A compiled region: what runs, and the compilation that holds its record (set once it is planned)."""

    run: Callable
    compilation: _Compilation


@dataclass
class _Replan:
    """What compiling a region again needs: a copy of dynamo's graph (the first compile may edit
    the one it is handed) and its example inputs."""

    module: fx.GraphModule
    example_inputs: list[Any]
    inputs: InputFacts  # as the first call's inputs showed (fake copies cannot)
    patches: dict  # Inductor options of the torch.compile mode

    @classmethod
    def of(cls, gm: fx.GraphModule, example_inputs: list[Any], inputs: InputFacts,
           patches: dict) -> "_Replan | None":
        """None for graphs with symbolic sizes: compiling them again outside dynamo would add
        guards dynamo never checks."""
        if inputs.symbolic:
            return None
        # Fake copies: the inputs dynamo hands over may be the real tensors of the first call (its
        # activations and batch), which must not live as long as the compiled function.
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # here: a re-plan's copy alone

        if not all(isinstance(t, FakeTensor) for t in example_inputs if isinstance(t, torch.Tensor)):
            mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
            example_inputs = [t if isinstance(t, FakeTensor) else mode.from_tensor(t) if isinstance(t, torch.Tensor)
                              else t for t in example_inputs]
        return cls(module_copy(gm), list(example_inputs), inputs, patches)

    def copy(self) -> "_Replan":
        """Another copy of the graph, to compile once more (a compile may edit the graph it is handed)."""
        return dataclasses.replace(self, module=module_copy(self.module))


class JointKept(Exception):
    """Raised out of ``torch.compile`` by a backend made with ``stop_at_joint=True`` once it kept the step's
    joint graph (the last of ``backend.joints``): what the compile would do after the partition hook
    (partition, plan, the backward's compile, dynamo's guards and code) is not needed to plan it again."""


@dataclass(frozen=True)
class Joint:
    """A region's joint forward/backward graph as AOTAutograd handed it to the partition hook, with
    what partitioning and planning it again needs: kept by a backend made with ``keep_joints=True``
    (in ``backend.joints``, one per compile), planned again by :meth:`OffloadBackend.plan_joint` of a
    backend with other options, without tracing the model again (``fxoffload fit``)."""

    module: fx.GraphModule  # a copy, taken before any partition
    joint_inputs: Any
    kwargs: dict  # the partition hook's keyword arguments (num_fwd_outputs, ...)
    inputs: InputFacts  # as the compile call's inputs showed them
    graph: str  # the key ranks compare its plan under (fxoffload.backend.ranks.graph_key)
    context: Any  # the compile's tracing context (its fake mode: the partitioner makes fake tensors)
    partition: PartitionMemo  # its default partition, made once (by the compile that kept it)


def _eager_compile(gm: fx.GraphModule, example_inputs: Any) -> Callable:
    # Boxed code takes the argument list and clears it, so every input (a saved
    # activation, a host buffer) is freed at its last use, as under Inductor.
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)  # looks gm up at call time, so a recompiled graph takes effect

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _Compilation:
    """One dynamo graph on its way through AOTAutograd.

    The partition hook creates the record; the inner compilers then store the
    graphs they are actually handed (AOTAutograd may copy the backward module
    between the two), so ``record.forward`` / ``record.backward`` are what runs.
    """

    def __init__(self, backend: "OffloadBackend", region: tuple, inputs: InputFacts,
                 replannable: bool = False, graph: str = "", choose: str | None = None,
                 analyses: dict | None = None) -> None:
        self.backend = backend
        # A plan to read, not to run (``OffloadBackend.plan_joint(rewrite=False)``): the pair is left as it
        # is, and its analysis is kept here (by what it was made under) for the next plan of the same pair.
        self.analyses = analyses
        self.inputs = inputs  # which inputs are activations, what one run's backward leaves in .grad
        self.region = region
        self.graph = graph  # the key ranks compare its plan under (fxoffload.backend.ranks.graph_key)
        self.replannable = replannable  # runs_per_step="auto" may plan it again once the step is counted
        self.choose = choose  # the candidate plan to compile (measured selection), else the fastest predicted
        self.record: GraphRecord | None = None
        # While its step is timed (measured selection): takes a Mark of each backward run.
        self.timer: Callable[[Mark], None] | None = None

    @property
    def read_only(self) -> bool:
        """Whether the plan is only read (its pair not rewritten nor compiled: ``plan_joint(rewrite=False)``)."""
        return self.analyses is not None

    @property
    def input_activations(self) -> frozenset[int]:
        return self.inputs.activations

    @property
    def gradient_bytes(self) -> int:
        return self.inputs.gradient_bytes

    def on_pair(self, fw: fx.GraphModule, bw: fx.GraphModule, num_user_outputs: int, policies: dict[str, str],
                repartition: Any = None, plain_total: int | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
        self.record = self.backend.plan_region(self, fw, bw, num_user_outputs, policies, repartition, plain_total)
        return self.record.forward, self.record.backward

    def capture(self, gm: fx.GraphModule, is_backward: bool) -> None:
        if self.record is not None:
            setattr(self.record, "backward" if is_backward else "forward", gm)

    def eager(self, is_backward: bool) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Callable:
            self.capture(gm, is_backward)
            compiled = _eager_compile(gm, example_inputs)
            return _run_backward(compiled, self.backend.config.debug, self) if is_backward else compiled

        return compile_graph

    def inductor_inner(self, gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        is_backward = kwargs.get("is_backward", False)
        if not kwargs.get("is_inference", False):
            self.capture(gm, is_backward)
        if is_backward:
            follow_source_layouts(gm)  # the layouts the forward's lowering wrote its offloaded sources in
        pairs = not is_backward and pairs_layouts(gm)
        lowered_here = pairs and (_no_python_wrapper(kwargs) or not _fx_graph_cache_on())
        compiled = self._lower(gm, example_inputs, kwargs, lowered_here=lowered_here)
        code = getattr(compiled, "source_code", None)  # Inductor's wrapper (none where it is no CompiledFxGraph)
        if pairs and not lowered_here and not layouts_from_code(gm, code if isinstance(code, str) else None):
            # Its code came from the cache, and it does not say each offload's strides: lower it here.
            _forget_compile(compiled)
            compiled = self._lower(gm, example_inputs, kwargs, lowered_here=True)
        if not is_backward:
            follow_source_layouts(gm)  # the graph kept in the record says what its code does
        return _run_backward(compiled, self.backend.config.debug, self) if is_backward else compiled

    def _lower(self, gm: fx.GraphModule, example_inputs: Any, kwargs: dict, lowered_here: bool) -> Any:
        """``compile_fx_inner`` on ``gm`` under our lowering's settings; ``lowered_here``: without Inductor's FX graph
        cache (``_lowered_here``)."""
        from torch._inductor.compile_fx import compile_fx_inner  # Inductor: loaded only under inner="inductor"

        is_backward = kwargs.get("is_backward", False)
        with _no_buffer_reuse(self.record if not is_backward else None), _lowered_here(lowered_here), \
                distances_without_our_ops(gm), _cached_unless(lowered_here, gm):
            return compile_fx_inner(gm, example_inputs, **kwargs)


def _forget_compile(compiled: Any) -> None:
    """Undo what handing back ``compiled`` began, before its graph is compiled again: the output strides it
    gave AOTAutograd (``TracingContext.output_strides``: Inductor hands them over once per graph and asserts
    so), and the autotune cache bundle a cache hit opens (``AutotuneCacheBundler``, closed only by running the
    graph; a second compile's opening asserts there is none)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.output_strides is not None:
        context.output_strides.clear()
    try:
        from torch._inductor.runtime.autotune_cache import AutotuneCacheBundler
    except ImportError:  # a torch without it
        return
    AutotuneCacheBundler.end_compile()


def _fx_graph_cache_on() -> bool:
    """Whether Inductor's FX graph cache, local or remote, may hand back a compiled graph now."""
    from torch._inductor import config as inductor_config

    return not getattr(inductor_config, "force_disable_caches", False) and bool(
        inductor_config.fx_graph_cache or inductor_config.fx_graph_remote_cache)


def _no_python_wrapper(kwargs: dict) -> bool:
    """Whether Inductor writes the graph's wrapper in another language than Python (C++, or FX), whose code
    :func:`ordering.layouts_from_code` cannot read: a forward whose offloads are prefetched is then lowered in
    every process."""
    from torch._inductor import config as inductor_config

    return bool(kwargs.get("cpp_wrapper") or kwargs.get("fx_wrapper") or inductor_config.cpp_wrapper
                or getattr(inductor_config, "fx_wrapper", False))


def _lowered_here(here: bool) -> contextlib.AbstractContextManager:
    """Inductor's FX graph caches (local and remote) off for a forward whose offloads tell their prefetches the
    layouts they are lowered in (``ordering.pairs_layouts``: a hit would skip that lowering), where its code
    cannot tell them instead (``ordering.layouts_from_code``: a wrapper not in Python, or code that does not
    name each offload once)."""
    if not here:
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config

    return inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False)


def _cached_unless(lowered_here: bool, gm: fx.GraphModule) -> contextlib.AbstractContextManager:
    """The FX graph cache takes ``gm`` keyed on our source (``fusion_distance.cached_under_our_source``), unless
    it must be lowered here: its ``control_deps`` then stay uncacheable, a second guard beside the config."""
    return contextlib.nullcontext() if lowered_here else cached_under_our_source(gm)


def _no_buffer_reuse(record: GraphRecord | None) -> contextlib.AbstractContextManager:
    """Inductor's buffer reuse off for a forward whose releases defer before the last run: Inductor takes
    a source as dead after its release and may hand its memory to a later kernel of the graph (no
    allocator call, so the runtime's reference cannot stop it) while a deferred copy still reads it. The
    ordering pass keeps every kernel before a release deferred at the forward's end; one inside the
    forward has kernels after it. Off, a dead buffer goes back to the caching allocator, which the
    runtime's reference holds until the copy has landed (Inductor's reuse saves the allocator calls)."""
    if record is None or not any(p.deferred_before_last for p in record.schedule.placements):
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config

    return inductor_config.patch(allow_buffer_reuse=False)


def _run_backward(compiled: Callable, debug: bool, compilation: _Compilation) -> Callable:
    """A boxed backward that, when it raises, drops the copies it left in flight
    (:func:`fxoffload.runtime.backward_graph`), in debug mode under ``debug`` (forwards: see ``_track``),
    timed while ``compilation.timer`` is set (measured selection)."""

    def run(args: list) -> Any:
        with _timed(compilation.timer, args), fxoffload.runtime.backward_graph(), \
                fxoffload.runtime.debugging(debug):
            return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class OffloadBackend:
    """A ``torch.compile`` backend that offloads saved activations; see the module docstring."""

    def __init__(self, config: OffloadConfig, *, keep_joints: bool = False, stop_at_joint: bool = False) -> None:
        self.config = config
        self.records: list[GraphRecord] = []
        # With keep_joints: each compile's joint graph, to plan again under other options (plan_joint).
        self.joints: list[Joint] | None = [] if keep_joints or stop_at_joint else None
        # With stop_at_joint: a compile of the whole frame stops once its joint graph is kept (JointKept).
        self._stop_at_joint = stop_at_joint
        self._compiled_any = False
        self._host_warned = False
        self._eager_breaks = eager_region_breaks()  # regions Dynamo ran eagerly so far (EAGER_REGIONS)
        self._eager_warned = False
        self._compile_count: dict[Any, int] = {}
        # The step: what each region holds and how often it runs, and the shares of its memory budget
        # (fxoffload.backend.step_coordinator).
        self._step = StepCoordinator(config)
        # Offloaded inputs the caller kept, by the step's forward invocation (see fxoffload.backend.callers).
        self._callers = CallerWatch()
        self._steps = 0  # steps begun (a new one at the first forward after a backward began)
        # Whole steps begun (a new one at a forward no tracked forward waits before): under 1F1B a pipeline
        # stage's step, whose forwards run between its backwards. Measured selection's steps.
        self._whole_steps = WholeSteps()
        self._compared_graph: dict[tuple, str] = {}  # each region's first key for the rank check
        self._compared_latest: dict[tuple, str] = {}  # each region's latest key (measured selection's, across ranks)

    def __deepcopy__(self, memo: dict) -> "OffloadBackend":
        """Not copied: ``copy.deepcopy`` of a compiled model (an EMA copy) compiles the copy's graphs through
        this backend, as two models compiled with one backend, or by name, do. Its records hold fake
        tensors, which cannot be copied."""
        return self

    def __reduce__(self) -> tuple:
        """Pickled (``torch.save`` of a whole compiled model) as a new backend with the same options: the
        records hold fake tensors and this process's runtime state (a graph's module, its copies), so
        after a step the backend could not be pickled at all. The loaded model compiles its graphs afresh,
        as after ``torch._dynamo.reset()``. The tools' ``keep_joints`` and ``stop_at_joint`` are not kept."""
        return OffloadBackend, (self.config,)

    @functools.cached_property
    def _rank_check(self) -> RankCheck | None:
        """This backend's side of the plan check across ranks (``check_ranks``), made when first needed:
        ``torch.distributed`` may be initialised after the backend is made."""
        return RankCheck.of_job(self.config.check_ranks, self.config.check_ranks_timeout)

    def step_invocations(self) -> list[GraphRecord]:
        """The latest step's forward invocations, in the order they ran: the record of the graph that
        ran, once per run (one graph serving 32 layers appears 32 times).
        ``fxoffload.passes.step.simulate_step`` replays it."""
        return self._step.invocations()

    def step_caller_kept(self) -> list[tuple[KeptSource, ...]]:
        """Per invocation of :meth:`step_invocations`: the transfers (indices into its plan's
        transfers) whose source, an input of the graph, its caller kept after the graph returned
        (``fxoffload.backend.callers``): ``simulate_step(..., caller_kept=...)`` counts them."""
        return self._step.caller_kept()

    def _region_key(self) -> tuple:
        """The compiled region being compiled: its frame, and its place among the graphs of one
        compile (DDP splits one frame's graph into several). A recompiled frame replaces its regions."""
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = getattr(compile_id, "frame_id", None)
        count = self._compile_count.get(compile_id, 0)
        self._compile_count[compile_id] = count + 1
        again = getattr(compile_id, "frame_compile_id", None)  # a frame's graphs coexist: each is a region
        return (frame, again, count) if frame is not None else ("graph", len(self.records))

    def plan_region(
        self, compilation: "_Compilation", fw: fx.GraphModule, bw: fx.GraphModule, num_user_outputs: int,
        policies: dict[str, str], repartition: Any = None, plain_total: int | None = None,
    ) -> GraphRecord:
        """Plan and rewrite the pair the partition hook made of ``compilation``'s graph (its ``on_pair`` calls
        it), with the step's budget as the regions so far leave it; record it. The compilation says which
        region it is, which inputs are activations, whether it may be re-planned, the key ranks compare it
        under, and the candidate plan of strategy auto to take (``choose``: measured selection), else the
        fastest predicted."""
        region, input_activations, choose = compilation.region, compilation.input_activations, compilation.choose
        replannable, graph = compilation.replannable, compilation.graph
        place = self._step.place(region)
        options, held_before = self._step.options_for(region)
        options = dataclasses.replace(options, total_cap=plain_total,
                                      staging_devices=fxoffload.runtime.staging_device_types())
        if options.device_bytes is not None:  # over several runs, the first run's backward sees the others' gradients
            options = dataclasses.replace(options, run_gradients=compilation.gradient_bytes)

        def plan(options: PlanOptions) -> tuple:
            return plan_best_partition(
                fw, bw, num_user_outputs, repartition,
                options=options, horizon=self.config.horizon, profile=self.config.profile, policies=policies,
                input_activations=input_activations, compare_all=self.config.select == "measured", choose=choose,
                analyses=compilation.analyses,
            )

        provisional = short = False
        out_of_reach = None
        retry = self._step.may_retry(region)
        try:
            with warnings.catch_warnings():
                if retry:  # (said in the last round, if still out of reach there)
                    warnings.simplefilter("ignore", BudgetInfeasibleWarning)
                fw, bw, planned = plan_within_cap(plan, options)
        except BudgetInfeasibleError as error:
            # Waiting for the step's shares may bring a budget within reach, not a cheaper plan of one.
            overhead = isinstance(error, OverheadExceededError)
            if overhead or not (retry or self._step.may_wait(region, bool(input_activations), replannable,
                                                            held_before)):
                raise self._step.in_step(error, region, held_before, options,
                                         symbolic=compilation.inputs.symbolic) from None
            # Out of reach before the first step has shown the step: a graph handed an activation most
            # often serves several layers (planned for PROVISIONAL_RUNS), and a region's share of the step
            # is not known yet; or short of its share in an early round of shares. Planned at the smallest
            # peak where out of reach, until the step re-plans it (see _track and fxoffload.backend.step_budget).
            # (its fields, in an error never raised: the one caught holds the planner's frames in its traceback)
            provisional, out_of_reach = True, error.within("")
            runs = PROVISIONAL_RUNS if input_activations and not self._step.has_share(region) else options.runs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BudgetInfeasibleWarning)
                fw, bw, planned = plan(dataclasses.replace(options, runs=runs, on_infeasible="warn"))
            short = not planned.plan.feasible
        if retry and not planned.plan.feasible:
            self._step.fell_short()  # the next round's shares reserve this plan's smallest peak for it
        # A plan only read (plan_joint's rewrite=False) leaves the pair as it is: it is shared with later plans.
        result: PassResult = planned if compilation.read_only else rewrite_planned(fw, bw, planned)
        if (warning := unbounded_size_warning(result)) is not None:
            warn_from_user(UserWarning(warning))
        held = self._note_plan(region, result.plan, result.timeline, result.schedule)
        self._check_host_memory(fw)
        fields = self._step.fields(region)
        record = GraphRecord(
            index=len(self.records), forward=fw, backward=bw, plan=result.plan, schedule=result.schedule,
            pass_seconds=result.seconds, inner=self.config.inner, timeline=result.timeline,
            profile=self.config.profile, work=result.work, region=place, held_before=held_before,
            held_after=held_before + held, offloaded_inputs=offloaded_inputs(result.plan),
            provisional=provisional, provisional_short=short, out_of_reach=out_of_reach, step_share=fields.share,
            step_budget=fields.budget_bytes, step_round=fields.round,
            largest_saved_input=_largest_saved_input(fw, result.plan, input_activations),
            gradient_bytes=compilation.gradient_bytes,
            candidates=result.candidates, candidate_key=choose,
        )
        self.records.append(record)
        self._step.note_record(record.index, region)
        if log.isEnabledFor(logging.DEBUG):  # explain walks the plan's sizes: seconds on a symbolic 8B graph
            log.debug("fxoffload graph %d\n%s", record.index, explain(record))
        if (check := self._rank_check) is not None:
            self._compared_latest[region] = self._compared_as(region, graph, input_activations, options)
            check.planned(self._compared_latest[region], record.index, plan_digest(record.plan, record.schedule))
        if self.config.inner == "inductor" and not compilation.read_only:
            share_source_layouts(fw, bw)
            for module in (fw, bw):
                pin_offload_order(module)
        return record

    def _compared_as(self, region: tuple, graph: str, input_activations: frozenset[int], options: PlanOptions) -> str:
        """The key ranks compare this plan of ``region`` under (``fxoffload.backend.ranks``): its graph, which of its
        inputs are activations, and once the first step has shown the step, the step (each region's key
        and runs, in order) and the inputs callers keep. Data-parallel replicas share all of it; pipeline
        stages that compile one graph (a block compiled on its own) plan it for steps of their own, and
        differ in it, so they are not compared. The user's options are not in it: ranks given different
        ones share keys, and their plans are compared."""
        key = f"{graph}/in:{','.join(map(str, sorted(input_activations)))}"
        self._compared_graph.setdefault(region, key)
        regions = self._step.regions()
        if regions is None:
            return key
        step = repr([(self._compared_graph.get(r.region, "?"), r.runs) for r in regions])
        kept = ",".join(map(str, sorted(options.kept_inputs)))
        return f"{key}/step:{hashlib.sha256(step.encode()).hexdigest()[:16]}/kept:{kept}"

    def _note_plan(self, region: tuple, plan: Plan, timeline: Any, schedule: Any) -> int:
        """Tell the ledger what a plan of ``region`` holds, takes and spills; what one run leaves for its backward."""
        deferred = sum(int(plan.transfers[p.transfer].nbytes) for p in schedule.placements if p.deferred)
        held = held_after_forward(plan, timeline, schedule)
        self._step.note_plan(region, held, plan.pinned_host_bytes, max(deferred, schedule.ahead_bytes),
                             plan.input_bytes)
        return held

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 **unknown: Any) -> Callable:
        patches = mode_patches(mode, unknown)
        # AOTAutograd's cache would return compiled graphs without running the
        # partitioner, so without our passes' record: keep it off for our graphs.
        # (Inductor's FX-graph cache stays on: it keys the already-rewritten graphs and, for ours, fxoffload's
        # source (fusion_distance.cached_under_our_source); a forward handed back from it tells its prefetches
        # the layouts its offloads write through its code (ordering.layouts_from_code), or is lowered again.)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return with_stack_headroom(self._compile, gm, example_inputs, patches)

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any], patches: dict) -> Callable:
        self._warn_eager_regions()
        region = self._region_key()
        self._callers.dynamo_traced()
        inputs = input_facts(example_inputs)
        measured = self.config.select == "measured"
        if measured:
            _refuse_unchecked_ranks(self._rank_check)
            if inputs.symbolic:
                warn_from_user(UserWarning(MEASURED_SELECTION_SYMBOLIC))
        source = (_Replan.of(gm, example_inputs, inputs, patches)
                  if self.config.runs_per_step == "auto" or measured else None)
        replan = source if self.config.runs_per_step == "auto" else None
        compiled = self._compile_region(gm, example_inputs, region, inputs, patches,
                                        replannable=replan is not None)
        budget = self.config.plan_options.budget
        # Fractions are per region and re-planned regions get their count: nothing to warn about, but for a
        # graph of symbolic sizes, never re-planned (a fraction then bounds one run, not the step's runs).
        warn = budget is not None and replan is None and (
            budget.nbytes is not None or (inputs.symbolic and self.config.runs_per_step == "auto"))
        return self._track(region, _RegionRun(compiled, replan, source if measured else None), warn)

    def _warn_eager_regions(self) -> None:
        """Once: Dynamo ran a region eagerly since the last compile (a checkpointed layer whose forward changes
        Python state), so that nothing in it reaches this backend."""
        now = eager_region_breaks()
        before = self._eager_breaks if now >= self._eager_breaks else 0  # the counts were cleared meanwhile
        self._eager_breaks = now
        if now > before and not self._eager_warned:
            self._eager_warned = True
            warn_from_user(UserWarning(EAGER_REGIONS))

    def _track(self, region: tuple, state: "_RegionRun", warn: bool) -> Callable:
        """Run each forward as a runtime invocation, so that copies crossing graph boundaries find the
        backward that runs next (``fxoffload.runtime``), and tell the runtime when its backward begins.

        Count the region's forwards until a backward begins: one compiled graph may serve several
        layers (per-layer ``compile``, as FSDP2 recipes do). With ``state.replan`` (runs_per_step="auto"),
        a graph whose region ran more often than its plan counted, or whose plan was provisional, is
        re-planned and recompiled, once, before its next forward. With ``warn`` (an absolute budget, no
        re-plan), say with the numbers when the activations of its runs add up past the budget (a fraction,
        of a graph of symbolic sizes never re-planned: when it runs more often than its plan counted). Under
        select="measured", once its plan is final, each step's first forward runs the candidate
        ``_select_step`` says, timed."""

        def run(*args: Any) -> Any:
            # Forwards run inside a backward (checkpoint recomputation) are not the step's, nor is a pipeline
            # stage's metadata inference (see compile_call.pipeline_inference), nor a run while Dynamo compiles
            # (DDP's graph splitting: compile_call.run_while_compiling). (Runs on fake tensors are: fxoffload
            # plan traces its steps so.)
            in_backward = torch._C._current_graph_task_id() != -1
            compiling = run_while_compiling()
            step_forward = torch.is_grad_enabled() and not in_backward and not pipeline_inference() and not compiling
            if step_forward:
                waiting = self._whole_steps.forward_begins(fxoffload.runtime.waiting_forwards())
                if self._step.forward_begins(waiting):  # 1F1B: before the re-plan it may ask for
                    # The step begins again (its forwards so far were only logged): each region counts its runs
                    # anew, so that releases deferred before a graph's last run defer again.
                    self._callers.forget()
                    self._steps += 1
            elif torch.is_grad_enabled() and in_backward:
                state.recomputed = True  # a checkpoint around the region recomputes its forward in the backward
            # The graph changes (a re-plan, measured selection's next candidate) only at a step's forward, and,
            # for a region a checkpoint recomputes, only once none of its forwards waits for its backward: the
            # recomputation must run the graph its forward ran (a new plan saves other values: 1F1B's third
            # forward comes before the second's backward).
            settled = step_forward and not _recomputes_pending(state)
            if settled and state.replan is not None and self._step.counted(region):  # a step has shown its runs
                share = self._step.share(region)
                if self._step.needs_replan(region, state.compiled.compilation.record, share):
                    state.compiled = self._replan(region, state.replan, share)  # a failure raises here, every time
                if self._step.final(state.compiled.compilation.record):
                    state.replan = None  # the graph copy and its inputs go
            if step_forward and self._step.backward_seen:  # a new step
                self._steps += 1
                if (check := self._rank_check) is not None:
                    check.step_begins()  # compare the plans the ranks published in the last one
            if step_forward:
                self._callers.next_forward()
                if state.step != self._steps:  # the region's first forward of this step
                    state.step, state.runs = self._steps, 0
                if state.whole_step != self._whole_steps.count:  # ... of this whole step: selection's turn
                    # A selection step of this region's that ran no backward of it (a loss only logged) again.
                    redo = state.selecting and not state.backward_seen
                    state.whole_step, state.selecting, state.backward_seen = self._whole_steps.count, False, False
                    if settled:
                        self._select_step(region, state, redo)
                state.runs += 1
            # Compiled autograd re-traces the backward: copies cannot be re-traced (refused before the
            # forward runs), and the backward hook below trips its pre-hook reordering where an output's
            # gradient goes unused (transformers' KV cache), so the step goes untracked under it.
            traced_again = compiled_autograd_on()
            record = state.compiled.compilation.record
            if traced_again and record is not None and record.plan.transfers:
                raise CompiledAutogradError(REFUSED_COMPILED_AUTOGRAD)
            if record is not None and not record.host_reserved:
                self._reserve_host(record, args)
            timer = state.compiled.compilation.timer if step_forward else None
            # Not the graph's last run of the step: releases planned so (``defer_before_last``) defer.
            before_last = step_forward and record is not None and state.runs < record.plan.runs
            with _timed(timer, args), fxoffload.runtime.forward_invocation(before_last, compiling) as invocation, \
                    fxoffload.runtime.debugging(self.config.debug), \
                    fxoffload.runtime.pack_hooks_read_landed(invocation):  # a user's hooks read landed bytes
                out = state.compiled.run(*args)
            if step_forward:
                state.ran.append(invocation)
            record = state.compiled.compilation.record
            tracked = step_forward and not traced_again and record is not None
            if tracked and (node := _backward_node(out)) is not None:
                run_index = self._step.note_forward(record, region)
                self._whole_steps.tracked(invocation)
                node.register_prehook(functools.partial(self._on_backward, invocation, state))
                if isinstance(node, torch.autograd.function.BackwardCFunction):  # lives as long as its graph
                    weakref.finalize(node, fxoffload.runtime.forward_abandoned, invocation)
                if warn:
                    self._step.warn_held(region)
                self._callers.after_forward(run_index, record.offloaded_inputs, args)
            return out

        return run

    def _select_step(self, region: tuple, state: "_RegionRun", redo: bool = False) -> None:
        """Measured selection (``fxoffload.backend.selection``), at a region's first forward of a step: once its plan
        is final, run each candidate plan of strategy auto for its steps (compiled when its turn comes,
        timed after a warm-up step), then keep the fastest measured for good."""
        if state.selected or state.replan is not None:
            return
        if state.trials is None:
            record = state.compiled.compilation.record
            candidates = list(record.candidates) if record is not None else []
            if state.source is None or len(candidates) < 2:  # nothing to choose, or no graph to compile again
                state.selected = True
                return
            keys = tuple(c.key for c in candidates)
            state.trials = _Trials(RegionSelection(keys, self.config.select_steps), candidates,
                                   {keys[0]: state.compiled}, self._join_selection(region))
        schedule = state.trials.schedule
        state.compiled.compilation.timer = None
        if redo and not state.trials.published:
            schedule.redo_step()
        schedule.begin_step()
        state.selecting = True
        while not schedule.measured:
            if (compiled := self._trial(region, state.source, state.trials)) is not None:
                state.compiled = compiled
                compiled.compilation.timer = schedule.note if schedule.timing else None
                return
        if state.trials.key is not None and not state.trials.published:
            # Several ranks: publish, run the last candidate one more step, and decide at the next, together.
            self._rank_check.publish_timings(state.trials.key, schedule.seconds(_elapsed))
            state.trials.published = True
            return
        self._keep_fastest(region, state)

    def _join_selection(self, region: tuple) -> str | None:
        """Join this rank to ``region``'s measured selection across ranks; the key the ranks agree under
        (its plan's key in the rank check), or None in one process."""
        check = self._rank_check
        if check is None or region not in self._compared_latest:
            return None
        key = self._compared_latest[region]
        check.joins_selection(key)
        return key

    def _trial(self, region: tuple, source: "_Replan", trials: "_Trials") -> "_Compiled | None":
        """The compiled candidate whose steps these are, compiled at its first; None when it cannot be
        compiled (then left out, with a warning)."""
        index = trials.schedule.candidate
        candidate = trials.candidates[index]
        if candidate.key not in trials.compiled:
            try:
                with torch._functorch.config.patch(enable_autograd_cache=False):
                    source = source.copy()
                    trials.compiled[candidate.key] = self._compile_region(
                        source.module, source.example_inputs, region, source.inputs, source.patches,
                        choose=candidate.key)
            except Exception as error:  # noqa: BLE001 (any failure leaves the candidate out, said)
                warn_from_user(UserWarning(
                    f"fxoffload: measured selection leaves out the plan {candidate.label!r} of compiled region "
                    f"{self._step.place(region)}: compiling it again failed ({error})"))
                trials.schedule.drop(index)
                del trials.candidates[index]
                return None
        return trials.compiled[candidate.key]

    def _keep_fastest(self, region: tuple, state: "_RegionRun") -> None:
        """Read the timed steps, keep the candidate with the least median for good, and tell the ledger its figures."""
        trials = state.trials
        peers = self._rank_check.peer_timings(trials.key) if trials.key is not None else []
        selection = trials.schedule.decide(trials.candidates, _elapsed, peers)
        kept = trials.compiled[selection.kept.key]
        record = kept.compilation.record
        record.selection, record.candidate_key = selection, None
        self._note_plan(region, record.plan, record.timeline, record.schedule)
        state.compiled, state.trials, state.selected = kept, None, True
        log.info("fxoffload: compiled region %d: measured selection keeps %r (median %.3f ms per step, of %d plans)",
                 self._step.place(region), selection.kept.label, 1e3 * (selection.kept.median or 0.0),
                 len(selection.candidates))

    def _reserve_host(self, record: GraphRecord, args: Sequence[Any]) -> None:
        """Make the host blocks the graph's copies will take before its first run queues a kernel, for
        the runs its plan counts (one, until the step has counted them): see ``fxoffload.runtime.pinned``."""
        record.host_reserved = True
        runs = record.plan.runs if record.runs_learned or self.config.runs_per_step != "auto" else 1
        if (wanted := reservation(record.plan, record.forward, args, runs)) is not None:
            fxoffload.runtime.reserve_host(wanted.device, wanted.nbytes)

    def _replan(self, region: tuple, replan: "_Replan", share: Share | None = None) -> "_Compiled":
        """Plan and compile ``region`` again for the runs counted in a step and, with ``share``, its share of
        the step's memory budget (see ``_track``); a plan that fails (an infeasible budget) leaves the
        region as it was, to fail again at its next forward."""
        log.info("fxoffload: compiled region %d ran %d times in one step%s: re-planning it for the whole step and "
                 "recompiling it", self._step.place(region), self._step.counted_runs(region),
                 "" if share is None else f" of {len(self._step.regions())} regions, with its share of the budget")
        with self._step.replanning(region, share), torch._functorch.config.patch(enable_autograd_cache=False):
            source = replan.copy()  # measured selection may compile it again
            compiled = self._compile_region(source.module, source.example_inputs, region,
                                            source.inputs, source.patches)
        if compiled.compilation.record is not None:
            compiled.compilation.record.runs_learned = True
        return compiled

    def _check_host_memory(self, fw: fx.GraphModule) -> None:
        """On CUDA, warn once when the copies' predicted pinned host memory (every region, every run)
        exceeds this process's share of what the node may still take: ``available_host_memory``
        (cgroup-aware) split among the node's processes (``local_processes``: with 8 ranks per
        node, each may take an eighth). The plan does not read it: plans do not depend on the
        machine's state."""
        if self._host_warned or not _on_cuda(fw):
            return
        need = self._step.host_total()
        free, ranks = available_host_memory(), local_processes()
        share = None if free is None else free // ranks
        if share is None or need <= share:
            return
        self._host_warned = True
        shared = (f"; {free} B ({format_bytes(free)}) free on the node, shared by the {ranks} processes "
                  "LOCAL_WORLD_SIZE counts" if ranks > 1 else "")
        warn_from_user(UserWarning(
            f"fxoffload: the step's copies are predicted to take {need} B of pinned host memory ({format_bytes(need)} "
            f"in the caching host allocator's power-of-two blocks, every compiled graph and run), more than the "
            f"{share} B ({format_bytes(share)}) this process may still take (MemAvailable, and its cgroup's memory "
            f"limit{shared}). Pinned memory cannot be swapped out: pass host_budget=<bytes> to cap it."))

    def _on_backward(self, invocation: fxoffload.runtime.Invocation, state: "_RegionRun", grad_outputs: Any) -> None:
        first = self._step.note_backward()  # the step's first backward (its last forward's)
        self._whole_steps.backward_begins()
        state.backward_seen = True
        fxoffload.runtime.backward_begins(invocation)
        if not first:
            return
        if (check := self._rank_check) is not None:
            check.backward_begins()
        self._step.learn(self._callers.backward_begins(fxoffload.runtime.settle, fxoffload.runtime.kept_storages))

    def _compile_region(self, gm: fx.GraphModule, example_inputs: list[Any], region: tuple,
                        inputs: InputFacts, patches: dict, replannable: bool = False,
                        choose: str | None = None) -> "_Compiled":
        """Compile one region; ``inputs``: what the call that compiled it showed of its inputs (:class:`InputFacts`);
        ``patches``: Inductor options of the compile's mode (:func:`fxoffload.backend.compile_call.mode_patches`);
        ``replannable``: the count of its runs may plan it again (see ``_track``); ``choose``: the
        candidate plan to take (measured selection)."""
        compilation = _Compilation(self, region, inputs, replannable, graph_key(gm, example_inputs), choose)
        return _Compiled(self._compile_with(gm, example_inputs, compilation, patches), compilation)

    def _keep_joint(self, compilation: _Compilation, gm: fx.GraphModule, joint_inputs: Any,
                    kwargs: dict, stop: bool = False) -> PartitionMemo:
        joint = Joint(module_copy(gm), joint_inputs, dict(kwargs), compilation.inputs, compilation.graph,
                      torch._guards.TracingContext.try_get(), PartitionMemo())
        self.joints.append(joint)
        if stop:
            raise JointKept("fxoffload: the joint graph is kept; the compile stops here")
        return joint.partition

    def _stops_at_joint(self, gm: fx.GraphModule) -> bool:
        """Under ``stop_at_joint``: whether this compile stops once its joint graph is kept. Only the
        backend's first compile, of a graph dynamo compiled at its frame's return: the step's one graph
        (after a graph break, dynamo compiles more graphs, and each is compiled whole, to be counted)."""
        first, self._compiled_any = not self._compiled_any, True
        reason = getattr(gm, "compile_subgraph_reason", None)  # dynamo's (GraphCompileReason); absent: not stopped
        return self._stop_at_joint and first and reason is not None and reason.graph_break is False

    def plan_joint(self, joint: Joint, *, rewrite: bool = True, replannable: bool = False) -> GraphRecord:
        """Plan ``joint`` (kept by another backend) under this backend's options, as this backend would
        plan the region at its first compile: the partition hook runs on a copy of the joint graph, and
        the pair is planned and rewritten; the record joins ``records``. Nothing is compiled to run (the
        rewritten graphs are the record's only). ``rewrite=False``: the plan is only read (``fit``'s
        probes): it is made on the joint's kept default partition itself, which is left as it is (the
        record's graphs are that pair, not rewritten), and the pair's analysis is kept with it for the next
        such plan (the same plan, the analysis made once). ``replannable``: planned as a compile under
        ``runs_per_step="auto"`` plans it, a budget out of its reach then planned provisionally at the smallest
        peak (``fxoffload plan`` reports it so) where a fraction would otherwise raise. Limits: planned as a
        region of this backend's step, which knows only the joints planned before it (a step of one graph is
        planned as at its compile)."""
        analyses = None if rewrite else joint.partition.analyses
        compilation = _Compilation(self, self._region_key(), joint.inputs, replannable, graph=joint.graph,
                                   analyses=analyses)
        partitioner = Partitioner(compilation.on_pair, compilation.input_activations, memo=joint.partition,
                                  shared=not rewrite)
        with torch._guards.tracing(joint.context), lazy_graph_modules():  # its graphs are read, not run
            # (read only, the partitioner copies the joint graph itself where it partitions it)
            partitioner(module_copy(joint.module) if rewrite else joint.module, joint.joint_inputs, **joint.kwargs)
        return compilation.record

    def _compile_with(self, gm: fx.GraphModule, example_inputs: list[Any], compilation: _Compilation,
                      patches: dict) -> Callable:
        """``gm`` through AOTAutograd with ``compilation``'s partition hook and inner compilers."""
        stop = self._stops_at_joint(gm)
        warn_user_recompute_budget(self.config.memory_budget, self.config.device_budget)
        keep = None if self.joints is None else functools.partial(self._keep_joint, compilation, stop=stop)
        partitioner = Partitioner(compilation.on_pair, compilation.input_activations, keep)
        if self.config.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx  # Inductor: loaded only under inner="inductor"

            constrain_offload_sources()
            return compile_fx(
                gm,
                example_inputs,
                inner_compile=compilation.inductor_inner,
                config_patches={**patches, **no_cudagraphs(), "custom_partitioner_fn": partitioner},
            )
        # Loaded at the first compile under inner="eager" (Inductor's decompositions load its lowering).
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        compiler = aot_autograd(
            fw_compiler=compilation.eager(is_backward=False),
            bw_compiler=compilation.eager(is_backward=True),
            partition_fn=partitioner,
            decompositions=select_decomp_table(),
        )
        return compiler(gm, example_inputs)


@dataclass
class _Trials:
    """A region's candidates under measured selection: their schedule and timings, and those compiled so far."""

    schedule: RegionSelection
    candidates: list[CandidatePlan]  # in predicted order, as the schedule's keys
    compiled: dict[str, _Compiled]  # by candidate key
    key: str | None = None  # the region's key across ranks (None: one rank, nothing to agree)
    published: bool = False  # this rank's timings are in the store; it decides at the next step


@dataclass
class _RegionRun:
    """What a region's run wrapper (``OffloadBackend._track``) carries from one call to the next."""

    compiled: _Compiled  # what runs now
    replan: _Replan | None  # runs_per_step="auto": to plan it again once a step has counted it; None once final
    source: _Replan | None  # select="measured": to compile each candidate plan
    trials: _Trials | None = None  # measured selection under way
    step: int = -1  # the backend's step in which it last ran a forward
    whole_step: int = -1  # the backend's whole step (a pipeline stage's, under 1F1B) in which it last ran one
    selecting: bool = False  # measured selection began a step of it in that whole step
    backward_seen: bool = False  # a backward of it began in that whole step
    runs: int = 0  # its forwards in that step so far
    selected: bool = False  # measured selection is over (or off: no source; or nothing to choose)
    recomputed: bool = False  # a checkpoint around it has recomputed its forward inside a backward
    ran: list = field(default_factory=list)  # its forwards' runtime invocations, while they wait for their backward


def _recomputes_pending(state: _RegionRun) -> bool:
    """Whether a checkpoint may still recompute a forward of this region that waits for its backward (the
    graph must not change until it has): its invocations no longer waiting are forgotten here."""
    waiting = fxoffload.runtime.waiting_forwards()  # (invocations compare by identity)
    state.ran = [run for run in state.ran if run in waiting]
    return state.recomputed and bool(state.ran)


@contextlib.contextmanager
def _timed(timer: Callable[[Mark], None] | None, args: Sequence[Any]) -> Iterator[None]:
    """Hand ``timer`` a :class:`Mark` around the block, on the device of ``args`` (read before the block:
    a boxed graph clears its argument list); nothing without a timer. A block that raises is not timed."""
    device = _device_of(args) if timer is not None else None
    if device is None:
        yield
        return
    start = fxoffload.runtime.timing_mark(device)
    yield
    timer(Mark(device, start, fxoffload.runtime.timing_mark(device)))


def _device_of(args: Sequence[Any]) -> torch.device | None:
    """The device a graph's marks are taken on: its first accelerator tensor argument's, else its first
    tensor's (a CPU scalar beside CUDA tensors must not make the host clock time queued kernels)."""
    devices = [a.device for a in args if isinstance(a, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else None)


def _elapsed(mark: Mark) -> float:
    return fxoffload.runtime.elapsed_seconds(mark.device, mark.start, mark.end)


MEASURED_SELECTION_SYMBOLIC = (
    "fxoffload: select='measured' times nothing for a graph of symbolic sizes (dynamic shapes): its candidate "
    "plans cannot be compiled again outside Dynamo (Dynamo would not check the guards they add), so it keeps the "
    "fastest the cost model predicts, as select='predicted' does; compile with dynamic=False to time them")


def _refuse_unchecked_ranks(check: RankCheck | None) -> None:
    """select="measured" over several ranks only where they agree through the rank check's store
    (``check``): without it each rank would keep the candidate it timed fastest, and ranks must plan alike."""
    import torch.distributed as dist  # here: select="measured" alone needs it

    if check is None and dist.is_available() and dist.is_initialized() and (ranks := dist.get_world_size()) > 1:
        raise OptionError("select", f"select='measured' in a job of {ranks} ranks without check_ranks (or on a rank "
                          "outside its group): each rank would keep the candidate it timed fastest, and ranks must "
                          "plan alike; accepted: 'measured' with check_ranks=True or a ProcessGroup holding this "
                          "rank (the ranks then keep one candidate, by their timings together), or 'predicted'")


def _largest_saved_input(fw: fx.GraphModule, plan: Plan, input_activations: frozenset[int]) -> int:
    """Bytes of the largest input activation (``input_activations``: positions) the plan's graph saves."""
    saved = {d.name for d in plan.decisions}
    sizes = [v.untyped_storage().nbytes() for n in inputs_at(fw.graph, input_activations)
             if n.name in saved and isinstance(v := n.meta.get("val"), torch.Tensor)]
    return max((s for s in sizes if isinstance(s, int)), default=0)  # (symbolic sizes: not re-planned)


def _on_cuda(fw: fx.GraphModule) -> bool:
    """Whether the forward graph takes CUDA tensors (its copies then take pinned host memory)."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
               for n in fw.graph.nodes if n.op == "placeholder")


def offload_backend(**options: Any) -> OffloadBackend:
    """A new backend with the given options (fields of :class:`OffloadConfig`)."""
    return OffloadBackend(config_from_options(options))


_named: dict[OffloadConfig, OffloadBackend] = {}


def named_backend(**options: Any) -> OffloadBackend:
    """The backend ``torch.compile(backend="fxoffload", options=options)`` uses (to read its records)."""
    config = config_from_options(options)
    return _named.setdefault(config, OffloadBackend(config))


def dynamo_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None,
                   mode: str | None = None, **unknown: Any) -> Callable:
    """Entry point for ``torch.compile(backend="fxoffload", options=..., mode=...)``."""
    return named_backend(**(options or {}))(gm, example_inputs, mode, **unknown)


def register_backend_name() -> None:
    """Register ``"fxoffload"`` with dynamo where no entry point names it: a checkout run without
    ``pip install`` (``PYTHONPATH=.``, as on a machine where nothing installs). An installed
    package's entry point (pyproject.toml) names the same function; then this does nothing."""
    # Here: dynamo's registry is read once, at import of the package.
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import register_backend

    if "fxoffload" not in list_backends(exclude_tags=()):
        register_backend(dynamo_backend, name="fxoffload")
