"""What differs between the torch releases fxoffload supports (2.11 to 2.14), in one place.

Every shim here detects a capability of the installed torch, never its version string, and names
what differs. Three older checks stay beside the code they serve, each a ``getattr`` with a default:
``passes/ops.py`` (Inductor's ``cudagraph_unsafe`` tag), ``partition.quick_min_cut`` (the
partitioner's ``solve_min_cut``) and ``passes/sizes._hints_evaluated`` (the partitioner's size hint,
``optimization_hint`` from 2.13, ``size_hint`` before). Nothing branches on a version string.

* ``control_deps`` (Inductor's ordering higher-order op, ``fxoffload.backend.ordering`` wraps our ops in
  it) gained in later releases what 2.11 lacks:

  - kernels for running it outside Inductor (``CompositeExplicitAutograd`` and ``Autograd``).
    2.11 raises "could not find kernel for HigherOrderOperator control_deps" wherever a wrapped
    graph runs as an FX graph (Inductor runs some graphs that way, and so do our tests);
  - the side-effect mark: 2.11's dead-code elimination may drop a ``control_deps`` node whose
    output nobody reads.

  :func:`ensure_control_deps` adds both where they are missing.

* 2.11's lowering of ``control_deps`` keeps a dependency only when it is one tensor: a
  multi-output op (a tuple) or an op without output is silently dropped as an edge, and a wrapped
  op must have an output. That is not patched here; ``fxoffload.backend.ordering`` gives every edge a
  tensor on every release, and ``prefetch_ahead`` returns one (``fxoffload.passes.ops``).

* 2.11 and 2.13 take an op's result that only ordering edges read for dead code: the scheduler
  drops it (a ``MultiOutput``) and prunes every edge from the op, which is then free to move.
  ``prefetch_ahead``'s result is such a one; :func:`ensure_control_deps` marks our ops' results
  side-effecting, so that they and their edges stay (``_keep_ordering_outputs``). 2.14 keeps the
  edges without it (``tests/test_ahead_lead.py`` passes there with the mark taken away); the mark
  is harmless there (a result kept is one assignment in the generated code).

* Inductor's fake-tensor update (``torch._inductor.fx_utils``) asks every tensor it compares for its
  storage, a sparse one too, and fails where it reaches one (any release): :func:`ensure_control_deps`
  lets it compare such a tensor as its own storage (``_storage_of_any_layout``).

* Compiled autograd's context (``torch._dynamo.compiled_autograd._enable``) sets the module's
  ``compiled_autograd_enabled`` while it is active; the config flag
  ``torch._dynamo.config.compiled_autograd`` enters that context inside compiled frames:
  :func:`compiled_autograd_on` reads both.

* PyTorch's own offloading pass (``benchmarks/compare.py`` runs it beside ours) reads the link's
  bandwidth from ``torch._functorch.config.activation_offload_cpu_gpu_bw`` where that option exists,
  and from ``torch._inductor.config.cpu_gpu_bw`` on 2.11: :func:`native_offload_bandwidth`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch._dynamo
import torch._dynamo.compiled_autograd
from torch._C import DispatchKey
from torch.fx.node import _side_effectful_functions, has_side_effect

__all__ = ["compiled_autograd_on", "ensure_control_deps", "native_offload_bandwidth"]


def _run_subgraph(additional_deps, subgraph, *args, **kwargs):
    # The dependencies only order the op; running it is running the node it wraps.
    return subgraph(*args, **kwargs)


def ensure_control_deps() -> None:
    """Give Inductor's ``control_deps`` the eager kernels and the side-effect mark it lacks on
    older releases (2.11); a no-op where they exist. Idempotent."""
    from torch._inductor.fx_passes.control_dependencies import control_deps  # Inductor: loaded under inner="inductor"

    for key in (DispatchKey.CompositeExplicitAutograd, DispatchKey.Autograd):
        if key not in control_deps.py_kernels:
            control_deps.py_impl(key)(_run_subgraph)
    if control_deps not in _side_effectful_functions:
        has_side_effect(control_deps)
    _keep_ordering_outputs()
    _storage_of_any_layout()


def _storage_of_any_layout() -> None:
    """Let Inductor's fake-tensor update compare tensors without a storage (every release so far fails).

    After its post-grad passes Inductor updates the fake tensors of the nodes a change reaches, and every
    ``control_deps`` node counts as changed (its subgraph runs again, into new fake storages). Downstream of
    ours, a sparse result (``nn.Embedding(sparse=True)``'s gradient) was then asked for its storage:
    "Cannot access storage of SparseTensorImpl", failing the compile. A tensor without one is its own
    storage here, so the update compares it as a new value (and keeps its meta up to date)."""
    from torch._inductor import fx_utils

    original = fx_utils.get_storage
    if getattr(original, "_fxoffload", False):
        return

    def get_storage(t: torch.Tensor) -> int:
        return original(t) if torch._C._has_storage(t) else id(t)

    get_storage._fxoffload = True
    fx_utils.get_storage = get_storage


def _keep_ordering_outputs() -> None:
    """Keep the output of each of our ops in Inductor's schedule, read or not (2.11 and 2.13 drop it).

    Inductor lowers an op of ours to a kernel call and its tensor result to a ``MultiOutput`` node, and
    a ``control_deps`` edge from the op names that result. A result read through ordering edges alone
    (``prefetch_ahead``'s) is dead code to the scheduler: it drops the node and, with it, every edge
    from the op, which is then free to sink (on an H200 each layer's copy started ahead ran after the
    backward's weight-gradient matmuls, 0.6 ms before its end instead of before attention's backward:
    ``benchmarks/measured/frontier-h200-run7.json``). Marked side-effecting, the node stays, and the
    edges with it (its buffer is still never allocated or written)."""
    from torch._inductor import ir

    original = getattr(ir.MultiOutput, "has_side_effects", None)  # none of its own so far: read as False
    if getattr(original, "_fxoffload", False):
        return

    def has_side_effects(self) -> bool:
        return _of_our_op(self) or (original is not None and original(self))

    has_side_effects._fxoffload = True
    ir.MultiOutput.has_side_effects = has_side_effects


def _of_our_op(node) -> bool:
    """Whether a ``MultiOutput`` is a result of an op of the ``fxoffload`` library (``passes.ops``)."""
    inputs = getattr(node, "inputs", None) or ()
    return bool(inputs) and getattr(getattr(inputs[0], "op_overload", None), "namespace", None) == "fxoffload"


@contextlib.contextmanager
def native_offload_bandwidth(gib_per_second: float) -> Iterator[None]:
    """PyTorch's offloading pass prices its copies at ``gib_per_second`` (GiB/s, its unit) inside."""
    # Here: only the benchmarks that run PyTorch's own offloading pass need these.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if hasattr(functorch_config, "activation_offload_cpu_gpu_bw"):
        with functorch_config.patch(activation_offload_cpu_gpu_bw=gib_per_second):
            yield
    else:  # 2.11: the pass reads Inductor's option
        with inductor_config.patch(cpu_gpu_bw=gib_per_second):
            yield


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is on: ``torch._dynamo.compiled_autograd._enable(...)`` active, or the
    config flag ``torch._dynamo.config.compiled_autograd`` set (it turns compiled autograd on inside
    compiled frames: a backward called outside them runs without it, but a compiled step's does not).
    Read at every forward of a compiled region: two attribute reads."""
    return bool(getattr(torch._dynamo.compiled_autograd, "compiled_autograd_enabled", False)
                or torch._dynamo.config.compiled_autograd)
