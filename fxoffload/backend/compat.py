"""What differs between the torch releases fxoffload supports (2.11 to 2.14), in one place.

Every shim here detects a capability of the installed torch, never its version string, and names
what differs. Two older checks stay beside the code they serve, each a ``getattr`` with a default:
``passes/ops.py`` (Inductor's ``cudagraph_unsafe`` tag) and ``partition.quick_min_cut`` (the
partitioner's ``solve_min_cut``). Nothing branches on a version string.

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
