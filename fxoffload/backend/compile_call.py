"""What a compile call says before anything is planned: the Inductor options of its ``torch.compile``
mode (modes that capture CUDA graphs are refused: a replay cannot follow host copies and releases),
the options that keep CUDA graphs off fxoffload's graphs, whether the forward runs inside
``torch.distributed.pipelining``'s shape inference (not a step of its own), and which example inputs
are activations an earlier part of the step made (a layer's hidden state), and whether Dynamo ran a
region eagerly since a count was taken: a break at a higher-order op whose body changes Python state
(a checkpointed layer of transformers 5.25, whose attention sets and resets the `kernels` package's
active functions), after which nothing in that region is planned.

Reads the call's mode and keywords, the interpreter's frames, and the example inputs' autograd
metadata; gives plain values. Limits: the pipeline check walks a fixed number of frames, and an
input is judged an activation on the call that compiles the graph only. Dynamo's break counts are the
process's: a break in another compile counts too, and a compile that breaks at every region (each
checkpointed layer compiled on its own) reaches no backend that could say so.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from fxoffload.passes import tensor_storage_key, warn_from_user

__all__ = ["EAGER_REGIONS", "MODES", "InputFacts", "eager_region_breaks", "input_activations", "input_facts",
           "leaf_gradient_bytes", "mode_patches", "no_cudagraphs", "pipeline_inference", "run_while_compiling",
           "warn_user_recompute_budget"]


MODES = (None, "default", "max-autotune-no-cudagraphs")  # torch.compile modes without CUDA graphs


def mode_patches(mode: str | None, unknown: dict) -> dict:
    """The Inductor options of a ``torch.compile`` mode; ValueError for modes with CUDA graphs and unknown keywords."""
    if mode in MODES and not unknown:
        from torch._inductor import list_mode_options  # Inductor: loaded when a mode asks for it

        return dict(list_mode_options(mode)) if mode not in (None, "default") else {}
    if mode in MODES and "options" in unknown:  # torch.compile hands options={...} to a backend object too
        raise ValueError(
            "fxoffload: torch.compile(backend=offload_backend(...), options={...}) is not supported: a backend "
            "object carries its own options; accepted: offload_backend(memory_budget=..., ...) with no options, "
            "or backend='fxoffload' with options={...}")
    given = f"mode={mode!r}" if mode not in MODES else ", ".join(map(repr, unknown))
    raise ValueError(
        f"fxoffload: torch.compile({given}) is not supported; accepted: no mode, 'default' or "
        "'max-autotune-no-cudagraphs'. CUDA graphs ('reduce-overhead', 'max-autotune') replay fixed addresses "
        "and cannot follow host copies and releases; pass fxoffload options through offload_backend(...) or "
        "options={...}")


_warned_cudagraphs: list[bool] = []


_warned_recompute_budget: list[float] = []


def warn_user_recompute_budget(memory_budget: object, device_budget: object) -> None:
    """Once per value: a user's ``torch._functorch.config.activation_memory_budget`` below 1 beside a budget of
    fxoffload's. PyTorch's partition under it (recomputing to its own budget) is the pair fxoffload plans from,
    so a fraction is of that pair's peak, and ``explain``'s "min-cut" is that budgeted one (a trial,
    2026-12-06: exact, and 0.5 of a pair PyTorch had cut to 0.3)."""
    fraction = torch._functorch.config.activation_memory_budget
    ours = [f"{name}={value!r}" for name, value in (("memory_budget", memory_budget), ("device_budget", device_budget))
            if value is not None]
    if not ours or fraction >= 1.0 or fraction in _warned_recompute_budget:
        return
    _warned_recompute_budget.append(fraction)
    warn_from_user(UserWarning(
        f"fxoffload: torch._functorch.config.activation_memory_budget={fraction:g} is set: PyTorch's partition "
        f"recomputes to it first, and {' and '.join(ours)} then apply to that partition (what explain calls "
        "min-cut; a fraction is of its peak). Leave it at 1.0 to let fxoffload weigh recomputation against "
        "offloading (strategy auto tries PyTorch's budgeted partition among its alternatives)"))


def no_cudagraphs() -> dict:
    """Inductor options that keep CUDA graphs off our graphs, warning once when the global setting asked for them."""
    import torch._inductor.config as inductor_config  # Inductor: loaded when a graph is compiled

    if inductor_config.triton.cudagraphs and not _warned_cudagraphs:
        _warned_cudagraphs.append(True)
        warn_from_user(UserWarning(
            "fxoffload: torch._inductor.config.triton.cudagraphs is on; fxoffload compiles its graphs without CUDA "
            "graphs (a captured graph would replay its copies and waits without their transfers). Other backends' "
            "graphs keep the setting"))
    return {"triton.cudagraphs": False}


# The methods through which torch.distributed.pipelining runs a stage outside its schedule's steps, to infer
# its inputs' and outputs' shapes: on meta tensors in torch 2.11 (_shape_inference), on real ones with a
# backward, once, in the first step, from 2.13 (_forward_metadata_inference).
PIPELINE_INFERENCE = frozenset({"_shape_inference", "_forward_metadata_inference"})


# Dynamo's kind of graph break for a higher-order op (activation checkpointing's among them) whose body
# changes state from outside it: the first line of the break's message, by which Dynamo counts it.
_EAGER_REGION_BREAK = "HOP: Unsafe side effect"
_SKIP_FLAG = "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint"
EAGER_REGIONS = (
    "fxoffload: Dynamo broke the graph at a region whose forward changes Python state (most likely a "
    "checkpointed layer: transformers 5.25's layers set and reset the `kernels` package's active functions), "
    "and runs that region eagerly: nothing in it is planned or offloaded. Set "
    f"`{_SKIP_FLAG} = True` before the first compile: the change then stands in the forward and is skipped "
    "in the layer's recompute (transformers' is undone before its forward returns)."
)


def eager_region_breaks() -> int:
    """How many times Dynamo has broken a graph at a higher-order op whose body changes Python state
    (``torch._dynamo.utils.counters["graph_break"]``, by message: process-wide)."""
    from torch._dynamo.utils import counters

    return sum(n for message, n in counters["graph_break"].items() if message.startswith(_EAGER_REGION_BREAK))


def pipeline_inference(depth: int = 16) -> bool:
    """Whether this forward runs inside a pipeline stage's metadata inference (the ``depth`` callers
    above the compiled forward): its run and its backward are not the step's, and counting them
    would learn a step of one run."""
    if "torch.distributed.pipelining" not in sys.modules:  # the common case: no frames to walk
        return False
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in PIPELINE_INFERENCE and "pipelining" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def run_while_compiling() -> bool:
    """Whether this forward runs while Dynamo compiles a frame (its tracing context is set only then): DDP's
    graph splitting (``optimize_ddp``, the default) compiles the pieces of a frame's graph one after another and
    runs each compiled piece on fake tensors, to hand the next its inputs. That run is not the step's: counted,
    every piece would be planned for two runs a step."""
    return torch._guards.TracingContext.try_get() is not None


def input_activations(example_inputs: list[Any]) -> frozenset[int]:
    """Positions of the inputs that are activations of the step: tensors an earlier part of the
    step made with autograd (they require grad and are not leaves: a hidden state from the layer
    before). The plan counts those its graph saves, once per run of the graph. Leaves (parameters,
    the batch, a user's input that requires grad) and inputs that do not require grad (masks,
    rotary tables) are taken to exist before the step. Judged on the call that compiles the graph:
    a graph first compiled on a leaf does not count the inputs of its later runs. An input that the
    compiled graph which made it also saved (a ``tanh`` output returned at a graph break) is
    counted there, not again."""
    return frozenset(i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)
                     and t.requires_grad and not t.is_leaf and not _held_by_maker(t))


class InputFacts(NamedTuple):
    """What a compile call's example inputs show, judged on the call that compiles the graph (a re-plan's
    fake copies cannot tell): the positions of the activations an earlier part of the step made
    (:func:`input_activations`), the gradients one run's backward leaves (:func:`leaf_gradient_bytes`), and
    whether their sizes are symbolic (dynamic shapes: the graph is never re-planned, :func:`has_symbolic_sizes`)."""

    activations: frozenset[int]
    gradient_bytes: int
    symbolic: bool = False


def input_facts(example_inputs: list[Any]) -> InputFacts:
    return InputFacts(input_activations(example_inputs), leaf_gradient_bytes(example_inputs),
                      has_symbolic_sizes(example_inputs))


def has_symbolic_sizes(example_inputs: list[Any]) -> bool:
    """Whether a graph's inputs have symbolic sizes (dynamic shapes): a size, a stride or an input itself."""
    sizes = [s for t in example_inputs if isinstance(t, torch.Tensor) for s in (*t.shape, *t.stride())]
    return any(isinstance(s, torch.SymInt) for s in (*sizes, *example_inputs))


def leaf_gradient_bytes(example_inputs: list[Any]) -> int:
    """Bytes of the gradients one run's backward leaves in ``.grad``: those of the inputs that require
    grad and are leaves (parameters). They stay on the device while the earlier regions' backwards run;
    an activation's gradient (a hidden state's) is handed to the region before and freed."""
    seen: set = set()
    total = 0
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
            key = tensor_storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _held_by_maker(t: torch.Tensor) -> bool:
    """Whether the compiled graph whose forward returned ``t`` saved its storage for its backward."""
    node = t.grad_fn
    if node is None or "CompiledFunction" not in type(node).__name__:
        return False
    try:
        saved = node.saved_tensors
    except RuntimeError:  # already freed, or unpacked by a hook that refuses: count it (conservative)
        return False
    key = tensor_storage_key(t)
    return any(isinstance(s, torch.Tensor) and tensor_storage_key(s) == key for s in saved)
